//! An open GGUF file: its checked header, candle's parse of its metadata, and its tensors
//! read one at a time and dequantised.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};

use crate::error::{GgufError, Result};
use crate::header::{check_header, Header, TensorEntry};

/// A GGUF file whose header passed [`check_header`].
pub struct GgufFile {
    path: PathBuf,
    header: Header,
    content: Content,
}

/// Metadata keys and values, as candle reads them.
pub type Metadata = HashMap<String, Value>;

/// Reads the header from `r`: the check first, then candle's parse, which allocates only
/// what the check has bounded.
pub fn read_header<R: Read + Seek>(r: &mut R, file_len: u64) -> Result<(Header, Content)> {
    let header = check_header(r, file_len)?;
    r.seek(SeekFrom::Start(0)).map_err(GgufError::Read)?;
    let content = Content::read(r)?;
    if content.tensor_data_offset != header.data_offset {
        return Err(GgufError::BadMetadata {
            key: "general.alignment".into(),
            reason: format!(
                "the tensor data would start at {} by this reader and {} by candle's",
                header.data_offset, content.tensor_data_offset
            ),
        });
    }
    Ok((header, content))
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Self::from_reader(path, &mut BufReader::new(file), len)
    }

    /// The file that `r` reads, `file_len` bytes long; `path` names it (tensors are read
    /// through [`reader`](Self::reader) from that path, or from any reader over the same bytes).
    pub fn from_reader<R: Read + Seek>(path: &Path, r: &mut R, file_len: u64) -> Result<Self> {
        let (header, content) = read_header(r, file_len)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            content,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn metadata(&self) -> &Metadata {
        &self.content.metadata
    }

    pub fn tensors(&self) -> &[TensorEntry] {
        &self.header.tensors
    }

    pub fn tensor_entry(&self, name: &str) -> Option<&TensorEntry> {
        self.header.tensors.iter().find(|t| t.name == name)
    }

    /// One tensor, dequantised to f32, in transformers' `[out, in]` order.
    pub fn tensor_f32<R: Read + Seek>(&self, reader: &mut R, name: &str) -> Result<Tensor> {
        if self.tensor_entry(name).is_none() {
            return Err(GgufError::BadTensor {
                name: name.to_string(),
                reason: "not in the file".into(),
            });
        }
        let q = self.content.tensor(reader, name, &Device::Cpu)?;
        Ok(q.dequantize(&Device::Cpu)?)
    }

    /// A reader over the file for [`tensor_f32`](Self::tensor_f32).
    pub fn reader(&self) -> Result<BufReader<File>> {
        File::open(&self.path)
            .map(BufReader::new)
            .map_err(|source| GgufError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// Typed reads of metadata values; errors name the key.
pub(crate) trait MetadataExt {
    fn opt_u64(&self, key: &str) -> Result<Option<u64>>;
    fn opt_f64(&self, key: &str) -> Result<Option<f64>>;
    fn opt_str(&self, key: &str) -> Result<Option<&str>>;
    fn opt_bool(&self, key: &str) -> Result<Option<bool>>;
    fn opt_array(&self, key: &str) -> Result<Option<&[Value]>>;

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_u64(key)?
            .map(|v| v as usize)
            .ok_or_else(|| GgufError::MissingMetadata { key: key.into() })
    }

    fn str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?
            .ok_or_else(|| GgufError::MissingMetadata { key: key.into() })
    }
}

fn bad(key: &str, want: &str, v: &Value) -> GgufError {
    GgufError::BadMetadata {
        key: key.into(),
        reason: format!("expected {want}, found {:?}", v.value_type()),
    }
}

impl MetadataExt for Metadata {
    fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(x) => u64::from(x),
            Value::U16(x) => u64::from(x),
            Value::U32(x) => u64::from(x),
            Value::U64(x) => x,
            Value::I8(x) if x >= 0 => x as u64,
            Value::I16(x) if x >= 0 => x as u64,
            Value::I32(x) if x >= 0 => x as u64,
            Value::I64(x) if x >= 0 => x as u64,
            _ => return Err(bad(key, "an unsigned integer", v)),
        };
        // Sizes and ids beyond 2^32 are not a model's.
        if n > u64::from(u32::MAX) {
            return Err(GgufError::BadMetadata {
                key: key.into(),
                reason: format!("{n} is out of range"),
            });
        }
        Ok(Some(n))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            // The shortest decimal that reads back as the same f32 (1e-5, not
            // 9.999999747378752e-6): the value the checkpoint's config.json had.
            Some(Value::F32(x)) => Ok(Some(x.to_string().parse().unwrap_or(f64::from(*x)))),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(bad(key, "a float", v)),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(bad(key, "a string", v)),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(bad(key, "a bool", v)),
        }
    }

    fn opt_array(&self, key: &str) -> Result<Option<&[Value]>> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(bad(key, "an array", v)),
        }
    }
}
