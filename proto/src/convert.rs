//! The KV vocabulary's wire form: [`kv_types`] to and from `fission.v1` messages, in this one
//! place.

use kv_types::{KvDtype, KvLayout};

use crate::v1;

/// A wire layout that does not describe a cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error("KV layout is missing")]
    Missing,
    #[error("KV layout has no dtype (code {code})")]
    UnknownDtype { code: i32 },
    #[error("KV layout: {0}")]
    Invalid(#[from] kv_types::InvalidLayout),
}

impl From<KvDtype> for v1::KvDtype {
    fn from(d: KvDtype) -> Self {
        match d {
            KvDtype::F32 => v1::KvDtype::F32,
            KvDtype::Bf16 => v1::KvDtype::Bf16,
            KvDtype::F16 => v1::KvDtype::F16,
            KvDtype::Int8 => v1::KvDtype::Int8,
        }
    }
}

impl TryFrom<v1::KvDtype> for KvDtype {
    type Error = LayoutError;

    fn try_from(d: v1::KvDtype) -> Result<Self, LayoutError> {
        match d {
            v1::KvDtype::F32 => Ok(KvDtype::F32),
            v1::KvDtype::Bf16 => Ok(KvDtype::Bf16),
            v1::KvDtype::F16 => Ok(KvDtype::F16),
            v1::KvDtype::Int8 => Ok(KvDtype::Int8),
            v1::KvDtype::Unspecified => Err(LayoutError::UnknownDtype { code: d as i32 }),
        }
    }
}

impl From<KvLayout> for v1::KvLayout {
    fn from(l: KvLayout) -> Self {
        v1::KvLayout {
            dtype: v1::KvDtype::from(l.dtype) as i32,
            num_layers: l.num_layers,
            block_size: l.block_size,
            num_kv_heads: l.num_kv_heads,
            head_dim: l.head_dim,
            windows: l.windows.0,
        }
    }
}

impl TryFrom<&v1::KvLayout> for KvLayout {
    type Error = LayoutError;

    /// Checks the dtype and every dimension's range.
    fn try_from(l: &v1::KvLayout) -> Result<Self, LayoutError> {
        let dtype = v1::KvDtype::try_from(l.dtype)
            .map_err(|_| LayoutError::UnknownDtype { code: l.dtype })?
            .try_into()?;
        let layout = KvLayout {
            dtype,
            num_layers: l.num_layers,
            block_size: l.block_size,
            num_kv_heads: l.num_kv_heads,
            head_dim: l.head_dim,
            windows: kv_types::LayerWindows(l.windows),
        };
        layout.validate()?;
        Ok(layout)
    }
}

/// The layout a message carries, checked.
pub fn layout(l: Option<&v1::KvLayout>) -> Result<KvLayout, LayoutError> {
    KvLayout::try_from(l.ok_or(LayoutError::Missing)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_round_trip_and_bad_ones_are_refused() {
        for dtype in KvDtype::ALL {
            let l = KvLayout {
                dtype,
                ..KvLayout::SMOLLM2_135M_F32
            };
            let wire = v1::KvLayout::from(l);
            assert_eq!(layout(Some(&wire)), Ok(l));
        }
        let windowed = KvLayout {
            windows: kv_types::LayerWindows::of(&[Some(512), None]),
            ..KvLayout::SMOLLM2_135M_F32
        };
        assert_eq!(layout(Some(&windowed.into())), Ok(windowed));
        assert_eq!(layout(None), Err(LayoutError::Missing));
        let mut wire = v1::KvLayout::from(KvLayout::SMOLLM2_135M_F32);
        wire.dtype = 0;
        assert_eq!(
            layout(Some(&wire)),
            Err(LayoutError::UnknownDtype { code: 0 })
        );
        wire.dtype = 99;
        assert_eq!(
            layout(Some(&wire)),
            Err(LayoutError::UnknownDtype { code: 99 })
        );
        let mut wire = v1::KvLayout::from(KvLayout::SMOLLM2_135M_F32);
        wire.head_dim = 0;
        assert!(matches!(layout(Some(&wire)), Err(LayoutError::Invalid(_))));
    }
}
