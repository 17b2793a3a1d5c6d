//! What the Q8 GEMM's loop nest (`q8_gemm.rs`) hands a micro-kernel: one tile's operands
//! ([`QTile`]) and the shape every kernel declares ([`TileKernel`]). The kernels (the generic
//! ones in `q8_gemm.rs`, AVX2's in `q8_avx2.rs`) and the loop nest build on this file, which
//! knows none of them.

use crate::simd::prefetch_l2;

/// A micro-kernel: the register tile it fills, and one tile.
pub(crate) trait TileKernel: Copy {
    /// Panels per tile.
    const NP: usize;
    /// Rows per tile, at most.
    const MR: usize;
    /// Whether a tile alone in its row block (batch 1) prefetches the next panels too. It
    /// pays where a block is long enough to hide the prefetches: AVX2's i16 kernel, 1.24x at
    /// batch 1; VNNI's 16 dot instructions a block lost 5-8%.
    const LONE_TILE_PREFETCH: bool;
    /// `c (+)= a @ w` for `rows` rows (1..=MR) and `panels` panels (`NP`, or 1 at the
    /// task's last odd panel).
    ///
    /// # Safety
    /// The tile lies inside the activations, the weights and the task's columns; the CPU
    /// runs the kernel's instruction set.
    unsafe fn tile(self, t: &QTile, rows: usize, panels: usize);
}

/// One micro-tile's operands, each at its first row, block and panel.
pub(crate) struct QTile {
    pub(crate) a: *const i8,
    /// `a` widened to i16 ([`QLayout::Pairs`](crate::q8::QLayout::Pairs) only).
    pub(crate) a16: *const i16,
    /// Stride of `a` and `a16`, in elements.
    pub(crate) lda: usize,
    pub(crate) a_scale: *const f32,
    pub(crate) a_comp: *const i32,
    /// Blocks per activation row (the stride of `a_scale` and `a_comp`).
    pub(crate) ldb: usize,
    pub(crate) w: *const u8,
    pub(crate) w_scale: *const u16,
    pub(crate) panel_bytes: usize,
    pub(crate) panel_scales: usize,
    pub(crate) nb: usize,
    pub(crate) c: *mut f32,
    pub(crate) ldc: usize,
    pub(crate) cols: usize,
    pub(crate) accumulate: bool,
    /// This tile's share of the next panels' lines, to prefetch (null: none), in each of
    /// the tile's panels (`panel_bytes` apart): `pf_lines` lines, `pf_per_block` a block, so
    /// that they arrive spread over the tile's work rather than in a burst (a burst at the
    /// tile's start measured no gain at batch 8, where the paced version gains 1.3x).
    pub(crate) pf: *const u8,
    pub(crate) pf_lines: usize,
    pub(crate) pf_per_block: usize,
}

impl QTile {
    /// Block `b`'s turn of the tile's prefetches, in `panels` panels. Kernels call it only in
    /// their instances for tiles with a `pf` (a const generic), so a batch-1 tile's loop on
    /// VNNI, only 16 dot instructions a block, carries none of its bookkeeping.
    #[inline(always)]
    pub(crate) fn prefetch(&self, b: usize, panels: usize) {
        let start = b * self.pf_per_block;
        for line in start..(start + self.pf_per_block).min(self.pf_lines) {
            for q in 0..panels {
                prefetch_l2(self.pf.wrapping_add(q * self.panel_bytes + line * 64));
            }
        }
    }
}
