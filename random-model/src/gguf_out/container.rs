//! The file itself: GGUF version 3, 32-byte alignment, every tensor's data padded to 32 bytes,
//! as both llama.cpp's Python writer and its C one lay it out. The bytes are the `gguf`
//! crate's writer's ([`gguf::test_bytes::GgufBuilder`]).

use gguf::test_bytes::{GgufBuilder, F16_TYPE, F32_TYPE, Q8_0_TYPE};

use super::quant::{f16_bytes, q8_0_bytes};

/// A metadata value, in the types llama.cpp's tools write for these models.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Value {
    Str(String),
    U32(u32),
    F32(f32),
    Bool(bool),
    Strs(Vec<String>),
    F32s(Vec<f32>),
    I32s(Vec<i32>),
}

/// How a tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    F32,
    F16,
    Q8_0,
}

/// One tensor under its llama.cpp name, `shape` outermost first (as torch holds it).
#[derive(Debug, Clone)]
pub(crate) struct OutTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
    pub stored: Stored,
}

pub(crate) fn to_bytes(kv: &[(String, Value)], tensors: &[OutTensor]) -> Vec<u8> {
    let mut b = GgufBuilder::new();
    for (key, v) in kv {
        b = match v {
            Value::Str(s) => b.string(key, s),
            Value::U32(x) => b.u32(key, *x),
            Value::F32(x) => b.f32(key, *x),
            Value::Bool(x) => b.bool(key, *x),
            Value::Strs(items) => {
                let items: Vec<&str> = items.iter().map(String::as_str).collect();
                b.string_array(key, &items)
            }
            Value::F32s(items) => b.f32_array(key, items),
            Value::I32s(items) => b.i32_array(key, items),
        };
    }
    for t in tensors {
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let (ty, data) = match t.stored {
            Stored::F32 => (
                F32_TYPE,
                t.values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            Stored::F16 => (F16_TYPE, f16_bytes(&t.values)),
            Stored::Q8_0 => (Q8_0_TYPE, q8_0_bytes(&t.values)),
        };
        b = b.tensor_data(&t.name, &dims, ty, data);
    }
    let mut out = b.build();
    // The last tensor is padded too.
    out.resize(out.len().div_ceil(32) * 32, 0);
    out
}
