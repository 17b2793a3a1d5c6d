//! The int8 dot-product vocabulary of the Q8 GEMM, for each instruction set it runs on.
//!
//! One [`QDot`] operation is a group of the packed weights (16 columns × 4 inputs, offset by
//! +128) against 4 activations broadcast to every column: 16 four-way dot products into 16
//! i32 lanes. VNNI does it in one `vpdpbusd` (unsigned weights × signed activations; the
//! offset is cancelled by seeding each block's accumulator with `-128 * sum(activations)`).
//! AVX-512BW has no such instruction and uses llama.cpp's sign trick: the weights,
//! made signed again, take the sign of the activation they meet, so `maddubs` multiplies
//! `|a|` (unsigned) by `±w` (signed) without overflowing i16 (2 · 127 · 127 < 2^15), and
//! `madd` by ones widens the pairs to i32. The portable build does it lane by lane. AVX2
//! alone gets a kernel of its own on i16 ([`crate::q8_avx2`]), which does not fit this
//! vocabulary: its weights are ordered in pairs ([`crate::q8::QLayout::Pairs`]).
//!
//! As with [`crate::simd::Simd`], a token exists only once the CPU has been checked.

use std::sync::OnceLock;

use crate::q8::{QLayout, GROUP_INPUTS, W_OFFSET};
use crate::simd::LANES;

/// Instruction sets the Q8 GEMM has been instantiated for, best first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum QIsa {
    /// AVX-512F/BW with VNNI's `vpdpbusd`.
    Vnni,
    /// AVX-512F/BW: `vpmaddubsw` and `vpmaddwd` on zmm.
    Avx512Bw,
    /// AVX2 with FMA and F16C.
    Avx2,
    Portable,
}

impl QIsa {
    /// The best one this CPU supports, detected once per process.
    pub(crate) fn detect() -> QIsa {
        static ISA: OnceLock<QIsa> = OnceLock::new();
        *ISA.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let cap = crate::simd::IsaCap::get();
                let avx2 = cap >= crate::simd::IsaCap::Avx2
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c");
                let bw = avx2
                    && cap >= crate::simd::IsaCap::Avx512
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw");
                if bw && is_x86_feature_detected!("avx512vnni") {
                    return QIsa::Vnni;
                }
                if bw {
                    return QIsa::Avx512Bw;
                }
                if avx2 {
                    return QIsa::Avx2;
                }
            }
            QIsa::Portable
        })
    }

    /// The byte order its kernel wants the weights' groups in.
    pub(crate) fn layout(self) -> QLayout {
        match self {
            QIsa::Avx2 => QLayout::Pairs,
            QIsa::Vnni | QIsa::Avx512Bw | QIsa::Portable => QLayout::Quads,
        }
    }

    /// Every instruction set this CPU runs, best first: each implies the ones after it.
    #[cfg(test)]
    pub(crate) fn available() -> Vec<QIsa> {
        let all = [QIsa::Vnni, QIsa::Avx512Bw, QIsa::Avx2, QIsa::Portable];
        let best = all.iter().position(|&i| i == QIsa::detect()).unwrap_or(3);
        all[best..].to_vec()
    }
}

/// 16 columns' int8 dot products and their f32 accumulation, for one instruction set.
pub(crate) trait QDot: Copy {
    /// 16 i32: one block's dot products.
    type I: Copy;
    /// 16 f32: the outputs.
    type F: Copy;
    /// One group of weights, in whatever form [`QDot::dot`] takes.
    type W: Copy;

    fn zero_f(self) -> Self::F;
    /// # Safety
    /// `p` must be valid for reading 16 f32.
    unsafe fn load_f(self, p: *const f32) -> Self::F;
    /// # Safety
    /// `p` must be valid for writing 16 f32.
    unsafe fn store_f(self, p: *mut f32, v: Self::F);
    /// 16 f16 scales, widened.
    ///
    /// # Safety
    /// `p` must be valid for reading 16 u16.
    unsafe fn load_scales(self, p: *const u16) -> Self::F;
    /// # Safety
    /// `p` must be a 64-byte aligned group.
    unsafe fn load_group(self, p: *const u8) -> Self::W;
    /// A block's accumulator before its first group, given the activations' `-128 * sum`.
    fn seed(self, comp: i32) -> Self::I;
    /// `acc + w · a` per column, `a` being 4 activations (little-endian bytes of an i32).
    fn dot(self, acc: Self::I, w: Self::W, a: i32) -> Self::I;
    /// `acc + f32(dot) * (w_scale * a_scale)`.
    fn fold(self, acc: Self::F, dot: Self::I, w_scale: Self::F, a_scale: f32) -> Self::F;
}

/// Plain loops over arrays.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QPortable;

impl QDot for QPortable {
    type I = [i32; LANES];
    type F = [f32; LANES];
    type W = [u8; GROUP_INPUTS * LANES];

    #[inline(always)]
    fn zero_f(self) -> Self::F {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load_f(self, p: *const f32) -> Self::F {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::read_unaligned(p.cast()) }
    }
    #[inline(always)]
    unsafe fn store_f(self, p: *mut f32, v: Self::F) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_unaligned(p.cast(), v) }
    }
    #[inline(always)]
    unsafe fn load_scales(self, p: *const u16) -> Self::F {
        // SAFETY: the caller's contract.
        let bits: [u16; LANES] = unsafe { std::ptr::read_unaligned(p.cast()) };
        std::array::from_fn(|l| half::f16::from_bits(bits[l]).to_f32())
    }
    #[inline(always)]
    unsafe fn load_group(self, p: *const u8) -> Self::W {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::read(p.cast()) }
    }
    #[inline(always)]
    fn seed(self, _comp: i32) -> Self::I {
        // The weights' offset is taken off in `dot`.
        [0; LANES]
    }
    #[inline(always)]
    fn dot(self, mut acc: Self::I, w: Self::W, a: i32) -> Self::I {
        let a = a.to_le_bytes();
        for (c, acc) in acc.iter_mut().enumerate() {
            for (j, &a) in a.iter().enumerate() {
                let w = i32::from(w[c * GROUP_INPUTS + j]) - W_OFFSET;
                *acc += w * i32::from(a as i8);
            }
        }
        acc
    }
    #[inline(always)]
    fn fold(self, acc: Self::F, dot: Self::I, w_scale: Self::F, a_scale: f32) -> Self::F {
        std::array::from_fn(|l| acc[l] + dot[l] as f32 * (w_scale[l] * a_scale))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `d`'s operations against [`QPortable`]'s on extreme and random bytes.
    pub(crate) fn matches_portable<D: QDot>(d: D) {
        let p = QPortable;
        // Stored weights are -127..=127 plus 128: 1..=255.
        let groups: Vec<[u8; 64]> = vec![
            [1; 64],
            [255; 64],
            [128; 64],
            std::array::from_fn(|i| (i * 37 % 255 + 1) as u8),
            std::array::from_fn(|i| (i * 101 % 255 + 1) as u8),
        ];
        let acts = [
            i32::from_le_bytes([0x81, 0x81, 0x81, 0x81]),
            i32::from_le_bytes([0x7f, 0x7f, 0x7f, 0x7f]),
            i32::from_le_bytes([0x7f, 0x81, 0x00, 0x05]),
            i32::from_le_bytes([0x00, 0x00, 0x00, 0x00]),
        ];
        let scales: [u16; 16] =
            std::array::from_fn(|i| half::f16::from_f32(0.01 * i as f32).to_bits());
        let unload = |v: D::F| {
            let mut out = [0.0f32; LANES];
            // SAFETY: 16 f32.
            unsafe { d.store_f(out.as_mut_ptr(), v) };
            out
        };
        for g in &groups {
            let g = QGroupAligned(*g);
            for &a in &acts {
                let bytes = a.to_le_bytes();
                let sum: i32 = bytes.iter().map(|&b| i32::from(b as i8)).sum();
                // SAFETY: an aligned group and 16 scales.
                let (w, wp, sw, swp) = unsafe {
                    (
                        d.load_group(g.0.as_ptr()),
                        p.load_group(g.0.as_ptr()),
                        d.load_scales(scales.as_ptr()),
                        p.load_scales(scales.as_ptr()),
                    )
                };
                let got = d.fold(d.zero_f(), d.dot(d.seed(-128 * sum), w, a), sw, 0.5);
                let want = p.fold(p.zero_f(), p.dot(p.seed(-128 * sum), wp, a), swp, 0.5);
                assert_eq!(unload(got), want, "group {:?} acts {bytes:?}", &g.0[..8]);
            }
        }
    }

    #[repr(C, align(64))]
    struct QGroupAligned([u8; 64]);

    #[test]
    fn portable_dot_is_signed_times_signed() {
        let p = QPortable;
        let mut w = [128u8; 64];
        w[4] = 128 - 3; // column 1, input 0: -3
        w[5] = 128 + 2; // column 1, input 1: 2
        let a = i32::from_le_bytes([5, 0xff, 0, 0]); // 5, -1
        let acc = p.dot(p.seed(0), w, a);
        assert_eq!(acc[1], -3 * 5 - 2);
        assert_eq!(acc[0], 0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_paths_match_portable() {
        use crate::q8_simd_x86::{QAvx512Bw, QVnni};
        for isa in QIsa::available() {
            // SAFETY (each arm): `available` lists only what this CPU runs.
            match isa {
                QIsa::Vnni => matches_portable(unsafe { QVnni::new_unchecked() }),
                QIsa::Avx512Bw => matches_portable(unsafe { QAvx512Bw::new_unchecked() }),
                QIsa::Avx2 | QIsa::Portable => {}
            }
        }
    }
}
