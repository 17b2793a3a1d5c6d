//! Runs one attention tile: picks its path and the instruction set its code was compiled for.
//!
//! Two layouts of the same online-softmax algorithm sit behind [`attend_tile`]:
//! [`crate::wide`] puts query rows across SIMD lanes, which needs no horizontal reductions and
//! wins once a tile has a few lanes' worth of rows (prefill); [`crate::narrow`] keeps each
//! query row whole and reduces dot products, which wins for the handful of rows of a decode
//! step. Both build on [`crate::tile`]; this file sits above the two, so neither path nor the
//! tile types know of the other.

use crate::narrow::{attend_narrow, Ahead};
use crate::simd::{Isa, Portable, Simd};
#[cfg(target_arch = "x86_64")]
use crate::simd_x86::{Avx2Fma, Avx512};
use crate::tile::{AttnInputs, Outputs, Scratch, Tile};
use crate::wide::attend_wide;
use crate::KvElem;

/// Computes one tile and writes its rows of `out`.
///
/// # Safety
/// No other thread may be writing this tile's part of the outputs (its rows and its kv
/// head's columns of `out`, or its partial slot), and `isa` must be supported by this CPU
/// ([`Isa::detect`] or one it lists).
pub(crate) unsafe fn attend_tile<T: KvElem>(
    isa: Isa,
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
    next: &mut Ahead,
) {
    match isa {
        // SAFETY: the caller promises the CPU has these features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { attend_avx512(inp, tile, scratch, out, next) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma => unsafe { attend_avx2(inp, tile, scratch, out, next) },
        _ => attend(Portable, inp, tile, scratch, out, next),
    }
}

/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_avx512<T: KvElem>(
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
    next: &mut Ahead,
) {
    // SAFETY: this function's own contract.
    let simd = unsafe { Avx512::new_unchecked() };
    attend(simd, inp, tile, scratch, out, next);
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<T: KvElem>(
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
    next: &mut Ahead,
) {
    // SAFETY: this function's own contract.
    let simd = unsafe { Avx2Fma::new_unchecked() };
    attend(simd, inp, tile, scratch, out, next);
}

/// The ISA-generic body; always inlined into the `#[target_feature]` wrappers above.
#[inline(always)]
fn attend<T: KvElem, S: Simd>(
    simd: S,
    inp: &AttnInputs<'_, T>,
    tile: &Tile<'_>,
    scratch: &mut Scratch,
    out: &Outputs<'_, T>,
    next: &mut Ahead,
) {
    if tile.is_wide(inp.group, inp.layout.head_dim) {
        // A prefill tile runs long enough that the next item's first keys arrive in time.
        next.issue(inp, usize::MAX);
        match (S::WIDE_CHUNK, S::KEYS) {
            (16, 16) => attend_wide::<T, S, 16, 16>(simd, inp, tile, scratch, out),
            (24, 6) => attend_wide::<T, S, 24, 6>(simd, inp, tile, scratch, out),
            _ => attend_wide::<T, S, 4, 4>(simd, inp, tile, scratch, out),
        }
    } else {
        attend_narrow(simd, inp, tile, scratch, out, next);
    }
}
