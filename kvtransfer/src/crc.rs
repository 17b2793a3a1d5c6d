//! CRC-32C at memory speed: folding with carry-less multiplies on the widest registers the CPU
//! has (512 or 256 bits).
//!
//! Once a payload crosses memory only once, its two checksums (the sender's, while it copies,
//! and the receiver's, on the slot) are most of shared memory's cost: the `crc32` instruction
//! the `crc32c` crate uses retires 8 bytes a cycle at best, about as fast as a copy. Folding
//! with carry-less multiplies does four registers per step in four independent chains. The
//! result is the same CRC-32C (the frame format's checksum).
//!
//! Folding keeps a 128-bit remainder congruent to the message so far modulo the polynomial
//! (Intel's "Fast CRC Computation Using PCLMULQDQ", the reflected variant); its last 16 bytes
//! then go through the `crc32` instruction instead of a Barrett reduction, which needs no
//! further constants.
//!
//! One folding loop serves three x86-64 paths, which differ only in register width: AVX-512 with
//! VPCLMULQDQ (Zen 4+, Ice Lake+ servers), AVX2 with VPCLMULQDQ (Zen 3, Alder Lake) and plain
//! PCLMULQDQ (any x86-64 CPU of the last 12 years). The wider two are picked at run time, the
//! widest the CPU has, detected once; the 128-bit one measured slower than the crate (see
//! `Path::DISPATCHED`), so other CPUs and architectures use the `crc32c` crate.

/// CRC-32C of `data` appended to `crc` (as [`crc32c::crc32c_append`]): every payload checksum
/// of the crate, sender and receiver, goes through it.
pub(crate) fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if data.len() >= MIN_LEN {
            if let Some(path) = x86::Path::widest() {
                // SAFETY: `widest` returns only a path the CPU supports.
                return unsafe { path.crc32c_append(crc, data) };
            }
        }
    }
    crc32c::crc32c_append(crc, data)
}

/// Below this the `crc32c` crate is as fast.
const MIN_LEN: usize = 1024;

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

/// The pair of constants that folds a 128-bit lane `bytes` further on: the lane's low 64 bits
/// travel `8 * bytes + 32` bits, its high 64 bits `8 * bytes - 32`.
const fn fold_keys(bytes: usize) -> (u64, u64) {
    let bits = 8 * bytes as u32;
    (
        fold_constant(POLY, bits + 32),
        fold_constant(POLY, bits - 32),
    )
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::fold_keys;
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    /// A folding path: a register width and the CPU features it needs.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(super) enum Path {
        /// 512-bit registers: AVX-512F and VPCLMULQDQ.
        Avx512,
        /// 256-bit registers: AVX2 and VPCLMULQDQ.
        Avx2,
        /// 128-bit registers: PCLMULQDQ.
        #[cfg_attr(
            not(test),
            expect(dead_code, reason = "tested, not dispatched: see `Path::DISPATCHED`")
        )]
        Pclmul,
    }

    impl Path {
        /// Widest first.
        #[cfg(test)]
        pub(super) const ALL: [Path; 3] = [Path::Avx512, Path::Avx2, Path::Pclmul];

        /// The paths [`Path::widest`] picks from. Not `Pclmul`: it ran at 0.5x the crate on
        /// Zen 5 (benchmarks/history/2026-11-29-crc-paths.md), where every width ran the same
        /// number of carry-less multiplies a second while the crate's three `crc32` streams
        /// run at 30 GB/s; on cores that lack VPCLMULQDQ, instruction tables give the crate at
        /// least the same 8 bytes a cycle. It stays tested for a CPU where it measures faster.
        const DISPATCHED: [Path; 2] = [Path::Avx512, Path::Avx2];

        /// The widest dispatched path this CPU supports, detected once.
        pub(super) fn widest() -> Option<Path> {
            static WIDEST: OnceLock<Option<Path>> = OnceLock::new();
            *WIDEST.get_or_init(|| {
                Path::DISPATCHED
                    .into_iter()
                    .find(|path| path.is_supported())
            })
        }

        pub(super) fn is_supported(self) -> bool {
            use std::arch::is_x86_feature_detected as has;
            // Every path ends in the `crc32` instruction (SSE 4.2).
            let base = has!("pclmulqdq") && has!("sse4.2");
            base && match self {
                Path::Avx512 => has!("avx512f") && has!("vpclmulqdq"),
                Path::Avx2 => has!("avx2") && has!("vpclmulqdq"),
                Path::Pclmul => true,
            }
        }

        /// CRC-32C of `data` appended to `crc` on this path.
        ///
        /// # Safety
        /// The CPU must support the path ([`Path::is_supported`]).
        pub(super) unsafe fn crc32c_append(self, crc: u32, data: &[u8]) -> u32 {
            // SAFETY: the CPU has the path's features (the caller's promise), which are the
            // ones each function is compiled for.
            unsafe {
                match self {
                    Path::Avx512 => fold_avx512(crc, data),
                    Path::Avx2 => fold_avx2(crc, data),
                    Path::Pclmul => fold_pclmul(crc, data),
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold_avx512(crc: u32, data: &[u8]) -> u32 {
        // SAFETY: compiled for (and only called with) `__m512i`'s features.
        unsafe { fold::<__m512i>(crc, data) }
    }

    #[target_feature(enable = "avx2,vpclmulqdq,pclmulqdq,sse4.2")]
    fn fold_avx2(crc: u32, data: &[u8]) -> u32 {
        // SAFETY: compiled for (and only called with) `__m256i`'s features.
        unsafe { fold::<__m256i>(crc, data) }
    }

    #[target_feature(enable = "pclmulqdq,sse4.2")]
    fn fold_pclmul(crc: u32, data: &[u8]) -> u32 {
        // SAFETY: compiled for (and only called with) `__m128i`'s features.
        unsafe { fold::<__m128i>(crc, data) }
    }

    /// Folds `data` four registers a step in four independent chains, then one register at a
    /// time, then lane by lane into 128 bits, which the `crc32` instruction reduces; the bytes
    /// short of a register go through the crate.
    ///
    /// `#[inline(always)]`, as are [`Register`]'s methods, which have no target features of
    /// their own: everything is inlined into a `fold_*` function above, whose features the
    /// intrinsics then get.
    ///
    /// # Safety
    /// The CPU must have `R`'s features (see its `fold_*` function).
    #[inline(always)]
    unsafe fn fold<R: Register>(crc: u32, data: &[u8]) -> u32 {
        let mut chunks = data.chunks_exact(4 * R::BYTES);
        let Some(first) = chunks.next() else {
            return crc32c::crc32c_append(crc, data);
        };
        // SAFETY (every block below): the caller's CPU has `R`'s features.
        let [mut x0, mut x1, mut x2, mut x3] = unsafe { load4::<R>(first) };
        // The register's initial value is the same as xoring it into the first 32 bits.
        x0 = unsafe { x0.xor_low_lane(_mm_cvtsi32_si128(!crc as i32)) };
        let k = unsafe { R::broadcast(keys(R::FOLD_4)) };
        for c in chunks.by_ref() {
            unsafe {
                let [n0, n1, n2, n3] = load4::<R>(c);
                x0 = x0.fold(n0, k);
                x1 = x1.fold(n1, k);
                x2 = x2.fold(n2, k);
                x3 = x3.fold(n3, k);
            }
        }
        let mut rest = chunks.remainder();
        let k = unsafe { R::broadcast(keys(R::FOLD_1)) };
        let mut x = unsafe { x0.fold(x1, k).fold(x2, k).fold(x3, k) };
        while rest.len() >= R::BYTES {
            x = unsafe { x.fold(R::load(rest), k) };
            rest = &rest[R::BYTES..];
        }
        let v = unsafe { x.fold_lanes() };
        // The remainder's 16 bytes, through the crc32 instruction from a zero register.
        let reg = unsafe {
            let lo = _mm_cvtsi128_si64(v) as u64;
            let hi = _mm_extract_epi64::<1>(v) as u64;
            _mm_crc32_u64(_mm_crc32_u64(0, lo), hi) as u32
        };
        crc32c::crc32c_append(!reg, rest)
    }

    /// The first four registers of `chunk` (which must have them: checked).
    ///
    /// # Safety
    /// As [`Register::load`].
    #[inline(always)]
    unsafe fn load4<R: Register>(chunk: &[u8]) -> [R; 4] {
        let n = R::BYTES;
        // SAFETY: the caller's promise; `load` checks the lengths. (No `array::map`: it is not
        // always inlined, and then the hot loop calls it.)
        unsafe {
            [
                R::load(chunk),
                R::load(&chunk[n..]),
                R::load(&chunk[2 * n..]),
                R::load(&chunk[3 * n..]),
            ]
        }
    }

    /// Fold constants over one 128-bit lane.
    const FOLD_LANE: (u64, u64) = fold_keys(16);

    /// A fold constant pair as one 128-bit lane (low constant in the low half).
    #[inline(always)]
    fn keys(k: (u64, u64)) -> __m128i {
        // SAFETY: SSE2, which every x86-64 CPU has.
        unsafe { _mm_set_epi64x(k.1 as i64, k.0 as i64) }
    }

    /// A register of 128-bit lanes that are carry-less multiplied each on its own: all the
    /// folding loop needs to know about a width.
    ///
    /// # Safety
    /// Every method needs the CPU features of the register's `fold_*` function.
    trait Register: Copy {
        const BYTES: usize;
        /// Fold constants over four registers (a chain's step) and over one, as consts: the
        /// loop in `fold_constant` must not run per call.
        const FOLD_4: (u64, u64) = fold_keys(4 * Self::BYTES);
        const FOLD_1: (u64, u64) = fold_keys(Self::BYTES);

        /// The first `BYTES` of `bytes`, which must have that many (checked).
        unsafe fn load(bytes: &[u8]) -> Self;

        /// `lane` in every lane.
        unsafe fn broadcast(lane: __m128i) -> Self;

        /// `self`'s lanes folded (by the constants in `k`'s lanes) onto `next`'s.
        unsafe fn fold(self, next: Self, k: Self) -> Self;

        /// `self` with `lane` xored into its lowest lane.
        unsafe fn xor_low_lane(self, lane: __m128i) -> Self;

        /// The lanes folded, lowest first, into one.
        unsafe fn fold_lanes(self) -> __m128i;
    }

    impl Register for __m128i {
        const BYTES: usize = 16;

        #[inline(always)]
        unsafe fn load(bytes: &[u8]) -> Self {
            assert!(bytes.len() >= Self::BYTES);
            // SAFETY: 16 readable bytes (checked); unaligned loads are allowed.
            unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
        }

        #[inline(always)]
        unsafe fn broadcast(lane: __m128i) -> Self {
            lane
        }

        #[inline(always)]
        unsafe fn fold(self, next: Self, k: Self) -> Self {
            // SAFETY: PCLMULQDQ (the caller's promise).
            unsafe {
                let lo = _mm_clmulepi64_si128(self, k, 0x00);
                let hi = _mm_clmulepi64_si128(self, k, 0x11);
                _mm_xor_si128(_mm_xor_si128(lo, hi), next)
            }
        }

        #[inline(always)]
        unsafe fn xor_low_lane(self, lane: __m128i) -> Self {
            // SAFETY: SSE2, which every x86-64 CPU has.
            unsafe { _mm_xor_si128(self, lane) }
        }

        #[inline(always)]
        unsafe fn fold_lanes(self) -> __m128i {
            self
        }
    }

    impl Register for __m256i {
        const BYTES: usize = 32;

        #[inline(always)]
        unsafe fn load(bytes: &[u8]) -> Self {
            assert!(bytes.len() >= Self::BYTES);
            // SAFETY: 32 readable bytes (checked); unaligned loads are allowed; AVX (the
            // caller's promise).
            unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) }
        }

        #[inline(always)]
        unsafe fn broadcast(lane: __m128i) -> Self {
            // SAFETY: AVX2 (the caller's promise).
            unsafe { _mm256_broadcastsi128_si256(lane) }
        }

        #[inline(always)]
        unsafe fn fold(self, next: Self, k: Self) -> Self {
            // SAFETY: AVX2 and VPCLMULQDQ (the caller's promise).
            unsafe {
                let lo = _mm256_clmulepi64_epi128(self, k, 0x00);
                let hi = _mm256_clmulepi64_epi128(self, k, 0x11);
                _mm256_xor_si256(_mm256_xor_si256(lo, hi), next)
            }
        }

        #[inline(always)]
        unsafe fn xor_low_lane(self, lane: __m128i) -> Self {
            // SAFETY: AVX2 (the caller's promise).
            unsafe { _mm256_xor_si256(self, _mm256_zextsi128_si256(lane)) }
        }

        #[inline(always)]
        unsafe fn fold_lanes(self) -> __m128i {
            // SAFETY: AVX2 and PCLMULQDQ (the caller's promise).
            unsafe {
                let k = keys(FOLD_LANE);
                let lo = _mm256_castsi256_si128(self);
                lo.fold(_mm256_extracti128_si256::<1>(self), k)
            }
        }
    }

    impl Register for __m512i {
        const BYTES: usize = 64;

        #[inline(always)]
        unsafe fn load(bytes: &[u8]) -> Self {
            assert!(bytes.len() >= Self::BYTES);
            // SAFETY: 64 readable bytes (checked); unaligned loads are allowed; AVX-512F (the
            // caller's promise).
            unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) }
        }

        #[inline(always)]
        unsafe fn broadcast(lane: __m128i) -> Self {
            // SAFETY: AVX-512F (the caller's promise).
            unsafe { _mm512_broadcast_i32x4(lane) }
        }

        #[inline(always)]
        unsafe fn fold(self, next: Self, k: Self) -> Self {
            // SAFETY: AVX-512F and VPCLMULQDQ (the caller's promise).
            unsafe {
                let lo = _mm512_clmulepi64_epi128(self, k, 0x00);
                let hi = _mm512_clmulepi64_epi128(self, k, 0x11);
                // lo ^ hi ^ next in one instruction (0x96: three-way xor).
                _mm512_ternarylogic_epi64(lo, hi, next, 0x96)
            }
        }

        #[inline(always)]
        unsafe fn xor_low_lane(self, lane: __m128i) -> Self {
            // SAFETY: AVX-512F (the caller's promise).
            unsafe { _mm512_xor_si512(self, _mm512_zextsi128_si512(lane)) }
        }

        #[inline(always)]
        unsafe fn fold_lanes(self) -> __m128i {
            // SAFETY: AVX-512F and PCLMULQDQ (the caller's promise).
            unsafe {
                let k = keys(FOLD_LANE);
                let v = _mm512_extracti32x4_epi32::<0>(self);
                let v = v.fold(_mm512_extracti32x4_epi32::<1>(self), k);
                let v = v.fold(_mm512_extracti32x4_epi32::<2>(self), k);
                v.fold(_mm512_extracti32x4_epi32::<3>(self), k)
            }
        }
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

    /// Deterministic filler bytes and seeds (splitmix64), different at every call.
    struct Filler(u64);

    impl Filler {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn bytes(&mut self, len: usize) -> Vec<u8> {
            (0..len).map(|_| self.next_u64() as u8).collect()
        }
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

    /// The paths this CPU runs, each forced; a loud line for those it cannot.
    #[cfg(target_arch = "x86_64")]
    fn supported_paths() -> Vec<x86::Path> {
        let (yes, no): (Vec<_>, Vec<_>) = x86::Path::ALL
            .into_iter()
            .partition(|path| path.is_supported());
        for path in &no {
            eprintln!("SKIPPED: this CPU cannot run the {path:?} CRC-32C path");
        }
        yes
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_path_equals_the_crate_at_every_length_offset_and_seed() {
        let mut filler = Filler(34);
        let data = filler.bytes(2100 + 64);
        for path in supported_paths() {
            for len in 0..=2100 {
                for start in [0, 1, 3, 7, 13, 33, 63] {
                    let d = &data[start..start + len];
                    let crc = filler.next_u64() as u32;
                    // SAFETY: `supported_paths` returns only paths the CPU supports.
                    let got = unsafe { path.crc32c_append(crc, d) };
                    let want = crc32c::crc32c_append(crc, d);
                    assert_eq!(got, want, "{path:?} len {len} start {start} crc {crc:x}");
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_path_equals_the_crate_on_large_buffers() {
        let mut filler = Filler(35);
        let data = filler.bytes((3 << 20) + 64);
        for path in supported_paths() {
            for (start, len) in [(0, (1 << 20) + 17), (5, (1 << 20) + 17), (31, 3 << 20)] {
                let d = &data[start..start + len];
                let crc = filler.next_u64() as u32;
                // SAFETY: `supported_paths` returns only paths the CPU supports.
                let got = unsafe { path.crc32c_append(crc, d) };
                let want = crc32c::crc32c_append(crc, d);
                assert_eq!(got, want, "{path:?} len {len} start {start} crc {crc:x}");
            }
        }
    }

    /// Throughput of each path against the crate, alternating, median of the rounds:
    /// `cargo test --release -p kvtransfer --lib crc::tests::throughput -- --ignored --nocapture`.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore = "a measurement, not a check: run it by hand on a quiet machine"]
    fn throughput_of_every_path_against_the_crate() {
        use std::hint::black_box;
        use std::time::Instant;

        const ROUNDS: usize = 11;
        /// Bytes each timed sample checksums, whatever the buffer size.
        const SAMPLE_BYTES: usize = 64 << 20;

        let paths = supported_paths();
        println!("path          size     GB/s median [min, max]   vs crate");
        for len in [1 << 10, 64 << 10, 4 << 20] {
            let data = Filler(len as u64).bytes(len);
            let reps = SAMPLE_BYTES / len;
            // Index 0 is the crate, then one per path; each round runs them all in turn.
            let mut gbps = vec![Vec::with_capacity(ROUNDS); 1 + paths.len()];
            for _ in 0..ROUNDS {
                for (i, samples) in gbps.iter_mut().enumerate() {
                    let start = Instant::now();
                    let mut crc = 0;
                    for _ in 0..reps {
                        crc = match i {
                            0 => crc32c::crc32c_append(black_box(crc), black_box(&data)),
                            // SAFETY: `supported_paths` returns only paths the CPU supports.
                            _ => unsafe { paths[i - 1].crc32c_append(black_box(crc), &data) },
                        };
                    }
                    black_box(crc);
                    let secs = start.elapsed().as_secs_f64();
                    samples.push((reps * len) as f64 / secs / 1e9);
                }
            }
            for samples in &mut gbps {
                samples.sort_by(f64::total_cmp);
            }
            let median = |s: &[f64]| s[s.len() / 2];
            let base = median(&gbps[0]);
            for (i, s) in gbps.iter().enumerate() {
                let name = match i {
                    0 => "crc32c crate".to_string(),
                    _ => format!("{:?}", paths[i - 1]),
                };
                println!(
                    "{name:<13} {:>5} KiB {:>6.1} [{:.1}, {:.1}] {:>8.2}x",
                    len >> 10,
                    median(s),
                    s[0],
                    s[s.len() - 1],
                    median(s) / base
                );
            }
        }
    }
}
