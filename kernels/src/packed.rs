//! A weight matrix packed once, at load, into the layout [`crate::packed_matmul`] reads.
//!
//! The layout is a sequence of panels of [`PANEL`] output columns. Panel `p` holds columns
//! `p * PANEL..(p + 1) * PANEL` of `W` (`[in, out]`), one input row after another, so one
//! panel is a single contiguous run of `in * PANEL` f32 and each of its rows is one
//! cache-line-aligned vector. A step reads every panel front to back once, whatever the batch
//! size: the hardware prefetcher's best case at batch 1, and the micro-kernel's operand at
//! batch 32 without the re-packing a general GEMM does on every call. Columns past `out` are
//! zero.
//!
//! int8 weights ([`WeightDtype::Int8`]) keep the same panels of columns but quantise each run
//! of 32 inputs with its own scale; their layout is in [`crate::q8`].

use crate::error::KernelError;
use crate::huge::HugeVec;
use crate::q8::Q8Panels;
use crate::q8_simd::QIsa;
use crate::simd::LANES;

/// Output columns per panel: one vector of f32.
pub const PANEL: usize = LANES;

/// One row of a panel, aligned to a cache line so that no vector load straddles two.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
pub(crate) struct PanelRow(pub(crate) [f32; PANEL]);

/// One row of a bf16 panel (bit patterns), half a cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub(crate) struct PanelRowBf16(pub(crate) [u16; PANEL]);

/// What a packed weight stores: f32, or bf16 widened to f32 as the micro-kernel loads it
/// (half the bytes a step reads, which is what batch-1 decode is bound by), or int8 with a
/// scale per 32 inputs (llama.cpp's Q8_0, about a quarter of the bytes; the activations are
/// quantised to match).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
    Int8,
}

#[derive(Clone)]
pub(crate) enum Panels {
    F32(HugeVec<PanelRow>),
    Bf16(HugeVec<PanelRowBf16>),
    Q8(Q8Panels),
}

/// `W` (`[k, n]`: `k` inputs, `n` outputs) in panels.
#[derive(Clone)]
pub struct PackedWeight {
    k: usize,
    n: usize,
    panels: Panels,
}

impl PackedWeight {
    /// From a checkpoint's layout, `[n, k]` row-major (each output's weights contiguous), as
    /// safetensors store `nn.Linear` weights.
    pub fn from_out_in(w: &[f32], n: usize, k: usize) -> Result<Self, KernelError> {
        check_len("w", n * k, w.len())?;
        let mut rows = HugeVec::filled(PanelRow([0.0; PANEL]), n.div_ceil(PANEL) * k);
        scatter_out_in(w, n, k, |i, lane, v| rows[i].0[lane] = v);
        Ok(PackedWeight {
            k,
            n,
            panels: Panels::F32(rows),
        })
    }

    /// [`from_out_in`](Self::from_out_in) for bf16 weights, kept in bf16.
    pub fn from_out_in_bf16(w: &[half::bf16], n: usize, k: usize) -> Result<Self, KernelError> {
        check_len("w", n * k, w.len())?;
        let mut rows = HugeVec::filled(PanelRowBf16([0; PANEL]), n.div_ceil(PANEL) * k);
        scatter_out_in(w, n, k, |i, lane, v| rows[i].0[lane] = v.to_bits());
        Ok(PackedWeight {
            k,
            n,
            panels: Panels::Bf16(rows),
        })
    }

    /// [`from_out_in`](Self::from_out_in) quantised to int8 as llama.cpp's Q8_0 does: per
    /// output, each run of 32 inputs gets the scale `max|w| / 127` (f16) and the values
    /// `round(w / scale)`; a last run shorter than 32 is padded with zeros.
    pub fn from_out_in_int8(w: &[f32], n: usize, k: usize) -> Result<Self, KernelError> {
        check_len("w", n * k, w.len())?;
        Ok(PackedWeight {
            k,
            n,
            panels: Panels::Q8(Q8Panels::quantize_out_in(w, n, k, QIsa::detect().layout())),
        })
    }

    /// From `[k, n]` row-major (the transpose of the checkpoint's layout).
    pub fn from_in_out(w_t: &[f32], k: usize, n: usize) -> Result<Self, KernelError> {
        check_len("w_t", k * n, w_t.len())?;
        let mut rows = HugeVec::filled(PanelRow([0.0; PANEL]), n.div_ceil(PANEL) * k);
        for (i, row) in w_t.chunks_exact(n.max(1)).enumerate().take(k) {
            for (panel, cols) in row.chunks(PANEL).enumerate() {
                rows[panel * k + i].0[..cols.len()].copy_from_slice(cols);
            }
        }
        Ok(PackedWeight {
            k,
            n,
            panels: Panels::F32(rows),
        })
    }

    /// Inputs (rows of `W`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Outputs (columns of `W`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Panels of [`PANEL`] columns, the last one zero-padded.
    pub fn panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    pub fn dtype(&self) -> WeightDtype {
        match self.panels {
            Panels::F32(_) => WeightDtype::F32,
            Panels::Bf16(_) => WeightDtype::Bf16,
            Panels::Q8(_) => WeightDtype::Int8,
        }
    }

    /// Bytes held, padding included: what one step reads.
    pub fn bytes(&self) -> usize {
        match &self.panels {
            Panels::F32(rows) => std::mem::size_of_val(rows.as_slice()),
            Panels::Bf16(rows) => std::mem::size_of_val(rows.as_slice()),
            Panels::Q8(q) => q.bytes(),
        }
    }

    pub(crate) fn data(&self) -> &Panels {
        &self.panels
    }

    /// `W[i, j]` (dequantised for int8), for tests and for unpacking.
    pub fn get(&self, i: usize, j: usize) -> f32 {
        let at = (j / PANEL) * self.k + i;
        match &self.panels {
            Panels::F32(rows) => rows[at].0[j % PANEL],
            Panels::Bf16(rows) => f32::from_bits(u32::from(rows[at].0[j % PANEL]) << 16),
            Panels::Q8(q) => q.get(i, j),
        }
    }
}

/// Calls `put(row index, lane, value)` for every weight of a `[n, k]` matrix: panel row
/// `(col / PANEL) * k + i`, lane `col % PANEL`.
fn scatter_out_in<T: Copy>(w: &[T], n: usize, k: usize, mut put: impl FnMut(usize, usize, T)) {
    for (col, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
        let (panel, lane) = (col / PANEL, col % PANEL);
        for (i, &v) in row.iter().enumerate() {
            put(panel * k + i, lane, v);
        }
    }
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The shape, not the millions of weights.
        f.debug_struct("PackedWeight")
            .field("k", &self.k)
            .field("n", &self.n)
            .finish()
    }
}

pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    given: usize,
) -> Result<(), KernelError> {
    if expected == given {
        Ok(())
    } else {
        Err(KernelError::BadLength {
            what,
            expected,
            given,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_pack_the_same_matrix() {
        let (k, n) = (5, 37);
        let w_t: Vec<f32> = (0..k * n).map(|i| i as f32).collect();
        let mut w = vec![0.0; k * n];
        for i in 0..k {
            for j in 0..n {
                w[j * k + i] = w_t[i * n + j];
            }
        }
        let a = PackedWeight::from_in_out(&w_t, k, n).expect("pack");
        let b = PackedWeight::from_out_in(&w, n, k).expect("pack");
        // Integers below 256 are exact in bf16.
        let w16: Vec<half::bf16> = w.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let c = PackedWeight::from_out_in_bf16(&w16, n, k).expect("pack");
        assert_eq!(a.panels(), 3);
        assert_eq!(c.dtype(), WeightDtype::Bf16);
        for i in 0..k {
            for j in 0..n {
                assert_eq!(a.get(i, j), w_t[i * n + j]);
                assert_eq!(b.get(i, j), w_t[i * n + j]);
                assert_eq!(c.get(i, j), w_t[i * n + j]);
            }
            // The padding past n is zero.
            for j in n..a.panels() * PANEL {
                assert_eq!(a.get(i, j), 0.0);
                assert_eq!(b.get(i, j), 0.0);
                assert_eq!(c.get(i, j), 0.0);
            }
        }
        assert_eq!(a.bytes(), 3 * k * PANEL * 4);
        assert_eq!(c.bytes(), 3 * k * PANEL * 2);
        match a.data() {
            Panels::F32(rows) => assert_eq!(rows.as_ptr() as usize % 64, 0),
            _ => panic!("f32 weights packed as another dtype"),
        }
    }

    #[test]
    fn wrong_lengths_are_refused() {
        assert!(PackedWeight::from_in_out(&[0.0; 5], 2, 3).is_err());
        assert!(PackedWeight::from_out_in(&[0.0; 7], 2, 3).is_err());
        let empty = PackedWeight::from_in_out(&[], 0, 4).expect("empty");
        assert_eq!(empty.bytes(), 0);
    }
}
