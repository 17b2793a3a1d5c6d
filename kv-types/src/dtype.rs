//! The cache's element type.
//!
//! `int8` stores each token's row of each kv head as `head_dim` signed bytes plus one f32
//! scale (`max |x| / 127`). A scale per (block, kv head, token row) rather than one per
//! (block, kv head): a row's bytes then depend on that row alone, so a block filled over several
//! steps, filled on a prefill node and finished on a decode node, or moved by migration holds
//! exactly the bytes a colocated engine would. The scales cost `4 / head_dim` bytes per
//! element (1/16 more at head_dim 64), counted in every byte figure ([`KvDtype::scale_bytes`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Element type of the KV cache. The discriminants are the KV frame's dtype code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[repr(u8)]
pub enum KvDtype {
    F32 = 0,
    Bf16 = 1,
    F16 = 2,
    /// Signed bytes with an f32 scale per token row and kv head (see the module docs).
    Int8 = 3,
}

impl KvDtype {
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::Bf16, KvDtype::F16, KvDtype::Int8];

    /// Bytes of one element, scales not counted (see [`KvDtype::scale_bytes`]).
    pub const fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
            KvDtype::Int8 => 1,
        }
    }

    /// Bytes of scale stored per token row and kv head, beside the elements: 0 for the float
    /// types.
    pub const fn scale_bytes(self) -> usize {
        match self {
            KvDtype::Int8 => 4,
            _ => 0,
        }
    }

    /// Whether elements are stored quantised, with scales.
    pub const fn is_quantized(self) -> bool {
        self.scale_bytes() > 0
    }

    /// The frame's one-byte code.
    pub const fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| d.code() == code)
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::F16 => "f16",
            KvDtype::Int8 => "int8",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name that is not `f32`, `bf16`, `f16` or `int8`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDtype(pub String);

impl fmt::Display for UnknownDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown KV dtype {:?}: expected f32, bf16, f16 or int8",
            self.0
        )
    }
}

impl std::error::Error for UnknownDtype {}

impl FromStr for KvDtype {
    type Err = UnknownDtype;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| UnknownDtype(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_codes_and_serde_agree() {
        for d in KvDtype::ALL {
            assert_eq!(d.as_str().parse::<KvDtype>(), Ok(d));
            assert_eq!(KvDtype::from_code(d.code()), Some(d));
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.as_str())
            );
        }
        assert_eq!(KvDtype::from_code(4), None);
        assert!("f8".parse::<KvDtype>().is_err());
        assert_eq!(KvDtype::Bf16.size_bytes(), 2);
        assert_eq!(KvDtype::Int8.size_bytes(), 1);
        assert_eq!(KvDtype::Int8.scale_bytes(), 4);
        assert_eq!(KvDtype::Bf16.scale_bytes(), 0);
        assert!("int8".parse::<KvDtype>().unwrap().is_quantized());
    }
}
