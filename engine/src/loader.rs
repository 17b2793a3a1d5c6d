//! Finds a model's files: in a local directory, or in the Hugging Face hub cache, downloading
//! through hf-hub only when the files are not cached and offline mode is off. A local `.gguf`
//! file resolves to the model directory the `gguf` crate writes for it in the cache (its
//! config, tokenizer and chat template as JSON, `model.gguf` linking to the file).
//!
//! This is the one place in the engine that may touch the network, and only at load time.

use std::path::{Path, PathBuf};

use hf_hub::{Cache, Repo, RepoType};

use crate::error::{EngineError, Result};

/// Where a model comes from: a directory, or a hub repo id with a revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Local(PathBuf),
    Hub { repo_id: String, revision: String },
}

impl ModelSource {
    /// `DIR_OR_REPO`: an existing path is local; `org/name[@revision]` is a hub repo.
    pub fn parse(spec: &str) -> Self {
        let path = Path::new(spec);
        if path.exists() || spec.starts_with('.') || spec.starts_with('/') {
            return ModelSource::Local(path.to_path_buf());
        }
        match spec.split_once('@') {
            Some((repo, rev)) => ModelSource::Hub {
                repo_id: repo.to_string(),
                revision: rev.to_string(),
            },
            None => ModelSource::Hub {
                repo_id: spec.to_string(),
                revision: "main".to_string(),
            },
        }
    }

    /// A short id for the model, used in APIs and logs.
    pub fn model_id(&self) -> String {
        match self {
            // A GGUF file is named by its stem, as the directory written for it is.
            ModelSource::Local(p) if gguf::is_gguf(p) => p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string()),
            ModelSource::Local(p) => p
                .canonicalize()
                .unwrap_or_else(|_| p.clone())
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string()),
            ModelSource::Hub { repo_id, .. } => repo_id.clone(),
        }
    }
}

/// The resolved files of one model.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

const WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

impl ModelFiles {
    pub fn resolve(source: &ModelSource) -> Result<Self> {
        match source {
            ModelSource::Local(file) if gguf::is_gguf(file) => Self::from_gguf(file),
            ModelSource::Local(dir) => Self::from_dir(dir),
            ModelSource::Hub { repo_id, revision } => Self::from_hub(repo_id, revision),
        }
    }

    /// The model directory written for the GGUF file at `file` (under
    /// `gguf::default_cache_root`), resolved.
    pub fn from_gguf(file: &Path) -> Result<Self> {
        let dir = gguf::materialize(file, &gguf::default_cache_root())
            .map_err(|e| crate::gguf_weights::gguf_error(file, e))?;
        Self::from_dir(&dir)
    }

    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(EngineError::MissingFile {
                path: dir.to_path_buf(),
            });
        }
        let required = |name: &str| -> Result<PathBuf> {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(EngineError::MissingFile { path: p })
            }
        };
        let optional = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        let config = required("config.json")?;
        let tokenizer = required("tokenizer.json")?;
        let weights = if dir.join(WEIGHTS).is_file() {
            vec![dir.join(WEIGHTS)]
        } else if dir.join(gguf::WEIGHTS_LINK).is_file() {
            vec![dir.join(gguf::WEIGHTS_LINK)]
        } else if dir.join(WEIGHTS_INDEX).is_file() {
            shard_names(&dir.join(WEIGHTS_INDEX))?
                .into_iter()
                .map(|n| required(&n))
                .collect::<Result<Vec<_>>>()?
        } else {
            return Err(EngineError::MissingFile {
                path: dir.join(WEIGHTS),
            });
        };
        Ok(ModelFiles {
            config,
            weights,
            tokenizer,
            tokenizer_config: optional("tokenizer_config.json"),
            generation_config: optional("generation_config.json"),
        })
    }

    fn from_hub(repo_id: &str, revision: &str) -> Result<Self> {
        let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
        let cache = Cache::from_env();
        let cached = cache.repo(repo.clone());
        let offline = std::env::var("HF_HUB_OFFLINE")
            .map(|v| v == "1" || v.eq_ignore_ascii_case("true"))
            .unwrap_or(false);
        let hub_err = |reason: String| EngineError::Hub {
            repo_id: repo_id.to_string(),
            revision: revision.to_string(),
            reason,
        };
        // Cached files are used without touching the network, so a warm cache works offline.
        // hf-hub's cache lookup resolves only refs (branches, tags); a commit hash names its
        // snapshot folder directly, as huggingface_hub lays it out.
        let snapshot = (revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| {
                cache
                    .path()
                    .join(repo.folder_name())
                    .join("snapshots")
                    .join(revision)
            });
        let fetch = |name: &str, required: bool| -> Result<Option<PathBuf>> {
            if let Some(p) = snapshot
                .as_ref()
                .map(|s| s.join(name))
                .filter(|p| p.is_file())
            {
                return Ok(Some(p));
            }
            if let Some(p) = cached.get(name) {
                return Ok(Some(p));
            }
            if offline {
                return if required {
                    Err(hub_err(format!(
                        "{name} is not in the hub cache and HF_HUB_OFFLINE is set; pass --model PATH to a local model directory"
                    )))
                } else {
                    Ok(None)
                };
            }
            match download(&repo, name) {
                Ok(p) => Ok(Some(p)),
                Err(_) if !required => Ok(None),
                Err(reason) => Err(hub_err(format!(
                    "{reason}; the hub could not be reached or has no {name}. Pass --model PATH to a local model directory instead"
                ))),
            }
        };
        let config = fetch("config.json", true)?.expect("required files are Some");
        let tokenizer = fetch("tokenizer.json", true)?.expect("required files are Some");
        let weights = match fetch(WEIGHTS, false)? {
            Some(p) => vec![p],
            None => {
                let index = fetch(WEIGHTS_INDEX, true)?.expect("required files are Some");
                shard_names(&index)?
                    .into_iter()
                    .map(|n| fetch(&n, true).map(|p| p.expect("required files are Some")))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        Ok(ModelFiles {
            config,
            weights,
            tokenizer,
            tokenizer_config: fetch("tokenizer_config.json", false)?,
            generation_config: fetch("generation_config.json", false)?,
        })
    }
}

/// Downloads one file on a private runtime, on its own thread so this works from inside or
/// outside an async context.
fn download(repo: &Repo, name: &str) -> std::result::Result<PathBuf, String> {
    let repo = repo.clone();
    let name = name.to_string();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            let api = hf_hub::api::tokio::ApiBuilder::from_env()
                .with_progress(false)
                .build()
                .map_err(|e| e.to_string())?;
            api.repo(repo).get(&name).await.map_err(|e| e.to_string())
        })
    })
    .join()
    .map_err(|_| "download thread panicked".to_string())?
}

fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|source| EngineError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| EngineError::Json {
        path: index.to_path_buf(),
        source,
    })?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| EngineError::InvalidConfig {
            reason: format!("{} has no weight_map", index.display()),
        })?;
    let mut names: Vec<String> = map
        .values()
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sources() {
        assert_eq!(
            ModelSource::parse("HuggingFaceTB/SmolLM2-135M-Instruct@abc"),
            ModelSource::Hub {
                repo_id: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
                revision: "abc".into()
            }
        );
        assert!(matches!(ModelSource::parse("./m"), ModelSource::Local(_)));
    }

    #[test]
    fn missing_files_are_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = ModelFiles::from_dir(dir.path()).expect_err("empty dir");
        assert!(err.to_string().contains("config.json"), "{err}");
        std::fs::write(dir.path().join("config.json"), "{}").expect("write");
        std::fs::write(dir.path().join("tokenizer.json"), "{}").expect("write");
        let err = ModelFiles::from_dir(dir.path()).expect_err("no weights");
        assert!(err.to_string().contains("model.safetensors"), "{err}");
    }

    #[test]
    fn offline_cache_miss_says_so() {
        let dir = tempfile::tempdir().expect("tempdir");
        // SAFETY-free: tests in this module are the only readers of these variables.
        std::env::set_var("HF_HOME", dir.path());
        std::env::set_var("HF_HUB_OFFLINE", "1");
        let err = ModelFiles::resolve(&ModelSource::parse("nobody/nothing")).expect_err("offline");
        assert!(err.to_string().contains("--model PATH"), "{err}");
        std::env::remove_var("HF_HUB_OFFLINE");
    }
}
