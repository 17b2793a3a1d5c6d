//! Loading `org/name` from a Hugging Face cache without the network: a fake `HF_HOME` holding
//! stories260K under `models--fission-test--stories` must serve it, and a repo missing from the
//! cache must fail with advice to pass a local path.
//!
//! `HF_HOME`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` are process-wide, so this binary holds its own
//! tests only and each takes `ENV_LOCK` before touching them.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::Mutex;

use common::{engine, greedy, references, shared_model};
use engine::engine::EngineConfig;
use engine::loader::ModelSource;
use engine::model::LoadedModel;

static ENV_LOCK: Mutex<()> = Mutex::new(());

const REPO: &str = "fission-test/stories";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Lays out `HF_HOME/hub/models--fission-test--stories` as huggingface_hub does: files in
/// `blobs/`, `snapshots/<commit>/` linking to them, and `refs/main` naming the commit.
fn fake_hf_home() -> tempfile::TempDir {
    let home = tempfile::tempdir().expect("tempdir");
    let repo = home.path().join("hub/models--fission-test--stories");
    let snapshot = repo.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(repo.join("blobs")).expect("blobs dir");
    std::fs::create_dir_all(repo.join("refs")).expect("refs dir");
    std::fs::create_dir_all(&snapshot).expect("snapshot dir");
    // huggingface_hub writes the bare hash, with no newline.
    std::fs::write(repo.join("refs/main"), COMMIT).expect("refs/main");
    let src = shared_model("stories260K");
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let blob = repo.join("blobs").join(format!("blob-{name}"));
        std::fs::copy(src.join(name), &blob).expect("copy into blobs");
        link(&blob, &snapshot.join(name));
    }
    home
}

#[cfg(unix)]
fn link(blob: &Path, at: &Path) {
    std::os::unix::fs::symlink(blob, at).expect("symlink into snapshot");
}

#[cfg(not(unix))]
fn link(blob: &Path, at: &Path) {
    std::fs::copy(blob, at).expect("copy into snapshot");
}

/// Points the hub at `home` for the duration of `f`. Offline or not, any download attempt goes
/// to a closed local port, so a test that reaches for the network fails instead of leaving the
/// machine.
fn with_hub_env<R>(home: &Path, offline: bool, f: impl FnOnce() -> R) -> R {
    let _guard = ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    std::env::set_var("HF_HOME", home);
    std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9");
    if offline {
        std::env::set_var("HF_HUB_OFFLINE", "1");
    } else {
        std::env::remove_var("HF_HUB_OFFLINE");
    }
    let out = f();
    for var in ["HF_HOME", "HF_ENDPOINT", "HF_HUB_OFFLINE"] {
        std::env::remove_var(var);
    }
    out
}

fn load(spec: &str) -> Result<LoadedModel, String> {
    LoadedModel::load(&ModelSource::parse(spec), None, &candle_core::Device::Cpu)
        .map_err(|e| e.to_string())
}

/// The cached model generates exactly what the local stories260K does (transformers' greedy
/// reference).
fn assert_generates_reference(model: &LoadedModel) {
    let r = &references()[0];
    let enc = model
        .tokenizer
        .encode(r.prompt.as_str(), true)
        .expect("encodes");
    assert_eq!(enc.get_ids(), r.input_ids.as_slice(), "cached tokenizer");
    let mut e = engine(
        model,
        EngineConfig {
            num_kv_blocks: Some(64),
            ..Default::default()
        },
    );
    let out = e
        .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
        .expect("generates");
    assert_eq!(out[0].output_ids, r.output_ids);
}

#[test]
fn offline_hub_cache_serves_the_model() {
    let home = fake_hf_home();
    let model = with_hub_env(home.path(), true, || load(REPO)).expect("loads from the cache");
    assert_eq!(model.model_id, REPO);
    assert!(
        model.files.weights[0].starts_with(home.path()),
        "weights come from the cache: {}",
        model.files.weights[0].display()
    );
    assert_generates_reference(&model);
}

#[test]
fn a_commit_hash_revision_resolves_to_its_snapshot_offline() {
    let home = fake_hf_home();
    let model = with_hub_env(home.path(), true, || load(&format!("{REPO}@{COMMIT}")))
        .expect("a pinned commit loads from its snapshot");
    assert_generates_reference(&model);
}

#[test]
fn warm_cache_is_used_without_offline_mode() {
    let home = fake_hf_home();
    let model = with_hub_env(home.path(), false, || load(REPO))
        .expect("a fully cached repo loads without contacting the hub");
    assert_generates_reference(&model);
}

#[test]
fn repo_missing_from_the_cache_says_to_pass_a_path() {
    let home = fake_hf_home();
    for spec in ["fission-test/absent", "fission-test/stories@no-such-branch"] {
        let err = with_hub_env(home.path(), true, || load(spec))
            .err()
            .unwrap_or_else(|| panic!("{spec} is not cached and must not load"));
        assert!(err.contains("--model PATH"), "{spec}: {err}");
        let repo = spec.split('@').next().expect("split yields one part");
        assert!(err.contains(repo), "{spec}: {err}");
    }
}
