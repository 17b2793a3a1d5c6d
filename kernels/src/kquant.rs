//! llama.cpp's block quantisations (Q4_0, Q5_0, Q4_K, Q5_K, Q6_K) kept quantised: each GGUF block
//! is decoded once at load into panels of [`LANES`] output columns that the GEMM in
//! [`crate::kquant_gemm`] reads with int8 dot products, never widening a weight to f32.
//!
//! Every one of these formats is, per 32 inputs of a column (16 for Q6_K), an affine map of
//! small unsigned integers: `w = s * (u - z) - mn`, with `u` of 4 bits (Q4_0, Q4_K), 5 (Q5_0,
//! Q5_K) or 6 (Q6_K), a zero point `z` fixed by the format (8 for Q4_0, 16 for Q5_0, 32 for
//! Q6_K, 0 for the k-quants with a min) and `mn` the k-quants' min. Q4_0 and Q5_0 store `s` as
//! an f16 per 32 inputs; the k-quants store it, and `mn`, as the super-block's f16 `d` (`dmin`)
//! times a 6-bit (Q6_K: 8-bit signed) integer per sub-block, and the panels keep that form: the
//! kernel multiplies them out in f32 per block, as ggml's decode does, so the panels stream
//! about the file's bytes (a batch-1 step is bound by them).
//!
//! A panel is a run of groups, each [`KQuantType::group`] blocks of 32 inputs (8, one GGUF
//! super-block, for the k-quants; 1 for Q4_0/Q5_0), read front to back, one stream per panel:
//! - per block, 4 lines of nibbles: line `v`, byte [`QLayout::Quads`]`(c, j)` holds input
//!   `4v + j` of column `c` in its low nibble and input `16 + 4v + j` in its high one, so one AND
//!   or one shift gives `vpdpbusd` a whole group of 4 inputs × 16 columns (weights unsigned, as
//!   `vpdpbusd` wants its first operand); then the top bits of `u` past 4 (1 for Q5_K, 2 for
//!   Q6_K): `8 / bits` groups a line, group `g` at bit `bits * (g % (8 / bits))` of line
//!   `g / (8 / bits)`, in the same byte order;
//! - per block, 32 bytes of scales: 16 f16 `s` (Q4_0, Q5_0); 16 u8 sub-scales then 16 u8
//!   sub-mins (Q4_K, Q5_K); 16 i8 sub-scales for each of the two 16-input halves (Q6_K);
//! - per group, the super-block's 16 f16 `d` (Q6_K, Q4_K, Q5_K) then 16 f16 `dmin` (Q4_K, Q5_K).
//!
//! That is 4.625 bits a weight for Q4_K (GGUF: 4.5), 5.625 for Q5_K (5.5), 6.5625 for Q6_K
//! (6.5625), 4.5 for Q4_0 and 5.5 for Q5_0 (as stored).

use crate::error::KernelError;
use crate::q8::{QLayout, GROUPS, GROUP_INPUTS, Q8_BLOCK};
use crate::simd::LANES;

/// A GGUF block type with native kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KQuantType {
    Q4_0,
    Q5_0,
    Q4K,
    Q5K,
    Q6K,
}

impl KQuantType {
    /// Inputs per GGUF block.
    pub fn block_inputs(self) -> usize {
        match self {
            KQuantType::Q4_0 | KQuantType::Q5_0 => 32,
            _ => 256,
        }
    }

    /// Bytes per GGUF block, as ggml lays it out.
    pub fn block_bytes(self) -> usize {
        match self {
            KQuantType::Q4_0 => 18,
            KQuantType::Q5_0 => 22,
            KQuantType::Q4K => 144,
            KQuantType::Q5K => 176,
            KQuantType::Q6K => 210,
        }
    }

    /// ggml's name.
    pub fn name(self) -> &'static str {
        match self {
            KQuantType::Q4_0 => "Q4_0",
            KQuantType::Q5_0 => "Q5_0",
            KQuantType::Q4K => "Q4_K",
            KQuantType::Q5K => "Q5_K",
            KQuantType::Q6K => "Q6_K",
        }
    }

    /// Bits of `u` past the low nibble.
    pub(crate) fn hi_bits(self) -> usize {
        match self {
            KQuantType::Q4_0 | KQuantType::Q4K => 0,
            KQuantType::Q5_0 | KQuantType::Q5K => 1,
            KQuantType::Q6K => 2,
        }
    }

    /// Scales per 32 inputs.
    #[cfg(test)]
    pub(crate) fn subs(self) -> usize {
        if self == KQuantType::Q6K {
            2
        } else {
            1
        }
    }

    /// Whether a min is subtracted per 32 inputs.
    pub(crate) fn has_min(self) -> bool {
        matches!(self, KQuantType::Q4K | KQuantType::Q5K)
    }

    /// The zero point `z` of `w = s * (u - z) - mn`.
    pub(crate) fn zero(self) -> i32 {
        match self {
            KQuantType::Q4_0 => 8,
            KQuantType::Q5_0 => 16,
            KQuantType::Q6K => 32,
            KQuantType::Q4K | KQuantType::Q5K => 0,
        }
    }

    /// Whether `s` (and `mn`) are a super-block's f16 times a small integer per sub-block.
    pub(crate) fn has_super(self) -> bool {
        !matches!(self, KQuantType::Q4_0 | KQuantType::Q5_0)
    }

    /// 32-input blocks a group of a panel.
    pub(crate) fn group(self) -> usize {
        if self.has_super() {
            8
        } else {
            1
        }
    }

    /// Bytes of one block's nibbles and top bits.
    pub(crate) fn quant_bytes(self) -> usize {
        4 * 64 + self.hi_bits() * 64
    }

    /// Bytes of one group: its blocks' quants, their scales, the super-block's f16s.
    pub(crate) fn group_bytes(self) -> usize {
        // `d`, and `dmin` with a min.
        let sup = match (self.has_super(), self.has_min()) {
            (false, _) => 0,
            (true, false) => 32,
            (true, true) => 64,
        };
        self.group() * (self.quant_bytes() + 32) + sup
    }

    /// Bytes of a panel of `blocks` 32-input blocks (a multiple of [`group`](Self::group)).
    pub(crate) fn panel_bytes(self, blocks: usize) -> usize {
        blocks / self.group() * self.group_bytes()
    }

    /// Offsets in a panel of block `b`'s quants, its scales and its group's f16s.
    pub(crate) fn offsets(self, b: usize) -> (usize, usize, usize) {
        let (g, i) = (self.group(), b % self.group());
        let at = b / g * self.group_bytes();
        (
            at + i * self.quant_bytes(),
            at + g * self.quant_bytes() + i * 32,
            at + g * (self.quant_bytes() + 32),
        )
    }
}

/// One GGUF block decoded: `u` per input, and per 32 inputs `subs` scales and a min.
pub(crate) struct Decoded {
    pub(crate) u: [u8; 256],
    /// Sub-block `h` (of 32 inputs, or 16 for Q6_K): `d * sc[h]` for the k-quants.
    pub(crate) s: [f32; 16],
    /// Per 32 inputs: `dmin * mq[h]`.
    pub(crate) mn: [f32; 8],
    /// The k-quants' super-block scales, as stored (f16 values).
    pub(crate) d: f32,
    pub(crate) dmin: f32,
    /// The k-quants' sub-block scales (Q6_K's as i8 bits) and mins, as stored.
    pub(crate) sc: [u8; 16],
    pub(crate) mq: [u8; 8],
}

fn f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// ggml's `get_scale_min_k4`: sub-block `j`'s 6-bit scale and min from Q4_K/Q5_K's 12 bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes one GGUF block of `ty` (`ty.block_bytes()` bytes), as ggml's `dequantize_row_*`
/// reads it.
pub(crate) fn decode(ty: KQuantType, b: &[u8]) -> Decoded {
    let mut out = Decoded {
        u: [0; 256],
        s: [0.0; 16],
        mn: [0.0; 8],
        d: 0.0,
        dmin: 0.0,
        sc: [0; 16],
        mq: [0; 8],
    };
    match ty {
        KQuantType::Q4_0 => {
            out.s[0] = f16(b, 0);
            for j in 0..16 {
                out.u[j] = b[2 + j] & 0xF;
                out.u[j + 16] = b[2 + j] >> 4;
            }
        }
        KQuantType::Q5_0 => {
            out.s[0] = f16(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let top = |bit: usize| (((qh >> bit) & 1) as u8) << 4;
                out.u[j] = (b[6 + j] & 0xF) | top(j);
                out.u[j + 16] = (b[6 + j] >> 4) | top(j + 16);
            }
        }
        KQuantType::Q4K | KQuantType::Q5K => {
            let (d, dmin) = (f16(b, 0), f16(b, 2));
            (out.d, out.dmin) = (d, dmin);
            let scales = &b[4..16];
            let (qh, ql) = if ty == KQuantType::Q5K {
                (&b[16..48], &b[48..176])
            } else {
                (&b[0..0], &b[16..144])
            };
            for chunk in 0..4 {
                for half in 0..2 {
                    let sub = 2 * chunk + half;
                    let (sc, m) = scale_min_k4(sub, scales);
                    (out.sc[sub], out.mq[sub]) = (sc, m);
                    out.s[sub] = d * f32::from(sc);
                    out.mn[sub] = dmin * f32::from(m);
                    for l in 0..32 {
                        let q = ql[chunk * 32 + l];
                        let mut u = if half == 0 { q & 0xF } else { q >> 4 };
                        if !qh.is_empty() && qh[l] & (1 << sub) != 0 {
                            u += 16;
                        }
                        out.u[sub * 32 + l] = u;
                    }
                }
            }
        }
        KQuantType::Q6K => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = f16(b, 208);
            out.d = d;
            out.sc.copy_from_slice(sc);
            for (h, s) in out.s.iter_mut().enumerate() {
                *s = d * f32::from(sc[h] as i8);
            }
            for n in 0..2 {
                let (ql, qh) = (&ql[n * 64..], &qh[n * 32..]);
                for l in 0..32 {
                    let y = &mut out.u[n * 128..];
                    y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
                    y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
    }
    out
}

/// A part of a weight's outputs in one block type: `rows` outputs of `k` inputs, ggml's
/// row-major blocks (`rows * k / block_inputs` blocks).
#[derive(Debug, Clone, Copy)]
pub struct KQuantPart<'a> {
    pub ty: KQuantType,
    pub rows: usize,
    pub data: &'a [u8],
}

/// One run of outputs in one block type, in panels.
#[derive(Debug, Clone)]
pub(crate) struct KSegment {
    pub(crate) ty: KQuantType,
    /// The first output column of this segment in the whole weight.
    pub(crate) col0: usize,
    /// Outputs.
    pub(crate) n: usize,
    /// Panel `p` at `p * ty.panel_bytes(blocks)`, its block `b` at `ty.offsets(b)` in it.
    pub(crate) data: Vec<u8>,
}

/// A `[k, n]` weight (stored `[n, k]` as GGUF does) kept in its GGUF block types, one or more
/// runs of output columns (a fused q/k/v projection of a Q4_K_M file mixes Q4_K and Q6_K).
#[derive(Debug, Clone)]
pub struct KQuantWeight {
    pub(crate) k: usize,
    pub(crate) n: usize,
    /// 32-input blocks per column.
    pub(crate) blocks: usize,
    pub(crate) segments: Vec<KSegment>,
}

impl KQuantWeight {
    /// From GGUF blocks: `parts` are consecutive runs of output rows, each `k` inputs long.
    pub fn from_gguf(k: usize, parts: &[KQuantPart<'_>]) -> Result<Self, KernelError> {
        let mut segments: Vec<KSegment> = Vec::new();
        let mut n = 0;
        for p in parts {
            let bi = p.ty.block_inputs();
            let need = p
                .rows
                .checked_mul(k / bi.max(1))
                .map(|b| b * p.ty.block_bytes());
            if k == 0 || !k.is_multiple_of(bi) || need != Some(p.data.len()) {
                return Err(KernelError::Invalid(format!(
                    "{} weight of {} rows x {k} inputs: {} bytes, or inputs not a multiple of {bi}",
                    p.ty.name(),
                    p.rows,
                    p.data.len()
                )));
            }
            segments.push(KSegment {
                ty: p.ty,
                col0: n,
                n: p.rows,
                data: pack(p.ty, k, p.rows, p.data),
            });
            n += p.rows;
        }
        if n == 0 {
            return Err(KernelError::Invalid(
                "a quantised weight with no outputs".into(),
            ));
        }
        Ok(KQuantWeight {
            k,
            n,
            blocks: k / Q8_BLOCK,
            segments,
        })
    }

    /// Inputs.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Outputs.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Bytes held, for the memory accounting.
    pub fn bytes(&self) -> usize {
        self.segments.iter().map(|s| s.data.len()).sum()
    }

    /// The block types, in column order (one per segment).
    pub fn types(&self) -> Vec<KQuantType> {
        self.segments.iter().map(|s| s.ty).collect()
    }

    /// `W[i, j]` dequantised from the panels (tests and the dequantised comparison path).
    pub fn get(&self, i: usize, j: usize) -> f32 {
        let seg = self
            .segments
            .iter()
            .find(|s| j < s.col0 + s.n)
            .expect("column in range");
        let (ty, j) = (seg.ty, j - seg.col0);
        let (panel, c, b, r) = (j / LANES, j % LANES, i / Q8_BLOCK, i % Q8_BLOCK);
        let p = &seg.data[panel * ty.panel_bytes(self.blocks)..][..ty.panel_bytes(self.blocks)];
        let (qo, so, go) = ty.offsets(b);
        let (g, jj) = (r / GROUP_INPUTS, r % GROUP_INPUTS);
        let byte = QLayout::Quads.byte(c, jj);
        let mut u = (p[qo + (g % 4) * 64 + byte] >> (4 * (g / 4))) & 0xF;
        let hb = ty.hi_bits();
        if let Some(per) = 8usize.checked_div(hb) {
            let h = p[qo + 256 + (g / per) * 64 + byte] >> (hb * (g % per));
            u |= (h & ((1 << hb) - 1)) << 4;
        }
        let (s, mn) = match ty {
            KQuantType::Q4_0 | KQuantType::Q5_0 => (h16(p, so + 2 * c), 0.0),
            KQuantType::Q4K | KQuantType::Q5K => (
                h16(p, go + 2 * c) * f32::from(p[so + c]),
                h16(p, go + 32 + 2 * c) * f32::from(p[so + 16 + c]),
            ),
            KQuantType::Q6K => (
                h16(p, go + 2 * c) * f32::from(p[so + 16 * (g / 4) + c] as i8),
                0.0,
            ),
        };
        s * (i32::from(u) - ty.zero()) as f32 - mn
    }
}

fn h16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The panels of `rows` GGUF rows of `k` inputs (lengths checked by the caller).
fn pack(ty: KQuantType, k: usize, rows: usize, data: &[u8]) -> Vec<u8> {
    let blocks = k / Q8_BLOCK;
    let panel_bytes = ty.panel_bytes(blocks);
    let panels = rows.div_ceil(LANES);
    let mut out = vec![0u8; panels * panel_bytes];
    let row_bytes = k / ty.block_inputs() * ty.block_bytes();
    let hb = ty.hi_bits();
    let subs_per_block = ty.block_inputs() / Q8_BLOCK;
    let put16 = |out: &mut [u8], at: usize, v: f32| {
        out[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes());
    };
    for col in 0..rows {
        let (panel, c) = (col / LANES, col % LANES);
        let row = &data[col * row_bytes..(col + 1) * row_bytes];
        let p = &mut out[panel * panel_bytes..][..panel_bytes];
        for (gb, raw) in row.chunks_exact(ty.block_bytes()).enumerate() {
            let dec = decode(ty, raw);
            for sb in 0..subs_per_block {
                let b = gb * subs_per_block + sb;
                let (qo, so, go) = ty.offsets(b);
                for g in 0..GROUPS {
                    for j in 0..GROUP_INPUTS {
                        let u = dec.u[sb * Q8_BLOCK + g * GROUP_INPUTS + j];
                        let byte = QLayout::Quads.byte(c, j);
                        p[qo + (g % 4) * 64 + byte] |= (u & 0xF) << (4 * (g / 4));
                        if let Some(per) = 8usize.checked_div(hb) {
                            p[qo + 256 + (g / per) * 64 + byte] |= (u >> 4) << (hb * (g % per));
                        }
                    }
                }
                match ty {
                    KQuantType::Q4_0 | KQuantType::Q5_0 => put16(p, so + 2 * c, dec.s[0]),
                    KQuantType::Q4K | KQuantType::Q5K => {
                        p[so + c] = dec.sc[sb];
                        p[so + 16 + c] = dec.mq[sb];
                        // The f16s came from the file: the round trip is exact.
                        put16(p, go + 2 * c, dec.d);
                        put16(p, go + 32 + 2 * c, dec.dmin);
                    }
                    KQuantType::Q6K => {
                        p[so + c] = dec.sc[2 * sb];
                        p[so + 16 + c] = dec.sc[2 * sb + 1];
                        put16(p, go + 2 * c, dec.d);
                    }
                }
            }
        }
    }
    out
}

/// Random but well-formed GGUF blocks (finite scales) for the tests of this crate and the
/// engine's.
#[doc(hidden)]
pub fn random_blocks(ty: KQuantType, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    let n_blocks = rows * k / ty.block_inputs();
    let mut out = Vec::with_capacity(n_blocks * ty.block_bytes());
    for _ in 0..n_blocks {
        let mut b: Vec<u8> = (0..ty.block_bytes()).map(|_| next() as u8).collect();
        let mut scale = || {
            let v = 1e-3 + (next() % 1000) as f32 * 1e-5;
            half::f16::from_f32(v).to_bits().to_le_bytes()
        };
        match ty {
            KQuantType::Q4_0 | KQuantType::Q5_0 => b[0..2].copy_from_slice(&scale()),
            KQuantType::Q4K | KQuantType::Q5K => {
                b[0..2].copy_from_slice(&scale());
                b[2..4].copy_from_slice(&scale());
            }
            KQuantType::Q6K => b[208..210].copy_from_slice(&scale()),
        }
        out.extend_from_slice(&b);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_hold_what_the_blocks_decode_to() {
        for ty in [
            KQuantType::Q4_0,
            KQuantType::Q5_0,
            KQuantType::Q4K,
            KQuantType::Q5K,
            KQuantType::Q6K,
        ] {
            let (rows, k) = (21, 512);
            let raw = random_blocks(ty, rows, k, 3);
            let w = KQuantWeight::from_gguf(
                k,
                &[KQuantPart {
                    ty,
                    rows,
                    data: &raw,
                }],
            )
            .expect("pack");
            let row_bytes = k / ty.block_inputs() * ty.block_bytes();
            for j in 0..rows {
                for (gb, blk) in raw[j * row_bytes..(j + 1) * row_bytes]
                    .chunks_exact(ty.block_bytes())
                    .enumerate()
                {
                    let d = decode(ty, blk);
                    for l in 0..ty.block_inputs() {
                        // ggml's decode: `d * sc` and `dmin * m` in f32, exactly.
                        let (s, mn) = (d.s[l / (32 / ty.subs())], d.mn[l / 32]);
                        let want = s * (i32::from(d.u[l]) - ty.zero()) as f32
                            - if ty.has_min() { mn } else { 0.0 };
                        let i = gb * ty.block_inputs() + l;
                        assert_eq!(w.get(i, j), want, "{ty:?} ({i}, {j})");
                    }
                }
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let raw = vec![0u8; 144];
        let part = |rows, data| KQuantPart {
            ty: KQuantType::Q4K,
            rows,
            data,
        };
        assert!(KQuantWeight::from_gguf(256, &[part(1, &raw)]).is_ok());
        assert!(KQuantWeight::from_gguf(256, &[part(2, &raw)]).is_err());
        assert!(KQuantWeight::from_gguf(128, &[part(1, &raw)]).is_err());
        assert!(KQuantWeight::from_gguf(0, &[part(0, &[])]).is_err());
    }
}
