//! The sender's one copy into a slot of the shared region ([`crate::slots`]).
//!
//! A frame's payload crosses memory once: the sender copies it into a slot and computes its
//! CRC-32C on the way, piece by piece while each piece is in cache; the receiver checks the
//! CRC on the slot and reads it in place. Where a byte stream needs the kernel's copy out of
//! the socket as well, the sink's own copy into its cache is then the only one on the
//! receiving side. The peer was authenticated before the region existed
//! ([`crate::shm_auth`]).

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
        crc = crate::crc::crc32c_append(crc, s);
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_in_checksums_what_it_copies() {
        let src: Vec<u8> = (0..(3 * PIECE + 17)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        assert_eq!(copy_in(&mut dst, &src), crc32c::crc32c(&src));
        assert_eq!(dst, src);
    }
}
