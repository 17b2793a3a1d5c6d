//! int8 weights with one scale per 32 inputs of each output, as llama.cpp's Q8_0, quantised
//! at load and packed into panels; and the matching per-block quantisation of activations.
//!
//! A weight block is 32 consecutive inputs of one output column: its scale is
//! `max|w| / 127` (stored as f16, as Q8_0 does) and its values `round(w / scale)` in -127..=127,
//! so the weights take 34 bytes per 32, about a quarter of f32's. The panels follow
//! [`crate::PackedWeight`]'s: [`PANEL`] output columns, one block of inputs after another, so
//! a step still reads every weight byte once front to back whatever the batch. Inside a block
//! the 32 inputs go in 8 groups of 4 (64 bytes, one cache line), whose byte order is the
//! operands of the instruction set the process runs ([`QLayout`]): with AVX-512 the 4 inputs
//! of each of the 16 columns sit next to each other, for VNNI's `vpdpbusd` (16 four-way int8
//! dot products into 16 i32 lanes) and AVX-512BW's `maddubs`/`madd` pair; with AVX2 only,
//! each column's inputs go in pairs, for `vpmaddwd` on i16. The 16 scales of a block sit in a
//! separate stream, so the groups stay cache-line aligned.
//!
//! Weights are stored offset by +128 (as u8): `vpdpbusd` multiplies unsigned by signed bytes,
//! and with unsigned weights and signed activations the only fix-up is
//! `-128 * sum(activations of the block)`, once per row and block, instead of a sign trick on
//! every weight vector of every row (oneDNN's compensation). The paths without VNNI flip the
//! offset back with one xor per weight vector, shared by all the rows of a tile.
//!
//! Activations are quantised per call the same way (one scale per 32 inputs of each row, f32
//! here), so each block's dot product is exact in i32 and is scaled once in f32, as llama.cpp's
//! `q8_0 x q8_0` dot does. Inputs past `k` are zero in both operands.

use crate::simd::{EXP2_ROUND, LANES};

/// Inputs per quantisation block.
pub const Q8_BLOCK: usize = 32;
/// Inputs per group: one i32 lane's four-way dot product.
pub(crate) const GROUP_INPUTS: usize = 4;
/// Groups per block.
pub(crate) const GROUPS: usize = Q8_BLOCK / GROUP_INPUTS;
/// The offset stored weights carry.
pub(crate) const W_OFFSET: i32 = 128;

/// How the 64 bytes of a group are ordered: which kernel's operands they are. Chosen at load
/// for the instruction set the process runs ([`crate::q8_simd::QIsa::layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum QLayout {
    /// Column `c`'s 4 inputs next to each other, at byte `4 * c + j`: one i32 lane of
    /// `vpdpbusd` (or of `maddubs` then `madd`) per column.
    Quads,
    /// Per 8 columns, inputs 0 and 1 of each column (16 bytes), then inputs 2 and 3: widened
    /// to i16, one `vpmaddwd` against a broadcast pair of activations puts both of a
    /// column's products in that column's own i32 lane (the AVX2 kernel, [`crate::q8_avx2`]).
    Pairs,
}

impl QLayout {
    /// The byte of input `j` (0..4) of column `c` (0..16) in a group.
    pub(crate) fn byte(self, c: usize, j: usize) -> usize {
        match self {
            QLayout::Quads => c * GROUP_INPUTS + j,
            QLayout::Pairs => (c / 8) * 32 + (j / 2) * 16 + (c % 8) * 2 + j % 2,
        }
    }
}

/// One group: input `4 * g + j` of column `c` at byte `layout.byte(c, j)`, offset by +128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub(crate) struct QGroup(pub(crate) [u8; GROUP_INPUTS * LANES]);

/// `W` (`[k, n]`) in Q8_0-style panels.
#[derive(Clone)]
pub(crate) struct Q8Panels {
    /// Inputs.
    pub(crate) k: usize,
    /// Outputs.
    pub(crate) n: usize,
    /// Blocks of [`Q8_BLOCK`] inputs per column, the last one zero-padded.
    pub(crate) blocks: usize,
    /// Panel `p`, block `b`, group `g` at `(p * blocks + b) * GROUPS + g`.
    pub(crate) groups: Vec<QGroup>,
    /// f16 bit patterns: panel `p`, block `b`, column `c` at `(p * blocks + b) * LANES + c`.
    /// Columns past `n` have scale 0.
    pub(crate) scales: Vec<u16>,
    /// The byte order inside each group.
    pub(crate) layout: QLayout,
}

impl Q8Panels {
    /// Quantises a checkpoint's `[n, k]` row-major weight (lengths checked by the caller) into
    /// groups ordered as `layout`.
    pub(crate) fn quantize_out_in(w: &[f32], n: usize, k: usize, layout: QLayout) -> Self {
        let blocks = k.div_ceil(Q8_BLOCK);
        let panels = n.div_ceil(LANES);
        let zero = QGroup([W_OFFSET as u8; GROUP_INPUTS * LANES]);
        let mut groups = vec![zero; panels * blocks * GROUPS];
        let mut scales = vec![0u16; panels * blocks * LANES];
        for (col, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let (panel, lane) = (col / LANES, col % LANES);
            for (b, block) in row.chunks(Q8_BLOCK).enumerate() {
                let at = panel * blocks + b;
                let (scale, q) = quantize_block(block);
                scales[at * LANES + lane] = half::f16::from_f32(scale).to_bits();
                for (i, &v) in q.iter().enumerate().take(block.len()) {
                    let g = &mut groups[at * GROUPS + i / GROUP_INPUTS];
                    g.0[layout.byte(lane, i % GROUP_INPUTS)] = (i32::from(v) + W_OFFSET) as u8;
                }
            }
        }
        Q8Panels {
            k,
            n,
            blocks,
            groups,
            scales,
            layout,
        }
    }

    /// The same weights with their groups reordered as `layout` (the tests run every kernel
    /// on one quantisation).
    #[cfg(test)]
    pub(crate) fn with_layout(&self, layout: QLayout) -> Self {
        let mut out = self.clone();
        out.layout = layout;
        for (to, from) in out.groups.iter_mut().zip(&self.groups) {
            for c in 0..LANES {
                for j in 0..GROUP_INPUTS {
                    to.0[layout.byte(c, j)] = from.0[self.layout.byte(c, j)];
                }
            }
        }
        out
    }

    /// `W[i, j]` dequantised.
    pub(crate) fn get(&self, i: usize, j: usize) -> f32 {
        let at = (j / LANES) * self.blocks + i / Q8_BLOCK;
        let (lane, r) = (j % LANES, i % Q8_BLOCK);
        let byte =
            self.groups[at * GROUPS + r / GROUP_INPUTS].0[self.layout.byte(lane, r % GROUP_INPUTS)];
        let scale = half::f16::from_bits(self.scales[at * LANES + lane]).to_f32();
        (i32::from(byte) - W_OFFSET) as f32 * scale
    }

    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val(self.groups.as_slice())
            + std::mem::size_of_val(self.scales.as_slice())
    }
}

/// llama.cpp's `quantize_row_q8_0_ref` for one block of weights: `scale = max|w| / 127`,
/// values `round(w / scale)` (half away from zero) through the reciprocal, zero past the data.
fn quantize_block(block: &[f32]) -> (f32, [i8; Q8_BLOCK]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut q = [0i8; Q8_BLOCK];
    for (q, v) in q.iter_mut().zip(block) {
        *q = (v * inv).round() as i8;
    }
    (scale, q)
}

/// `m` rows of activations quantised per block of [`Q8_BLOCK`] inputs.
#[derive(Default)]
pub(crate) struct QActs {
    /// Row `r` at `r * blocks * Q8_BLOCK`, zero past `k`.
    pub(crate) q: Vec<i8>,
    /// Row `r`, block `b` at `r * blocks + b`.
    pub(crate) scale: Vec<f32>,
    /// `-128 * sum(q)` of each block, which cancels the weights' offset in `vpdpbusd`.
    pub(crate) comp: Vec<i32>,
    /// `q` widened to i16, for the [`QLayout::Pairs`] kernel only (empty otherwise).
    pub(crate) q16: Vec<i16>,
}

impl QActs {
    /// Sizes the buffers for `m` rows of `blocks` blocks, `q16` too where `wide`, reusing
    /// their allocations.
    pub(crate) fn resize(&mut self, m: usize, blocks: usize, wide: bool) {
        self.q16.clear();
        if wide {
            self.q16.resize(m * blocks * Q8_BLOCK, 0);
        }
        self.q.clear();
        self.q.resize(m * blocks * Q8_BLOCK, 0);
        self.scale.clear();
        self.scale.resize(m * blocks, 0.0);
        self.comp.clear();
        self.comp.resize(m * blocks, 0);
    }
}

/// Quantises one row `x` (`k` inputs) into its slices of a [`QActs`]: `q` (`blocks * 32`),
/// `scale` and `comp` (`blocks` each). Ties round to even, as llama.cpp's SIMD quantisers do.
///
/// Rounding adds and subtracts 1.5 · 2^23 (exact for |v| < 2^22, here |v| <= 127) rather than
/// calling `round_ties_even`, which without SSE4.1 (the crate's baseline) is a libm call per
/// value: 8% of an int8 prefill, measured.
#[inline(always)]
pub(crate) fn quantize_row(x: &[f32], q: &mut [i8], scale: &mut [f32], comp: &mut [i32]) {
    for (((src, dst), s), c) in x
        .chunks(Q8_BLOCK)
        .zip(q.chunks_exact_mut(Q8_BLOCK))
        .zip(scale.iter_mut())
        .zip(comp.iter_mut())
    {
        let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in dst.iter_mut().zip(src) {
            let r = ((v * inv + EXP2_ROUND) - EXP2_ROUND) as i32;
            sum += r;
            *q = r as i8;
        }
        *s = d;
        *c = -W_OFFSET * sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_within_half_a_step() {
        let (n, k) = (37, 70);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let quads = Q8Panels::quantize_out_in(&w, n, k, QLayout::Quads);
        let pairs = Q8Panels::quantize_out_in(&w, n, k, QLayout::Pairs);
        assert_eq!(pairs.groups, quads.with_layout(QLayout::Pairs).groups);
        let p = quads;
        assert_eq!(p.blocks, 3);
        assert_eq!(p.groups.as_ptr() as usize % 64, 0);
        for j in 0..n {
            let row = &w[j * k..(j + 1) * k];
            for i in 0..k {
                let block = &row[i / 32 * 32..((i / 32 + 1) * 32).min(k)];
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Half a quantisation step, plus the f16 rounding of the scale.
                let tol = amax / 127.0 * 0.5 + amax * 1e-3;
                let got = p.get(i, j);
                assert_eq!(got, pairs.get(i, j));
                assert!(
                    (got - row[i]).abs() <= tol,
                    "({i}, {j}): {got} vs {}",
                    row[i]
                );
            }
            // Padding inputs dequantise to zero.
            for i in k..p.blocks * 32 {
                assert_eq!(p.get(i, j), 0.0);
            }
        }
        // Padding columns too.
        for i in 0..k {
            for j in n..48 {
                assert_eq!(p.get(i, j), 0.0);
            }
        }
        assert_eq!(p.bytes(), 3 * 3 * (32 * 16 + 16 * 2));
    }

    #[test]
    fn each_layout_places_every_input_once() {
        for layout in [QLayout::Quads, QLayout::Pairs] {
            let mut seen = [false; GROUP_INPUTS * LANES];
            for c in 0..LANES {
                for j in 0..GROUP_INPUTS {
                    assert!(!std::mem::replace(&mut seen[layout.byte(c, j)], true));
                }
            }
        }
        // Pairs: 16 bytes hold inputs 0-1 of columns 0-7, column by column.
        assert_eq!(QLayout::Pairs.byte(3, 1), 7);
        assert_eq!(QLayout::Pairs.byte(3, 2), 22);
        assert_eq!(QLayout::Pairs.byte(9, 0), 34);
    }

    #[test]
    fn the_largest_weight_maps_to_127() {
        let mut w = vec![0.5f32; 32];
        w[3] = -2.0;
        let p = Q8Panels::quantize_out_in(&w, 1, 32, QLayout::Quads);
        assert_eq!(p.groups[0].0[3], (-127 + 128) as u8);
        assert_eq!(
            p.get(3, 0),
            -2.0 * (half::f16::from_f32(2.0 / 127.0).to_f32() * 127.0 / 2.0)
        );
    }

    #[test]
    fn activations_carry_their_sums() {
        let x: Vec<f32> = (0..40).map(|i| i as f32 - 20.0).collect();
        let mut a = QActs::default();
        a.resize(1, 2, false);
        quantize_row(&x, &mut a.q, &mut a.scale, &mut a.comp);
        assert_eq!(a.q[0], -127);
        assert_eq!(&a.q[40..], &[0; 24]);
        for b in 0..2 {
            let sum: i32 = a.q[b * 32..(b + 1) * 32]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            assert_eq!(a.comp[b], -128 * sum);
        }
        assert_eq!(a.scale[1], 19.0 / 127.0);
        let zero = vec![0f32; 32];
        quantize_row(&zero, &mut a.q, &mut a.scale, &mut a.comp);
        assert_eq!((a.scale[0], a.comp[0]), (0.0, 0));
    }
}
