//! How the attention kernels read one layer's K (or V) cache: a slice of a float [`KvElem`],
//! or int8 elements with an f32 scale per token row and kv head.
//!
//! The kernels widen every row they read to f32 before any arithmetic, so the dtype only
//! matters in [`KvRows::row_to_f32`]. It is `#[inline(always)]` and its int8 loop is plain
//! code: inlined into the `#[target_feature]` kernels of `tile_dispatch.rs`, it compiles to
//! AVX-512, AVX2 or baseline instructions with the rest of the kernel, so int8 takes the same
//! run-time ISA split as every other dtype.

use crate::KvElem;

/// One layer's K (or V) storage as the kernels read it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KvRows<'a, T> {
    /// Elements of the query's own float type.
    Plain(&'a [T]),
    /// `data[i] as f32 * scales[i / head_dim]`: one scale per token row and kv head.
    Int8 {
        data: &'a [i8],
        scales: &'a [f32],
        head_dim: usize,
    },
}

impl<'a, T: KvElem> KvRows<'a, T> {
    /// Elements (not scales) held.
    pub(crate) fn len(&self) -> usize {
        match self {
            KvRows::Plain(s) => s.len(),
            KvRows::Int8 { data, .. } => data.len(),
        }
    }

    /// The elements as f32, in place, when they are f32 already.
    #[inline(always)]
    pub(crate) fn as_f32(&self) -> Option<&'a [f32]> {
        match self {
            KvRows::Plain(s) => T::as_f32_slice(s),
            KvRows::Int8 { .. } => None,
        }
    }

    /// Widens elements `st..st + dst.len()` into `dst`. For int8, `st` and `dst.len()` are whole
    /// kv heads (multiples of `head_dim`), as every kernel reads them.
    #[inline(always)]
    pub(crate) fn row_to_f32(&self, st: usize, dst: &mut [f32]) {
        match *self {
            KvRows::Plain(s) => T::to_f32_slice(&s[st..st + dst.len()], dst),
            KvRows::Int8 {
                data,
                scales,
                head_dim,
            } => {
                let src = &data[st..st + dst.len()];
                let first = st / head_dim;
                for (j, (d, s)) in dst
                    .chunks_exact_mut(head_dim)
                    .zip(src.chunks_exact(head_dim))
                    .enumerate()
                {
                    let scale = scales[first + j];
                    for (o, &x) in d.iter_mut().zip(s) {
                        *o = f32::from(x) * scale;
                    }
                }
            }
        }
    }

    /// Element `i` as f32 (the exact per-row loops).
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> f32 {
        match *self {
            KvRows::Plain(s) => s[i].to_f32(),
            KvRows::Int8 {
                data,
                scales,
                head_dim,
            } => f32::from(data[i]) * scales[i / head_dim],
        }
    }

    /// Address of element 0 and the bytes per element, for prefetches only (never
    /// dereferenced). The prefetch loops take these once per row and step by cache lines, so
    /// the dtype match stays out of their per-line loop (it cost the narrow decode tiles ~5%
    /// of their instructions on a head of 8: "stories260K engine rows").
    #[inline(always)]
    pub(crate) fn bytes(&self) -> (*const u8, usize) {
        match self {
            KvRows::Plain(s) => (s.as_ptr().cast(), std::mem::size_of::<T>()),
            KvRows::Int8 { data, .. } => (data.as_ptr().cast(), 1),
        }
    }
}
