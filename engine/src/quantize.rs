//! Weight quantisation chosen at load (`--quantize`): none, or int8 in the style of llama.cpp's
//! Q8_0 (one scale per 32 inputs of each output, activations quantised to match at every
//! matmul; see `kernels::PackedWeight::from_out_in_int8`). A GGUF file's block-quantised
//! weights run as stored with `none`, and are dequantised at load with `dequant`.
//!
//! Every projection and the lm_head are quantised; embeddings and norms stay in the load dtype,
//! as Q8_0 GGUFs keep norms in f32. The checkpoint may be f32 or bf16: each weight is quantised
//! from its f32 value.

use std::fmt;
use std::str::FromStr;

use crate::error::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantize {
    /// Weights as loaded (f32 or bf16).
    #[default]
    None,
    /// int8 with an f16 scale per 32 inputs (34 bytes per 32 weights).
    Int8,
    /// A GGUF file's block-quantised weights dequantised at load into the load dtype, rather
    /// than run as stored (what `None` does for them): the comparison path. Same as `None`
    /// for other checkpoints.
    Dequant,
}

impl FromStr for Quantize {
    type Err = EngineError;

    fn from_str(s: &str) -> Result<Self, EngineError> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(Quantize::None),
            "int8" | "q8_0" => Ok(Quantize::Int8),
            "dequant" => Ok(Quantize::Dequant),
            other => Err(EngineError::InvalidConfig {
                reason: format!("quantize must be none, int8 or dequant, given {other:?}"),
            }),
        }
    }
}

impl fmt::Display for Quantize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Quantize::None => "none",
            Quantize::Int8 => "int8",
            Quantize::Dequant => "dequant",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for q in [Quantize::None, Quantize::Int8, Quantize::Dequant] {
            assert_eq!(q.to_string().parse::<Quantize>().expect("parse"), q);
        }
        assert_eq!("Q8_0".parse::<Quantize>().expect("alias"), Quantize::Int8);
        let err = "int4".parse::<Quantize>().expect_err("int4 is not offered");
        assert!(err.to_string().contains("int4"), "{err}");
    }
}
