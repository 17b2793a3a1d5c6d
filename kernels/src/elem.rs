//! Element types the KV cache can hold: f32, bf16 and f16.
//!
//! All attention math runs in f32; these conversions are the only place a dtype matters. The
//! slice methods have defaults, and the impls override them where a faster path exists, so the
//! hot loops read f32 caches in place and convert half-precision rows a whole row at a time.

use half::{bf16, f16};

use crate::KvDtype;

/// An element of the KV cache.
pub trait KvElem: Copy + Send + Sync + Default + 'static {
    const DTYPE: KvDtype;

    fn to_f32(self) -> f32;

    fn from_f32(v: f32) -> Self;

    /// Borrows the elements as f32 when `Self` is f32, so kernels skip the conversion copy.
    #[inline(always)]
    fn as_f32_slice(src: &[Self]) -> Option<&[f32]> {
        let _ = src;
        None
    }

    /// Converts `src` into `dst`, element by element; the lengths must match.
    #[inline(always)]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
}

impl KvElem for f32 {
    const DTYPE: KvDtype = KvDtype::F32;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }

    #[inline(always)]
    fn as_f32_slice(src: &[Self]) -> Option<&[f32]> {
        Some(src)
    }

    #[inline(always)]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl KvElem for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;

    /// A bf16 is the top half of an f32, so widening is a shift; written out so that it
    /// vectorizes inside the SIMD-dispatched kernels.
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl KvElem for f16 {
    const DTYPE: KvDtype = KvDtype::F16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }

    /// `half` converts slices with F16C when the CPU has it (checked at run time).
    #[inline(always)]
    fn to_f32_slice(src: &[Self], dst: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        src.convert_to_f32_slice(dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<T: KvElem>(values: &[f32]) -> Vec<f32> {
        values.iter().map(|&v| T::from_f32(v).to_f32()).collect()
    }

    #[test]
    fn dtypes_match_types() {
        assert_eq!(<f32 as KvElem>::DTYPE, KvDtype::F32);
        assert_eq!(<bf16 as KvElem>::DTYPE, KvDtype::Bf16);
        assert_eq!(<f16 as KvElem>::DTYPE, KvDtype::F16);
    }

    #[test]
    fn exactly_representable_values_round_trip() {
        let values = [0.0, -0.0, 1.0, -2.5, 0.375, 1024.0, -65504.0];
        assert_eq!(round_trip::<f32>(&values), values);
        assert_eq!(round_trip::<f16>(&values), values);
        let bf_values = [0.0, 1.0, -2.5, 0.375, 1024.0, 1.5 * 2f32.powi(100)];
        assert_eq!(round_trip::<bf16>(&bf_values), bf_values);
    }

    #[test]
    fn bf16_shift_matches_half() {
        for bits in (0u16..=u16::MAX).step_by(7) {
            let b = bf16::from_bits(bits);
            let ours = KvElem::to_f32(b);
            let theirs = bf16::to_f32(b);
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()));
        }
    }

    #[test]
    fn slice_conversions_match_scalar() {
        let src: Vec<f32> = (0..37).map(|i| i as f32 * 0.37 - 5.0).collect();
        let h: Vec<f16> = src.iter().map(|&v| f16::from_f32(v)).collect();
        let mut out = vec![0.0f32; src.len()];
        <f16 as KvElem>::to_f32_slice(&h, &mut out);
        for (o, x) in out.iter().zip(&h) {
            assert_eq!(*o, x.to_f32());
        }
        let b: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
        <bf16 as KvElem>::to_f32_slice(&b, &mut out);
        for (o, x) in out.iter().zip(&b) {
            assert_eq!(*o, x.to_f32());
        }
        assert!(<f32 as KvElem>::as_f32_slice(&src).is_some());
        assert!(<f16 as KvElem>::as_f32_slice(&h).is_none());
    }
}
