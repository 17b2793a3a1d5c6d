//! CRC-32C at memory speed: carry-less multiplication on 512-bit registers (VPCLMULQDQ).
//!
//! Once a payload crosses memory only once, its two checksums (the sender's, while it copies,
//! and the receiver's, on the slot) are most of shared memory's cost: the `crc32` instruction
//! the `crc32c` crate uses retires 8 bytes a cycle at best, about as fast as a copy. Folding
//! with carry-less multiplies does 256 bytes per step in four independent chains. The result is
//! the same CRC-32C (the frame format's checksum); CPUs without AVX-512 and VPCLMULQDQ use the
//! `crc32c` crate.
//!
//! Folding keeps a 128-bit remainder congruent to the message so far modulo the polynomial
//! (Intel's "Fast CRC Computation Using PCLMULQDQ", the reflected variant); its last 16 bytes
//! then go through the `crc32` instruction instead of a Barrett reduction, which needs no
//! further constants.

/// CRC-32C of `data` appended to `crc` (as [`crc32c::crc32c_append`]): every payload checksum
/// of the crate, sender and receiver, goes through it.
pub(crate) fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if data.len() >= MIN_LEN && has_vpclmulqdq() {
            // SAFETY: the CPU has the features the function is compiled for (checked above).
            return unsafe { x86::crc32c_append(crc, data) };
        }
    }
    crc32c::crc32c_append(crc, data)
}

/// Below this the `crc32c` crate is as fast.
const MIN_LEN: usize = 1024;

#[cfg(target_arch = "x86_64")]
fn has_vpclmulqdq() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
            && std::arch::is_x86_feature_detected!("sse4.2")
    })
}

/// CRC-32C's polynomial, normal (not reflected) form, without the x^32 term.
const POLY: u32 = 0x1EDC_6F41;

/// The folding constant for a distance of `n` bits: (x^n mod P), bit-reflected, shifted left
/// by one (the reflected domain's extra factor of x), as a 33-bit value.
const fn fold_constant(poly: u32, n: u32) -> u64 {
    // x^n mod P by repeated multiplication by x, from x^0.
    let mut r: u32 = 1;
    let mut i = 0;
    while i < n {
        let carry = r & 0x8000_0000 != 0;
        r <<= 1;
        if carry {
            r ^= poly;
        }
        i += 1;
    }
    (r.reverse_bits() as u64) << 1
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{fold_constant, POLY};
    use std::arch::x86_64::*;

    /// Four 512-bit chains: fold by 4 x 512 bits.
    const K_2048: (u64, u64) = (
        fold_constant(POLY, 2048 + 32),
        fold_constant(POLY, 2048 - 32),
    );
    /// One 512-bit register into the next.
    const K_512: (u64, u64) = (fold_constant(POLY, 512 + 32), fold_constant(POLY, 512 - 32));
    /// One 128-bit lane into the next.
    const K_128: (u64, u64) = (fold_constant(POLY, 128 + 32), fold_constant(POLY, 128 - 32));

    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold512(acc: __m512i, next: __m512i, k: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
        let hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
        // lo ^ hi ^ next in one instruction (0x96: three-way xor).
        _mm512_ternarylogic_epi64(lo, hi, next, 0x96)
    }

    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold128(acc: __m128i, next: __m128i, k: __m128i) -> __m128i {
        let lo = _mm_clmulepi64_si128(acc, k, 0x00);
        let hi = _mm_clmulepi64_si128(acc, k, 0x11);
        _mm_xor_si128(_mm_xor_si128(lo, hi), next)
    }

    #[target_feature(enable = "avx512f")]
    fn keys512(k: (u64, u64)) -> __m512i {
        let (lo, hi) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    #[target_feature(enable = "avx512f")]
    fn load(chunk: &[u8]) -> __m512i {
        assert!(chunk.len() >= 64);
        // SAFETY: 64 readable bytes (checked); unaligned loads are allowed.
        unsafe { _mm512_loadu_si512(chunk.as_ptr().cast()) }
    }

    /// # Safety
    /// The CPU must have AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE 4.2, and `data` at least
    /// 256 bytes.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
        let mut chunks = data.chunks_exact(256);
        let Some(first) = chunks.next() else {
            return crc32c::crc32c_append(crc, data);
        };
        let mut x0 = load(&first[..64]);
        let mut x1 = load(&first[64..128]);
        let mut x2 = load(&first[128..192]);
        let mut x3 = load(&first[192..]);
        // The register's initial value is the same as xoring it into the first 32 bits.
        x0 = _mm512_xor_si512(x0, _mm512_castsi128_si512(_mm_cvtsi32_si128(!crc as i32)));
        let k = keys512(K_2048);
        for c in chunks.by_ref() {
            x0 = fold512(x0, load(&c[..64]), k);
            x1 = fold512(x1, load(&c[64..128]), k);
            x2 = fold512(x2, load(&c[128..192]), k);
            x3 = fold512(x3, load(&c[192..]), k);
        }
        let mut rest = chunks.remainder();
        let k = keys512(K_512);
        let mut x = fold512(x0, x1, k);
        x = fold512(x, x2, k);
        x = fold512(x, x3, k);
        while rest.len() >= 64 {
            x = fold512(x, load(&rest[..64]), k);
            rest = &rest[64..];
        }
        let k = _mm_set_epi64x(K_128.1 as i64, K_128.0 as i64);
        let mut v = _mm512_extracti32x4_epi32::<0>(x);
        v = fold128(v, _mm512_extracti32x4_epi32::<1>(x), k);
        v = fold128(v, _mm512_extracti32x4_epi32::<2>(x), k);
        v = fold128(v, _mm512_extracti32x4_epi32::<3>(x), k);
        // The remainder's 16 bytes, through the crc32 instruction from a zero register.
        let lo = _mm_cvtsi128_si64(v) as u64;
        let hi = _mm_extract_epi64::<1>(v) as u64;
        let reg = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32;
        crc32c::crc32c_append(!reg, rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_constants_match_the_published_crc32_ones() {
        // The same function over CRC-32 (IEEE) gives Intel's / Linux's published constants.
        const IEEE: u32 = 0x04C1_1DB7;
        assert_eq!(fold_constant(IEEE, 4 * 128 + 32), 0x1_5444_2bd4);
        assert_eq!(fold_constant(IEEE, 4 * 128 - 32), 0x1_c6e4_1596);
        assert_eq!(fold_constant(IEEE, 128 + 32), 0x1_7519_97d0);
        assert_eq!(fold_constant(IEEE, 128 - 32), 0x0_ccaa_009e);
    }

    #[test]
    fn equals_the_crc32c_crate_at_every_length_and_start() {
        let data: Vec<u8> = (0..9100u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in (0..2100).chain([4095, 4096, 4097, 8191, 8999]) {
            for start in [0, 1, 7] {
                let d = &data[start..start + len];
                for crc in [0, 0xdead_beef] {
                    assert_eq!(
                        crc32c_append(crc, d),
                        crc32c::crc32c_append(crc, d),
                        "len {len} start {start} crc {crc:x}"
                    );
                }
            }
        }
    }
}
