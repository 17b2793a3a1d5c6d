//! The bounded check every GGUF file passes before any other code reads it.
//!
//! A GGUF file is untrusted input: its header declares counts and lengths that a reader would
//! otherwise allocate for. This walks the header once, holding at most one key and one tensor
//! name at a time, and checks each declared count and length against a fixed cap and against
//! the bytes that remain in the file, each tensor's type against the ones this crate reads, and
//! each tensor's data against the file's end. Only a file that passes is handed to candle's
//! reader (which allocates a `Value` per array element, so its size must be known first).

use std::io::{Read, Seek, SeekFrom};

use crate::error::{GgufError, Result};
use crate::types::GgmlType;

/// `GGUF` read as a little-endian u32.
pub const MAGIC: u32 = 0x4655_4747;
/// More tensors than any released checkpoint has (a 405B Llama has about 1,100).
pub const MAX_TENSORS: u64 = 1 << 16;
pub const MAX_METADATA: u64 = 1 << 16;
/// A key, or a tensor's name.
pub const MAX_NAME_BYTES: u64 = 1 << 16;
/// One string value (a chat template is tens of kilobytes).
pub const MAX_STRING_BYTES: u64 = 1 << 24;
/// Elements in all metadata arrays together: vocabularies of 256K tokens have 4 arrays of
/// that length. Bounds what candle's reader allocates (a `Value` per element).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// Arrays of arrays of arrays are deep enough for any key llama.cpp writes.
pub const MAX_ARRAY_DEPTH: u32 = 3;
pub const MAX_DIMS: u32 = 4;
/// Elements of one tensor: 2^40, far above the largest embedding matrix.
pub const MAX_TENSOR_ELEMENTS: u64 = 1 << 40;
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_ALIGNMENT: u64 = 1 << 20;

/// One tensor as the header declares it, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    /// As GGUF stores them: the innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// From the start of the tensor data.
    pub offset: u64,
    pub size_bytes: u64,
}

/// What the header check learned: enough to read the file safely and to identify it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub metadata_count: u64,
    pub tensors: Vec<TensorEntry>,
    pub alignment: u64,
    /// Where the tensor data starts: the end of the header, aligned.
    pub data_offset: u64,
    pub file_len: u64,
}

/// Metadata value types, as GGUF numbers them.
const U8: u32 = 0;
const I8: u32 = 1;
const U16: u32 = 2;
const I16: u32 = 3;
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U64: u32 = 10;
const I64: u32 = 11;
const F64: u32 = 12;

struct Walker<'r, R> {
    r: &'r mut R,
    pos: u64,
    len: u64,
    array_elements: u64,
}

impl<R: Read + Seek> Walker<'_, R> {
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn need(&self, n: u64, what: &str) -> Result<()> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
                needed: n,
                file_len: self.len,
            });
        }
        Ok(())
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        self.need(N as u64, what)?;
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).map_err(GgufError::Read)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes::<4>(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes::<8>(what)?))
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        self.need(n, what)?;
        self.r
            .seek(SeekFrom::Current(n as i64))
            .map_err(GgufError::Read)?;
        self.pos += n;
        Ok(())
    }

    /// A length-prefixed string of at most `max` bytes, read (`keep`) or skipped.
    fn string(&mut self, what: &str, max: u64, keep: bool) -> Result<Option<String>> {
        let len = self.u64(what)?;
        if len > max {
            return Err(GgufError::TooLarge {
                what: format!("{what} length"),
                given: len,
                max,
            });
        }
        if !keep {
            self.skip(len, what)?;
            return Ok(None);
        }
        self.need(len, what)?;
        let mut v = vec![0u8; len as usize];
        self.r.read_exact(&mut v).map_err(GgufError::Read)?;
        self.pos += len;
        Ok(Some(String::from_utf8_lossy(&v).into_owned()))
    }

    /// Skips one value of `ty`, checking every length in it; returns a scalar integer when
    /// the value is one (for `general.alignment`).
    fn value(&mut self, key: &str, ty: u32, depth: u32) -> Result<Option<u64>> {
        let scalar = |n: u64| Ok(Some(n));
        match ty {
            U8 | I8 | BOOL => scalar(u64::from(self.bytes::<1>(key)?[0])),
            U16 | I16 => scalar(u64::from(u16::from_le_bytes(self.bytes::<2>(key)?))),
            U32 | I32 => scalar(u64::from(self.u32(key)?)),
            F32 => self.skip(4, key).map(|_| None),
            U64 | I64 => scalar(self.u64(key)?),
            F64 => self.skip(8, key).map(|_| None),
            STRING => self.string(key, MAX_STRING_BYTES, false).map(|_| None),
            ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::BadMetadata {
                        key: key.to_string(),
                        reason: format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                    });
                }
                let elem = self.u32(key)?;
                let n = self.u64(key)?;
                self.array_elements = self.array_elements.saturating_add(n);
                if self.array_elements > MAX_ARRAY_ELEMENTS {
                    return Err(GgufError::TooLarge {
                        what: format!("metadata array elements (at {key:?})"),
                        given: self.array_elements,
                        max: MAX_ARRAY_ELEMENTS,
                    });
                }
                match fixed_size(elem) {
                    Some(size) => self.skip(n.saturating_mul(size), key)?,
                    None => {
                        // Each element is at least its 8-byte length prefix: refuse a count
                        // the file cannot hold before walking it.
                        self.need(n.saturating_mul(8), key)?;
                        for _ in 0..n {
                            self.value(key, elem, depth + 1)?;
                        }
                    }
                }
                Ok(None)
            }
            other => Err(GgufError::BadMetadata {
                key: key.to_string(),
                reason: format!("unknown value type {other}"),
            }),
        }
    }
}

fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        U8 | I8 | BOOL => Some(1),
        U16 | I16 => Some(2),
        U32 | I32 | F32 => Some(4),
        U64 | I64 | F64 => Some(8),
        _ => None,
    }
}

/// Checks the header of the GGUF file that `r` reads, `file_len` bytes long, from its start.
pub fn check_header<R: Read + Seek>(r: &mut R, file_len: u64) -> Result<Header> {
    r.seek(SeekFrom::Start(0)).map_err(GgufError::Read)?;
    let mut w = Walker {
        r,
        pos: 0,
        len: file_len,
        array_elements: 0,
    };
    let magic = w.u32("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = w.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count = w.u64("tensor count")?;
    let metadata_count = w.u64("metadata count")?;
    for (what, given, max) in [
        ("tensor count", tensor_count, MAX_TENSORS),
        ("metadata count", metadata_count, MAX_METADATA),
    ] {
        if given > max {
            return Err(GgufError::TooLarge {
                what: what.to_string(),
                given,
                max,
            });
        }
    }
    // Each entry takes at least a length prefix, a type and a byte (metadata), or a name
    // prefix, a dimension count, a type and an offset (tensors).
    w.need(
        metadata_count * (8 + 4 + 1) + tensor_count * (8 + 4 + 4 + 8),
        "the declared metadata and tensor entries",
    )?;
    let mut alignment = DEFAULT_ALIGNMENT;
    for _ in 0..metadata_count {
        let key = w
            .string("metadata key", MAX_NAME_BYTES, true)?
            .expect("kept strings are Some");
        let ty = w.u32(&key)?;
        let scalar = w.value(&key, ty, 0)?;
        if key == "general.alignment" {
            alignment = match (ty, scalar) {
                (U8 | U16 | U32 | U64, Some(a))
                    if a.is_power_of_two() && a <= MAX_ALIGNMENT =>
                {
                    a
                }
                _ => {
                    return Err(GgufError::BadMetadata {
                        key,
                        reason: format!(
                            "must be an unsigned power of two up to {MAX_ALIGNMENT}, given type {ty} value {scalar:?}"
                        ),
                    })
                }
            };
        }
    }
    let mut tensors = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        let name = w
            .string("tensor name", MAX_NAME_BYTES, true)?
            .expect("kept strings are Some");
        let n_dims = w.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadTensor {
                name,
                reason: format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut elements: u64 = 1;
        for _ in 0..n_dims {
            let d = w.u64(&name)?;
            elements = elements
                .checked_mul(d)
                .filter(|&e| e <= MAX_TENSOR_ELEMENTS)
                .ok_or_else(|| GgufError::BadTensor {
                    name: name.clone(),
                    reason: format!("more than {MAX_TENSOR_ELEMENTS} elements"),
                })?;
            dims.push(d);
        }
        let type_id = w.u32(&name)?;
        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnsupportedType {
            name: name.clone(),
            type_id,
            type_name: GgmlType::name_of(type_id),
        })?;
        let offset = w.u64(&name)?;
        let block = ggml_type.block_elements();
        if dims[0] % block != 0 {
            return Err(GgufError::BadTensor {
                name,
                reason: format!(
                    "its rows of {} elements are not whole {} blocks of {block}",
                    dims[0],
                    ggml_type.name()
                ),
            });
        }
        if offset % alignment != 0 {
            return Err(GgufError::BadTensor {
                name,
                reason: format!("data offset {offset} is not aligned to {alignment}"),
            });
        }
        let size_bytes = elements / block * ggml_type.block_bytes();
        tensors.push(TensorEntry {
            name,
            dims,
            ggml_type,
            offset,
            size_bytes,
        });
    }
    let data_offset = w.pos.div_ceil(alignment) * alignment;
    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.size_bytes));
        if end.is_none_or(|e| e > file_len) {
            return Err(GgufError::BadTensor {
                name: t.name.clone(),
                reason: format!(
                    "its {} bytes at data offset {} end past the file's {file_len} bytes (truncated?)",
                    t.size_bytes, t.offset
                ),
            });
        }
    }
    Ok(Header {
        version,
        metadata_count,
        tensors,
        alignment,
        data_offset,
        file_len,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;
    use crate::test_bytes::{GgufBuilder, F32_TYPE, Q8_0_TYPE};

    fn check(bytes: &[u8]) -> Result<Header> {
        check_header(&mut Cursor::new(bytes), bytes.len() as u64)
    }

    fn valid() -> Vec<u8> {
        GgufBuilder::new()
            .string("general.architecture", "llama")
            .u32("general.alignment", 32)
            .string_array("tokenizer.ggml.tokens", &["a", "b"])
            .tensor("token_embd.weight", &[64, 2], F32_TYPE)
            .tensor("output.weight", &[64, 2], Q8_0_TYPE)
            .build()
    }

    #[test]
    fn accepts_a_well_formed_file() {
        let h = check(&valid()).expect("valid");
        assert_eq!(h.version, 3);
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[1].size_bytes, 2 * 34 * 2);
        assert_eq!(h.data_offset % 32, 0);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = valid();
        for n in 0..bytes.len() {
            let err = check(&bytes[..n]).expect_err("truncated");
            let msg = err.to_string();
            assert!(
                msg.contains("truncated") || msg.contains("past the file"),
                "at {n}: {msg}"
            );
        }
    }

    #[test]
    fn wrong_magic_is_named() {
        let mut bytes = valid();
        bytes[..4].copy_from_slice(b"GGML");
        let err = check(&bytes).expect_err("magic").to_string();
        assert!(err.contains("not a GGUF file"), "{err}");
        assert!(err.contains("GGML"), "{err}");
    }

    #[test]
    fn unsupported_version_is_named() {
        let mut bytes = valid();
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        let err = check(&bytes).expect_err("v1").to_string();
        assert!(err.contains("version 1"), "{err}");
    }

    #[test]
    fn oversized_counts_are_refused_before_reading_entries() {
        for (at, what) in [(8, "tensor count"), (16, "metadata count")] {
            let mut bytes = valid();
            bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
            let err = check(&bytes).expect_err("oversized").to_string();
            assert!(err.contains(what) && err.contains("exceeds"), "{err}");
            // Within the cap but more than the file could hold.
            bytes[at..at + 8].copy_from_slice(&60_000u64.to_le_bytes());
            let err = check(&bytes).expect_err("oversized").to_string();
            assert!(err.contains("truncated"), "{err}");
        }
    }

    #[test]
    fn unsupported_tensor_type_is_named() {
        // 16 is IQ2_XXS: a real type this crate does not read.
        let bytes = GgufBuilder::new()
            .tensor("blk.0.attn_q.weight", &[256, 2], 16)
            .build();
        let err = check(&bytes).expect_err("iq2").to_string();
        assert!(err.contains("blk.0.attn_q.weight"), "{err}");
        assert!(err.contains("IQ2_XXS"), "{err}");
        let bytes = GgufBuilder::new().tensor("x", &[32], 999).build();
        let err = check(&bytes).expect_err("unknown").to_string();
        assert!(err.contains("999"), "{err}");
    }

    #[test]
    fn huge_lengths_and_bad_tensors_are_refused() {
        let mut bytes = GgufBuilder::new().string("k", "v").build();
        // The key's length prefix sits right after the 24-byte preamble.
        bytes[24..32].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        assert!(check(&bytes)
            .expect_err("long key")
            .to_string()
            .contains("exceeds"));
        let bytes = GgufBuilder::new()
            .tensor("t", &[u64::MAX / 2, 4], F32_TYPE)
            .build();
        assert!(check(&bytes)
            .expect_err("elements")
            .to_string()
            .contains("elements"));
        let bytes = GgufBuilder::new().tensor("t", &[33, 1], Q8_0_TYPE).build();
        assert!(check(&bytes)
            .expect_err("blocks")
            .to_string()
            .contains("blocks"));
        let bytes = GgufBuilder::new().u32("general.alignment", 0).build();
        assert!(check(&bytes)
            .expect_err("align 0")
            .to_string()
            .contains("power of two"));
        let bytes = GgufBuilder::new()
            .u32_array_declared("big", 1 << 40)
            .build();
        assert!(check(&bytes)
            .expect_err("array")
            .to_string()
            .contains("exceeds"));
    }

    #[test]
    fn tensor_data_past_the_end_is_refused() {
        let mut bytes = valid();
        bytes.truncate(bytes.len() - 1);
        let err = check(&bytes).expect_err("short data").to_string();
        assert!(
            err.contains("output.weight") && err.contains("past the file"),
            "{err}"
        );
    }
}
