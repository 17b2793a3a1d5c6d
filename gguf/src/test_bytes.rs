//! Crafted GGUF bytes for tests and fuzz seeds: a writer of version 3 files that lets a test
//! declare what it likes, including what a well-formed writer would refuse.

pub const F32_TYPE: u32 = 0;
pub const F16_TYPE: u32 = 1;
pub const Q8_0_TYPE: u32 = 8;

enum Entry {
    Meta {
        key: String,
        ty: u32,
        value: Vec<u8>,
    },
}

/// Builds a GGUF file in memory.
#[derive(Default)]
pub struct GgufBuilder {
    meta: Vec<Entry>,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

fn string_bytes(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

fn data_len(dims: &[u64], ty: u32) -> usize {
    let (block, bytes) = match crate::GgmlType::from_id(ty) {
        Some(t) => (t.block_elements(), t.block_bytes()),
        None => return 0,
    };
    dims.iter()
        .try_fold(1u64, |a, d| a.checked_mul(*d))
        .filter(|&n| n <= 1 << 24)
        .map(|n| (n / block * bytes) as usize)
        .unwrap_or(0)
}

impl GgufBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    fn meta(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.meta.push(Entry::Meta {
            key: key.to_string(),
            ty,
            value,
        });
        self
    }

    pub fn string(self, key: &str, v: &str) -> Self {
        self.meta(key, 8, string_bytes(v))
    }

    pub fn u32(self, key: &str, v: u32) -> Self {
        self.meta(key, 4, v.to_le_bytes().to_vec())
    }

    pub fn f32(self, key: &str, v: f32) -> Self {
        self.meta(key, 6, v.to_le_bytes().to_vec())
    }

    pub fn bool(self, key: &str, v: bool) -> Self {
        self.meta(key, 7, vec![u8::from(v)])
    }

    fn array(self, key: &str, elem: u32, n: u64, body: Vec<u8>) -> Self {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend_from_slice(&n.to_le_bytes());
        v.extend(body);
        self.meta(key, 9, v)
    }

    pub fn bool_array(self, key: &str, items: &[bool]) -> Self {
        let body = items.iter().map(|&b| u8::from(b)).collect();
        self.array(key, 7, items.len() as u64, body)
    }

    pub fn string_array(self, key: &str, items: &[&str]) -> Self {
        let body = items.iter().flat_map(|s| string_bytes(s)).collect();
        self.array(key, 8, items.len() as u64, body)
    }

    pub fn f32_array(self, key: &str, items: &[f32]) -> Self {
        let body = items.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.array(key, 6, items.len() as u64, body)
    }

    pub fn i32_array(self, key: &str, items: &[i32]) -> Self {
        let body = items.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.array(key, 5, items.len() as u64, body)
    }

    /// A u32 array that declares `n` elements and holds none.
    pub fn u32_array_declared(self, key: &str, n: u64) -> Self {
        self.array(key, 4, n, Vec::new())
    }

    /// A tensor of zeros; `dims` innermost first, as GGUF stores them.
    pub fn tensor(self, name: &str, dims: &[u64], ty: u32) -> Self {
        let data = vec![0u8; data_len(dims, ty)];
        self.tensor_data(name, dims, ty, data)
    }

    pub fn tensor_data(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.meta.len() as u64).to_le_bytes());
        for Entry::Meta { key, ty, value } in &self.meta {
            out.extend(string_bytes(key));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            out.extend(string_bytes(name));
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        out.resize(out.len().div_ceil(32) * 32, 0);
        let start = out.len();
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize(start + off as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }
}
