//! A fixed-length buffer for packed weights, on 2 MiB pages where the kernel grants them.
//!
//! A decode step reads every weight once: 538 MB for the SmolLM2-135M shape in f32, which on
//! 4 KiB pages is 130,000 page-table walks per step, far more than the TLBs hold. Buffers of
//! at least one huge page are aligned to 2 MiB and marked `MADV_HUGEPAGE` before their first
//! write, so transparent huge pages back them even where THP is only enabled on request
//! (`madvise`, Debian's default). Where the kernel declines, the buffer is an ordinary one.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The huge page size on x86-64 and most aarch64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// `len` values of `T`, allocated once.
pub(crate) struct HugeVec<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is owned like a `Vec<T>`; sharing or sending it is sharing or sending
// `T`s.
unsafe impl<T: Copy + Send> Send for HugeVec<T> {}
// SAFETY: as above; `&HugeVec` only gives `&[T]`.
unsafe impl<T: Copy + Sync> Sync for HugeVec<T> {}

impl<T: Copy> HugeVec<T> {
    /// `len` copies of `value`.
    pub(crate) fn filled(value: T, len: usize) -> Self {
        let bytes = std::mem::size_of::<T>() * len;
        let align = if bytes >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            std::mem::align_of::<T>()
        };
        if bytes == 0 {
            return HugeVec {
                ptr: NonNull::dangling(),
                len,
                layout: Layout::from_size_align(0, align).expect("a power of two"),
            };
        }
        let layout = Layout::from_size_align(bytes, align)
            .expect("weights far below isize::MAX bytes, power-of-two alignment");
        // SAFETY: the layout's size is non-zero.
        let raw = unsafe { alloc(layout) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else {
            handle_alloc_error(layout)
        };
        if align == HUGE_PAGE {
            advise_huge(raw, bytes);
        }
        for i in 0..len {
            // SAFETY: `i < len`, inside the allocation; each slot is written once before any
            // read, and `T: Copy` has no drop.
            unsafe { ptr.as_ptr().add(i).write(value) };
        }
        HugeVec { ptr, len, layout }
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        self
    }

    /// Whether the buffer starts on a huge-page boundary (it is big enough to ask for one).
    #[cfg(test)]
    fn huge_aligned(&self) -> bool {
        (self.ptr.as_ptr() as usize).is_multiple_of(HUGE_PAGE)
    }
}

/// Asks for huge pages over `bytes` at `p` (2 MiB-aligned). Advice only: on failure, or on
/// other systems, the pages stay small and nothing else changes.
fn advise_huge(p: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `p..p + bytes` is one live allocation of ours, page-aligned; MADV_HUGEPAGE does
    // not change its contents.
    unsafe {
        libc::madvise(p.cast(), bytes, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, bytes);
}

impl<T: Copy> Deref for HugeVec<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised values (or a dangling pointer for none).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for HugeVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` is the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> Clone for HugeVec<T> {
    fn clone(&self) -> Self {
        let Some(&first) = self.first() else {
            return HugeVec {
                ptr: NonNull::dangling(),
                len: 0,
                layout: self.layout,
            };
        };
        let mut copy = HugeVec::filled(first, self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Copy> Drop for HugeVec<T> {
    fn drop(&mut self) {
        if self.layout.size() != 0 {
            // SAFETY: allocated in `filled` with this layout.
            unsafe { dealloc(self.ptr.as_ptr().cast(), self.layout) };
        }
    }
}

impl<T: Copy + std::fmt::Debug> std::fmt::Debug for HugeVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeVec").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_its_values_at_every_size() {
        for len in [0usize, 1, 3, 1000, HUGE_PAGE / 4 + 5] {
            let mut v = HugeVec::filled(7u32, len);
            assert_eq!(v.len(), len);
            assert!(v.iter().all(|&x| x == 7));
            for (i, x) in v.iter_mut().enumerate() {
                *x = i as u32;
            }
            let c = v.clone();
            assert_eq!(c.as_slice(), v.as_slice());
            drop(v);
            assert!(c.iter().enumerate().all(|(i, &x)| x == i as u32));
        }
    }

    #[test]
    fn buffers_of_a_huge_page_or_more_start_on_one() {
        assert!(HugeVec::filled(0u8, HUGE_PAGE).huge_aligned());
        assert!(HugeVec::filled(0f32, HUGE_PAGE).huge_aligned());
    }
}
