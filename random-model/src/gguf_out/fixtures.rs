//! The GGUF fixtures the tests read, made here rather than committed (the repository carries
//! no weights but the embedded stories260K): stories260K converted by llama.cpp's converter
//! (`gguf/tests/fixtures/make.sh`) and one tiny random model per architecture converted and
//! quantised (`gguf/tests/fixtures/arch/make.py`). [`path`] writes a file the first time a test
//! asks for it, into `target/fixtures/gguf/`, and checks it is byte for byte the file llama.cpp
//! made (`gguf/tests/fixtures/manifest.json`), so llama.cpp's greedy ids measured on that file
//! (`llama_cpp_greedy.json`) hold for this one.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use serde_json::Value;

use super::{convert, GgufOptions, GgufType, Quantizer, VocabSource};
use crate::{write_model, ModelSpec};

/// Each per-architecture fixture's spec (`arch/specs.json`) and the name of the directory
/// make.py converted it from, which the converter writes as `general.name` (make.py numbers
/// its temporary directories).
const ARCH: &[(&str, &str)] = &[
    ("gemma2", "tiny-random-2"),
    ("gemma3", "tiny-random-4"),
    ("phi3", "tiny-random-6"),
    ("phi4_mini", "tiny-random-8"),
    ("mixtral", "tiny-random-10"),
    ("qwen3_moe", "tiny-random-4"),
];

/// The repository: random-model's parent.
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// `gguf/tests/fixtures`: the specs, references and manifest (no weights).
pub fn sources_dir() -> PathBuf {
    repo_root().join("gguf/tests/fixtures")
}

/// Where the files are written: `FISSION_GGUF_FIXTURES`, or `<repo>/target/fixtures/gguf`.
pub fn out_dir() -> PathBuf {
    std::env::var_os("FISSION_GGUF_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/fixtures/gguf"))
}

/// Every fixture, by its path under [`out_dir`] (and its key in the manifest).
pub fn names() -> Vec<String> {
    let mut v = vec![
        "stories260K-f32.gguf".to_string(),
        "stories260K-q8_0.gguf".to_string(),
    ];
    for (name, _) in ARCH {
        for t in ["f32", "q8_0"] {
            v.push(format!("arch/{name}-{t}.gguf"));
        }
    }
    v
}

/// `gguf/tests/fixtures/manifest.json`'s entry for `name`.
pub fn recorded(name: &str) -> anyhow::Result<Value> {
    let path = sources_dir().join("manifest.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let all: Value = serde_json::from_str(&text)?;
    let entry = all["files"][name].clone();
    anyhow::ensure!(!entry.is_null(), "{} has no {name}", path.display());
    Ok(entry)
}

/// The bytes of fixture `name`, made in `work` (a scratch directory).
pub fn generate(name: &str, work: &Path) -> anyhow::Result<Vec<u8>> {
    let stem = name
        .strip_suffix(".gguf")
        .with_context(|| format!("{name}: not a fixture"))?;
    let (model, ty) = match stem.rsplit_once('-') {
        Some((m, "f32")) => (m, GgufType::F32),
        Some((m, "q8_0")) => (m, GgufType::Q8_0),
        _ => anyhow::bail!("{name}: not a fixture"),
    };
    let stories = repo_root().join("deploy/default-model/stories260K");
    if model == "stories260K" {
        let opts = GgufOptions {
            ty,
            quantizer: Quantizer::Converter,
            vocab: VocabSource::TokenizerJson,
            dir_name: "stories260K".into(),
        };
        return convert(&stories, &opts);
    }
    let spec_name = model
        .strip_prefix("arch/")
        .with_context(|| format!("{name}: not a fixture"))?;
    let (_, dir_name) = ARCH
        .iter()
        .find(|(n, _)| *n == spec_name)
        .with_context(|| format!("{name}: not a fixture"))?;
    let specs_path = sources_dir().join("arch/specs.json");
    let specs: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&specs_path)?)
            .with_context(|| format!("parsing {}", specs_path.display()))?;
    let spec: ModelSpec = serde_json::from_value(specs[spec_name].clone())?;
    let dir = work.join(dir_name);
    write_model(&dir, &spec, &stories)?;
    let opts = GgufOptions {
        ty,
        quantizer: Quantizer::LlamaQuantize,
        vocab: VocabSource::SentencePiece,
        dir_name: dir_name.to_string(),
    };
    let bytes = convert(&dir, &opts);
    let _ = std::fs::remove_dir_all(&dir);
    bytes
}

fn sha256_of(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    super::manifest::manifest(&bytes)
        .ok()
        .and_then(|m| m["sha256"].as_str().map(str::to_string))
}

static WRITING: Mutex<()> = Mutex::new(());

/// Fixture `name` on disk, written if it is missing or stale: the file llama.cpp's tools made,
/// byte for byte, or an error saying where it differs. Test binaries run at once: each writes
/// a file of its own and renames it into place.
pub fn try_path(name: &str) -> anyhow::Result<PathBuf> {
    let want = recorded(name)?;
    let want_sha = want["sha256"]
        .as_str()
        .context("manifest entry has no sha256")?;
    let path = out_dir().join(name);
    let _guard = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if sha256_of(&path).as_deref() == Some(want_sha) {
        return Ok(path);
    }
    let parent = path.parent().context("fixture path has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let work = parent.join(format!(".work-{}", std::process::id()));
    let bytes = generate(name, &work);
    let _ = std::fs::remove_dir_all(&work);
    let bytes = bytes?;
    let ours = super::manifest::manifest(&bytes)?;
    let diff = super::manifest::differences(&ours, &want);
    anyhow::ensure!(
        diff.is_empty(),
        "{name} is not the file llama.cpp made:\n{}",
        diff.join("\n")
    );
    let tmp = parent.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("fixture"),
        std::process::id()
    ));
    std::fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(path)
}

/// [`try_path`] for tests: panics with the reason.
pub fn path(name: &str) -> PathBuf {
    try_path(name).unwrap_or_else(|e| panic!("GGUF fixture {name}: {e:#}"))
}
