//! The embedded default model: stories260K (MIT; `deploy/default-model/stories260K/SOURCE.md`),
//! compiled into every binary that runs a node (`fission`, `fission-prefill`, `fission-decode`),
//! so that `--model stories260K` serves out of the box, offline, whichever starts the node.
//! [`resolve`] is the one place a model spec meets it: the nodes' [`EngineArgs`] loads through
//! it, and `fission`'s other commands call it too.
//!
//! Every service takes a model directory, so the files are written to a cache directory named
//! by their content hash the first time they are needed, and that directory is what the
//! processes get.
//!
//! [`EngineArgs`]: crate::engine_args::EngineArgs

use std::path::{Path, PathBuf};

use crate::error::NodeError;

/// What `--model` names the embedded model by; also its model id in the APIs.
pub const NAME: &str = "stories260K";

macro_rules! embedded {
    ($($file:literal),* $(,)?) => {
        &[$(($file, include_bytes!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/default-model/stories260K/",
            $file
        )) as &[u8])),*]
    };
}

const FILES: &[(&str, &[u8])] = embedded!(
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "LICENSE",
    "SOURCE.md",
);

/// `spec` as a model a service can load: the embedded model's directory when `spec` names it
/// and no local path of that name exists, else `spec` unchanged (a directory or a hub id).
pub fn resolve(spec: &str) -> Result<String, NodeError> {
    if spec != NAME || Path::new(spec).exists() {
        return Ok(spec.to_string());
    }
    let dir = materialize(&cache_root())?;
    Ok(dir.to_string_lossy().into_owned())
}

fn cache_root() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("fission")
        .join("models")
}

/// 64-bit FNV-1a over every file's name and bytes: a new build with other files gets another
/// directory, never a half-updated one.
fn content_hash() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, bytes) in FILES {
        for b in name.as_bytes().iter().chain(*bytes) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Writes the files under `root/<hash>/stories260K` unless they are there, and returns that
/// directory. Several processes may race here: each writes its own temporary directory and
/// renames it into place, and a loser finds the winner's complete copy.
fn materialize(root: &Path) -> Result<PathBuf, NodeError> {
    let parent = root.join(format!("{:016x}", content_hash()));
    let dir = parent.join(NAME);
    if dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let io = |what: String| move |source| NodeError::Io { what, source };
    std::fs::create_dir_all(&parent).map_err(io(format!("creating {}", parent.display())))?;
    let tmp = tempfile::Builder::new()
        .prefix(".stories260K-")
        .tempdir_in(&parent)
        .map_err(io(format!("a temporary directory in {}", parent.display())))?;
    for (name, bytes) in FILES {
        std::fs::write(tmp.path().join(name), bytes)
            .map_err(io(format!("writing {name} to {}", tmp.path().display())))?;
    }
    match std::fs::rename(tmp.path(), &dir) {
        Ok(()) => {
            // Renamed away: nothing is left for the guard to remove.
            let _ = tmp.keep();
        }
        Err(_) if dir.join("model.safetensors").exists() => {}
        Err(e) => return Err(io(format!("creating {}", dir.display()))(e)),
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_model_is_written_once_and_reused() {
        let root = tempfile::tempdir().unwrap();
        let dir = materialize(root.path()).unwrap();
        assert_eq!(dir.file_name().unwrap(), NAME);
        for (name, bytes) in FILES {
            assert_eq!(&std::fs::read(dir.join(name)).unwrap(), bytes, "{name}");
        }
        let written = std::fs::metadata(dir.join("model.safetensors"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(materialize(root.path()).unwrap(), dir);
        let again = std::fs::metadata(dir.join("model.safetensors"))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(written, again, "the second call rewrote the files");
        // Only the model's directory is left: no temporary copies.
        let entries: Vec<_> = std::fs::read_dir(dir.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(entries, vec![std::ffi::OsString::from(NAME)]);
    }

    #[test]
    fn other_specs_pass_through() {
        assert_eq!(resolve("org/name").unwrap(), "org/name");
        assert_eq!(resolve("./some/dir").unwrap(), "./some/dir");
    }
}
