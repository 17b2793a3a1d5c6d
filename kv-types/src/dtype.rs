//! The cache's element type.

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
}

impl KvDtype {
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::Bf16, KvDtype::F16];

    pub const fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 | KvDtype::F16 => 2,
        }
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
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dtype name that is not `f32`, `bf16` or `f16`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownDtype(pub String);

impl fmt::Display for UnknownDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown KV dtype {:?}: expected f32, bf16 or f16",
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
        assert_eq!(KvDtype::from_code(3), None);
        assert!("f8".parse::<KvDtype>().is_err());
        assert_eq!(KvDtype::Bf16.size_bytes(), 2);
    }
}
