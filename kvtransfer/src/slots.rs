//! A receiving connection's region cut into slots, whose payloads the sink reads in place.
//!
//! Where the sender writes a frame's payload straight into the receiver's memory (shm's shared
//! file, UCX's registered region), the receiver checks the CRC-32C on the slot and hands the
//! sink a view of the slot itself, leased until the sink drops it. The sink's own copy into its
//! cache is then the only copy on the receiving side.
//!
//! A slot stays leased while the sink holds its payload (the decode node queues it to its
//! engine thread), so the region has [`SLOTS`] of them and the receiver picks the slot of each
//! next frame ([`Slots::next_slot`]): the one just read when the sink has let it go, else a free
//! one. A slot is leased only while another is free, so there always is one; when there is not,
//! the payload is copied out and its slot is the next one again.
//!
//! The checksum is computed on the slot, and the sink reads the slot afterwards. A sender that
//! rewrote a slot after its check could therefore change a payload; but only the payload of a
//! frame it sent itself on its own connection, into the blocks that frame's header (read from
//! the control socket) names, which it could have sent with a matching checksum in the first
//! place. The checksum guards against corruption; the backends admit the peer before the region
//! exists.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use crate::stream_io;
use crate::transport::PayloadSource;

/// Slots per connection's region: one the sink may still hold, one for the next frame.
pub(crate) const SLOTS: usize = 2;

/// The region's memory, kept alive by the receiver and by every payload leased from it.
pub(crate) type Memory = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The receiving side's region: where the next frame is, and which slots the sink holds.
pub(crate) struct Slots {
    map: Memory,
    slot_bytes: usize,
    /// Set while a [`Lease`] of the slot lives.
    busy: [Arc<AtomicBool>; SLOTS],
    /// The slot the sender writes the next frame into.
    current: AtomicUsize,
}

impl Slots {
    /// `map` holds [`SLOTS`] slots of `slot_bytes`.
    pub(crate) fn new(map: Memory, slot_bytes: usize) -> Self {
        debug_assert!((*map).as_ref().len() >= SLOTS * slot_bytes);
        Self {
            map,
            slot_bytes,
            busy: std::array::from_fn(|_| Arc::new(AtomicBool::new(false))),
            current: AtomicUsize::new(0),
        }
    }

    /// Picks the slot the sender writes its next frame into, to name in the verdict: the
    /// current one when the sink has let it go (its pages are warm), else a free one.
    pub(crate) fn next_slot(&self) -> u8 {
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
        let src = (*self.map).as_ref().get(off..off + len)?;
        let spare = (0..SLOTS).any(|s| s != cur && self.is_free(s));
        if !spare {
            // Every other slot is still held by the sink: copy this payload out, so that its
            // slot can take the next frame.
            return stream_io::copy_out(src, len);
        }
        let crc = crate::crc::crc32c_append(0, src);
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
    map: Memory,
    off: usize,
    len: usize,
    busy: Arc<AtomicBool>,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        &(*self.map).as_ref()[self.off..self.off + self.len]
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
    use memmap2::{Mmap, MmapMut};

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
    fn a_held_slot_moves_the_next_frame_and_the_last_free_one_is_copied() {
        let (mut w, r) = region(64);
        let slots = Slots::new(Arc::new(r), 64);
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
