//! The tensor types this crate reads, as ggml numbers them, with their block geometry.

#[cfg(test)]
use candle_core::quantized::GgmlDType;

/// A ggml tensor type that this crate dequantises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl GgmlType {
    /// The type ggml numbers `id`, when this crate reads it.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// ggml's name for any type id, read or not, for error messages.
    pub fn name_of(id: u32) -> String {
        if let Some(t) = Self::from_id(id) {
            return t.name().to_string();
        }
        let name = match id {
            4 | 5 => "Q4_2/Q4_3 (removed from ggml)",
            9 => "Q8_1",
            15 => "Q8_K",
            16 => "IQ2_XXS",
            17 => "IQ2_XS",
            18 => "IQ3_XXS",
            19 => "IQ1_S",
            20 => "IQ4_NL",
            21 => "IQ3_S",
            22 => "IQ2_S",
            23 => "IQ4_XS",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            34 => "TQ1_0",
            35 => "TQ2_0",
            39 => "MXFP4",
            _ => return format!("unknown type {id}"),
        };
        format!("{name} (type {id})")
    }

    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Bf16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    /// Elements per block: 1 for the float types.
    pub fn block_elements(self) -> u64 {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
        }
    }

    /// Bytes per block, as ggml lays it out.
    pub fn block_bytes(self) -> u64 {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Whether the type is a block quantisation (dequantised at load), not a float.
    pub fn is_quantized(self) -> bool {
        self.block_elements() > 1
    }

    #[cfg(test)]
    fn candle(self) -> GgmlDType {
        match self {
            GgmlType::F32 => GgmlDType::F32,
            GgmlType::F16 => GgmlDType::F16,
            GgmlType::Bf16 => GgmlDType::BF16,
            GgmlType::Q4_0 => GgmlDType::Q4_0,
            GgmlType::Q4_1 => GgmlDType::Q4_1,
            GgmlType::Q5_0 => GgmlDType::Q5_0,
            GgmlType::Q5_1 => GgmlDType::Q5_1,
            GgmlType::Q8_0 => GgmlDType::Q8_0,
            GgmlType::Q2K => GgmlDType::Q2K,
            GgmlType::Q3K => GgmlDType::Q3K,
            GgmlType::Q4K => GgmlDType::Q4K,
            GgmlType::Q5K => GgmlDType::Q5K,
            GgmlType::Q6K => GgmlDType::Q6K,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_geometry_matches_candle() {
        for id in 0..64 {
            if let Some(t) = GgmlType::from_id(id) {
                assert_eq!(
                    t.block_elements() as usize,
                    t.candle().block_size(),
                    "{t:?}"
                );
                assert_eq!(t.block_bytes() as usize, t.candle().type_size(), "{t:?}");
            }
        }
    }
}
