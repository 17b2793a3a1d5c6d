//! The file itself: GGUF version 3, 32-byte alignment, every tensor's data padded to 32 bytes,
//! as both llama.cpp's Python writer and its C one lay it out. The bytes are the `gguf`
//! crate's writer's ([`gguf::test_bytes::GgufBuilder`]).

use gguf::test_bytes::{GgufBuilder, F16_TYPE, F32_TYPE, Q8_0_TYPE};
use half::f16;

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

/// Q8_0 blocks of 32 values: `d = amax / 127` in f32, stored as f16, and each value
/// `round(x * (1 / d))` (half away from zero), as ggml's `quantize_row_q8_0_ref` and gguf-py's
/// `Q8_0.quantize_blocks` compute it.
pub(crate) fn q8_0_bytes(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / 32 * 34);
    for block in values.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|x| (x * id).round() as i8 as u8));
    }
    out
}

/// IEEE half, round to nearest even (numpy's `astype(np.float16)`, ggml's FP32_TO_FP16).
pub(crate) fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
        .collect()
}
