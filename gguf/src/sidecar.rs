//! A GGUF file as a model directory: the JSON files a transformers checkpoint carries
//! (config, tokenizer, tokenizer config with the chat template, generation config), written
//! from the file's metadata into a cache directory, with `model.gguf` linking to the file.
//!
//! Everything downstream that reads a model directory (the engine's resolver, the gateway's
//! tokenizer and chat template, the cluster's fingerprint) then reads a GGUF model unchanged.
//! The weights stay in the GGUF file: no dequantised copy is written.
//!
//! The fingerprint hashes `config.json` and the safetensors files an index names; the index
//! written here names none, and `config.json` carries the GGUF's identity (a hash of its
//! header and of the tensor bytes at both ends, as the fingerprint samples safetensors), so two
//! directories agree exactly when their GGUF files do.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::json;

use crate::error::{GgufError, Result};
use crate::file::GgufFile;

/// Bumped when the files written here change, so old directories are not reused.
const FORMAT: u32 = 2;
/// Bytes of tensor data sampled at each end of the file for its identity.
const SAMPLE: u64 = 64 * 1024;
/// The link to the GGUF file in the directory, which the engine's resolver looks for.
pub const WEIGHTS_LINK: &str = "model.gguf";

/// `$XDG_CACHE_HOME/fission/gguf`, else `~/.cache/fission/gguf`, else under the temp dir.
pub fn default_cache_root() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("fission")
        .join("gguf")
}

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        && path.is_file()
}

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

/// A hash of the header and of the tensor bytes at both ends of the file.
fn identity(file: &GgufFile) -> Result<String> {
    let io = |source| GgufError::Io {
        path: file.path().to_path_buf(),
        source,
    };
    let h = file.header();
    let mut f = File::open(file.path()).map_err(io)?;
    let mut fnv = Fnv::new();
    fnv.feed(&h.file_len.to_le_bytes());
    let mut header = vec![0u8; h.data_offset.min(h.file_len) as usize];
    f.read_exact(&mut header).map_err(io)?;
    fnv.feed(&header);
    let data = h.file_len - h.data_offset.min(h.file_len);
    let mut buf = vec![0u8; SAMPLE.min(data) as usize];
    f.read_exact(&mut buf).map_err(io)?;
    fnv.feed(&buf);
    f.seek(SeekFrom::Start(h.file_len - buf.len() as u64))
        .map_err(io)?;
    f.read_exact(&mut buf).map_err(io)?;
    fnv.feed(&buf);
    Ok(format!("{:016x}", fnv.0))
}

/// The model directory for the GGUF file at `gguf`, under `cache_root`: written the first
/// time, reused after. Several processes may race here: each writes its own temporary
/// directory and renames it into place, and a loser uses the winner's.
pub fn materialize(gguf: &Path, cache_root: &Path) -> Result<PathBuf> {
    let canonical = gguf.canonicalize().map_err(|source| GgufError::Io {
        path: gguf.to_path_buf(),
        source,
    })?;
    let file = GgufFile::open(&canonical)?;
    let id = identity(&file)?;
    let mut key = Fnv::new();
    key.feed(canonical.to_string_lossy().as_bytes());
    key.feed(id.as_bytes());
    key.feed(&FORMAT.to_le_bytes());
    let stem = canonical
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let parent = cache_root.join(format!("{:016x}", key.0));
    let dir = parent.join(&stem);
    if dir.join("config.json").is_file() && dir.join(WEIGHTS_LINK).is_file() {
        return Ok(dir);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| GgufError::Io { path, source }
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    // Unique to this call: threads of one process may race here too.
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let tmp = parent.join(format!(
        ".{stem}-{}-{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let meta = file.metadata();
    let mut config = crate::config::hf_config(&file)?;
    config["fission_gguf"] = json!({
        "identity": id,
        "weight_type": crate::tensors::weight_type(&file),
        "tensor_types": crate::tensors::type_counts(&file)
            .into_iter()
            .map(|(t, n)| (t.to_string(), json!(n)))
            .collect::<serde_json::Map<_, _>>(),
    });
    let files = [
        ("config.json", config),
        ("tokenizer.json", crate::tokenizer::tokenizer_json(meta)?),
        (
            "tokenizer_config.json",
            crate::tokenizer::tokenizer_config(meta)?,
        ),
        (
            "generation_config.json",
            crate::tokenizer::generation_config(meta)?,
        ),
        (
            "model.safetensors.index.json",
            json!({"metadata": {"format": "gguf"}, "weight_map": {}}),
        ),
    ];
    for (name, value) in files {
        let path = tmp.join(name);
        let text = serde_json::to_string_pretty(&value).expect("JSON values serialise");
        std::fs::write(&path, text).map_err(io(&path))?;
    }
    let link = tmp.join(WEIGHTS_LINK);
    std::os::unix::fs::symlink(&canonical, &link).map_err(io(&link))?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process won the race (or an old, incomplete directory is in the way).
        let _ = std::fs::remove_dir_all(&tmp);
        if !(dir.join("config.json").is_file() && dir.join(WEIGHTS_LINK).is_file()) {
            return Err(GgufError::Io {
                path: dir,
                source: std::io::Error::other("could not write the GGUF model directory"),
            });
        }
    }
    Ok(dir)
}
