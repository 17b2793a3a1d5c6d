//! A connection's region, cut into slots, and the two copies that touch it.
//!
//! A frame's payload crosses memory once: the sender copies it into a slot and computes its
//! CRC-32C on the way, piece by piece while each piece is in cache; the receiver checks the
//! CRC on the slot and hands the sink a view of the slot itself, leased until the sink drops
//! it. The sink's own copy into its cache is then the only copy on the receiving side (the
//! decode node's engine imports from it), where a byte stream needs the kernel's copy out of
//! the socket as well.
//!
//! A slot stays leased while the sink holds its payload (the decode node queues it to its
//! engine thread), so the region has [`SLOTS`] of them and each verdict names the slot the
//! sender writes next: the one just read when the sink has let it go, else a free one. A slot
//! is leased only while another is free, so there always is one; when there is not, the
//! payload is copied out as before and its slot is the next one again.
//!
//! The checksum is computed on the slot, and the sink reads the slot afterwards. A sender that
//! rewrote a slot it was not told to write could therefore change a payload after its check;
//! but only the payload of a frame it sent itself on its own connection, into the blocks that
//! frame's header (read from the socket) names, which it could have sent with a matching
//! checksum in the first place. The checksum guards against corruption, and the peer was
//! authenticated before the region existed ([`crate::shm_auth`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::Mmap;

use crate::stream_io;
use crate::transport::PayloadSource;

/// Slots per connection's region: one the sink may still hold, one for the next frame.
pub(super) const SLOTS: usize = 2;

/// How much the fused copy moves before checksumming it: well inside L2.
const PIECE: usize = 64 << 10;

/// Copies `src` into `dst` (the same length) and returns its CRC-32C, computed on each piece
/// just after it was copied, while it is still in cache: one pass over memory, not two.
pub(super) fn copy_in(dst: &mut [u8], src: &[u8]) -> u32 {
    debug_assert_eq!(dst.len(), src.len());
    let mut crc = 0;
    for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
        d.copy_from_slice(s);
        // The sender's own copy: the receiver may not change what is checksummed.
        crc = super::crc::crc32c_append(crc, s);
    }
    crc
}

/// The receiving side's region: where the next frame is, and which slots the sink holds.
pub(crate) struct Slots {
    map: Arc<Mmap>,
    slot_bytes: usize,
    /// Set while a [`Lease`] of the slot lives.
    busy: [Arc<AtomicBool>; SLOTS],
    /// The slot the sender writes the next frame into.
    current: AtomicUsize,
}

impl Slots {
    /// `map` holds [`SLOTS`] slots of `slot_bytes`.
    pub(super) fn new(map: Mmap, slot_bytes: usize) -> Self {
        debug_assert!(map.len() >= SLOTS * slot_bytes);
        Self {
            map: Arc::new(map),
            slot_bytes,
            busy: std::array::from_fn(|_| Arc::new(AtomicBool::new(false))),
            current: AtomicUsize::new(0),
        }
    }

    /// Picks the slot the sender writes its next frame into, to name in the verdict: the
    /// current one when the sink has let it go (its pages are warm), else a free one.
    pub(super) fn next_slot(&self) -> u8 {
        let cur = self.current.load(Ordering::Relaxed);
        let next = if self.is_free(cur) {
            cur
        } else {
            // `take` leased `cur` only while another slot was free, and only this connection
            // leases, so one still is.
            (0..SLOTS).find(|&s| self.is_free(s)).unwrap_or(cur)
        };
        self.current.store(next, Ordering::Relaxed);
        next as u8
    }

    fn is_free(&self, slot: usize) -> bool {
        !self.busy[slot].load(Ordering::Acquire)
    }
}

impl PayloadSource for Slots {
    fn take(&self, len: usize) -> Option<(Bytes, u32)> {
        if len > self.slot_bytes {
            return None;
        }
        let cur = self.current.load(Ordering::Relaxed);
        let off = cur * self.slot_bytes;
        let src = self.map.get(off..off + len)?;
        let spare = (0..SLOTS).any(|s| s != cur && self.is_free(s));
        if !spare {
            // Every other slot is still held by the sink: copy this payload out, so that its
            // slot can take the next frame.
            return stream_io::copy_out(src, len);
        }
        let crc = super::crc::crc32c_append(0, src);
        self.busy[cur].store(true, Ordering::Release);
        let lease = Lease {
            map: self.map.clone(),
            off,
            len,
            busy: self.busy[cur].clone(),
        };
        Some((Bytes::from_owner(lease), crc))
    }

    fn capacity(&self) -> usize {
        self.slot_bytes
    }
}

/// A payload that stays in its slot until the sink drops it.
struct Lease {
    map: Arc<Mmap>,
    off: usize,
    len: usize,
    busy: Arc<AtomicBool>,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.busy.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memmap2::MmapMut;

    fn region(slot_bytes: usize) -> (MmapMut, Mmap) {
        let file = tempfile_in_memory(SLOTS * slot_bytes);
        // SAFETY: a private temporary file that only this test maps.
        let w = unsafe { MmapMut::map_mut(&file) }.unwrap();
        // SAFETY: as above.
        let r = unsafe { Mmap::map(&file) }.unwrap();
        (w, r)
    }

    fn tempfile_in_memory(len: usize) -> std::fs::File {
        let path = std::env::temp_dir().join(format!(
            "fission-slots-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        file.set_len(len as u64).unwrap();
        file
    }

    #[test]
    fn copy_in_checksums_what_it_copies() {
        let src: Vec<u8> = (0..(3 * PIECE + 17)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        assert_eq!(copy_in(&mut dst, &src), crc32c::crc32c(&src));
        assert_eq!(dst, src);
    }

    #[test]
    fn a_held_slot_moves_the_next_frame_and_the_last_free_one_is_copied() {
        let (mut w, r) = region(64);
        let slots = Slots::new(r, 64);
        w[..4].copy_from_slice(b"abcd");
        let (first, crc) = slots.take(4).unwrap();
        assert_eq!((&first[..], crc), (&b"abcd"[..], crc32c::crc32c(b"abcd")));
        // The sink still holds slot 0: the next frame goes to slot 1.
        assert_eq!(slots.next_slot(), 1);
        w[64..68].copy_from_slice(b"efgh");
        // No slot would be left for the frame after: this one is copied out.
        let (second, _) = slots.take(4).unwrap();
        assert_eq!(slots.next_slot(), 1);
        w[64..68].copy_from_slice(b"ijkl");
        assert_eq!(&second[..], b"efgh");
        assert_eq!(&first[..], b"abcd");
        // Slot 0 let go: the frame in slot 1 is leased again, and slot 0 is next.
        drop(first);
        let (third, _) = slots.take(4).unwrap();
        assert_eq!(&third[..], b"ijkl");
        assert_eq!(slots.next_slot(), 0);
        drop(third);
        assert_eq!(slots.next_slot(), 0);
        assert!(slots.take(65).is_none());
    }
}
