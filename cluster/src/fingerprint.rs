//! The model fingerprint a node publishes and a router checks: two nodes may only exchange KV
//! when they serve the very same weights.
//!
//! It hashes config.json, every safetensors header (tensor names, dtypes, shapes, offsets) and a
//! sample of the tensor bytes at both ends of each file. Reading whole weight files would take
//! seconds per gigabyte at every start; the sample still tells apart two checkpoints of one
//! architecture (fine-tunes, or random models drawn with different seeds). The KV dtype is not
//! part of it: that is in the published KV layout.
//!
//! A GGUF model's directory (the one `gguf::materialize` writes) links its file as
//! `model.gguf`: the file itself is hashed too, its length, its first [`GGUF_HEAD`] bytes (the
//! header, metadata and tensor table of any common file, and the first tensor's data) and
//! [`SAMPLE`] bytes at its end, so two files that differ in type or tensors differ here even
//! where a stale directory's `config.json` would not say so.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Bytes of tensor data sampled at each end of a weight file.
const SAMPLE: u64 = 64 * 1024;
/// A safetensors header larger than this is not one we will read whole.
const MAX_HEADER: u64 = 100 * 1024 * 1024;
/// Bytes read from the start of a GGUF file: its metadata (a 256K-token vocabulary's is
/// about 8 MiB) and tensor table come first.
const GGUF_HEAD: u64 = 16 * 1024 * 1024;
/// The GGUF file a GGUF model's directory links.
const GGUF_LINK: &str = "model.gguf";

/// The fingerprint of the model in `dir` (config.json plus `model.safetensors` or the shards
/// named by `model.safetensors.index.json`, or the GGUF file `model.gguf` links), as 16 hex
/// digits.
pub fn model_fingerprint(dir: &Path) -> io::Result<String> {
    let mut h = Fnv::new();
    h.feed(&std::fs::read(dir.join("config.json"))?);
    let gguf = dir.join(GGUF_LINK);
    if gguf.is_file() {
        feed_gguf(&mut h, &gguf)?;
    } else {
        for file in weight_files(dir)? {
            feed_weights(&mut h, &file)?;
        }
    }
    Ok(format!("{:016x}", h.0))
}

/// A GGUF file's length, head and tail (see the module docs).
fn feed_gguf(h: &mut Fnv, path: &Path) -> io::Result<()> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut magic = [0u8; 4];
    f.read_exact(&mut magic)?;
    if &magic != b"GGUF" {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a GGUF file", path.display()),
        ));
    }
    h.feed(&len.to_le_bytes());
    f.seek(SeekFrom::Start(0))?;
    let mut head = Vec::new();
    (&mut f).take(GGUF_HEAD).read_to_end(&mut head)?;
    h.feed(&head);
    let tail = SAMPLE.min(len);
    f.seek(SeekFrom::Start(len - tail))?;
    let mut buf = vec![0u8; tail as usize];
    f.read_exact(&mut buf)?;
    h.feed(&buf);
    Ok(())
}

fn weight_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json"))?)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut names: Vec<String> = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.dedup();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

fn feed_weights(h: &mut Fnv, path: &Path) -> io::Result<()> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER || 8 + header_len > len {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a safetensors file", path.display()),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header)?;
    h.feed(&len.to_le_bytes());
    h.feed(&header);
    let data_start = 8 + header_len;
    let data_len = len - data_start;
    let mut buf = vec![0u8; SAMPLE.min(data_len) as usize];
    f.read_exact(&mut buf)?;
    h.feed(&buf);
    f.seek(SeekFrom::Start(len - buf.len() as u64))?;
    f.read_exact(&mut buf)?;
    h.feed(&buf);
    Ok(())
}

/// FNV-1a, 64 bit: stable across builds and platforms, unlike `std::hash`.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn feed(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_model(dir: &Path, config: &str, data: &[u8]) {
        std::fs::write(dir.join("config.json"), config).unwrap();
        let header = br#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header);
        file.extend_from_slice(data);
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
    }

    #[test]
    fn same_files_same_print_and_any_change_shows() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        write_model(a.path(), "{}", &[1, 2, 3, 4]);
        write_model(b.path(), "{}", &[1, 2, 3, 4]);
        let fa = model_fingerprint(a.path()).unwrap();
        assert_eq!(fa, model_fingerprint(b.path()).unwrap());
        write_model(b.path(), "{}", &[1, 2, 3, 5]);
        assert_ne!(fa, model_fingerprint(b.path()).unwrap(), "weights differ");
        write_model(b.path(), "{\"x\":1}", &[1, 2, 3, 4]);
        assert_ne!(fa, model_fingerprint(b.path()).unwrap(), "config differs");
    }

    /// Issue 33: a GGUF model is fingerprinted by its file, not only by the directory's
    /// config.json: two files (two quantisations of one model) behind the same config differ.
    #[test]
    fn gguf_files_are_hashed_themselves() {
        let write = |dir: &Path, bytes: &[u8]| {
            std::fs::write(dir.join("config.json"), "{}").unwrap();
            let file = dir.join("weights.gguf");
            std::fs::write(&file, bytes).unwrap();
            let _ = std::fs::remove_file(dir.join(GGUF_LINK));
            std::os::unix::fs::symlink(&file, dir.join(GGUF_LINK)).unwrap();
            std::fs::write(
                dir.join("model.safetensors.index.json"),
                r#"{"weight_map": {}}"#,
            )
            .unwrap();
        };
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let mut q4 = b"GGUF\x03\0\0\0".to_vec();
        q4.extend(std::iter::repeat_n(7u8, 100_000));
        write(a.path(), &q4);
        write(b.path(), &q4);
        let fa = model_fingerprint(a.path()).unwrap();
        assert_eq!(fa, model_fingerprint(b.path()).unwrap());
        // One byte of the header (a tensor's type), and one in the middle of the data.
        for at in [20, 50_000] {
            let mut other = q4.clone();
            other[at] ^= 1;
            write(b.path(), &other);
            assert_ne!(fa, model_fingerprint(b.path()).unwrap(), "byte {at}");
        }
        write(b.path(), b"GGUX-not-gguf");
        assert!(model_fingerprint(b.path()).is_err());
    }

    #[test]
    fn missing_weights_is_an_error() {
        let a = tempfile::tempdir().unwrap();
        std::fs::write(a.path().join("config.json"), "{}").unwrap();
        assert!(model_fingerprint(a.path()).is_err());
    }
}
