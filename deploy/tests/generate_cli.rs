//! `fission generate --json` reproduces transformers' greedy output for every reference prompt,
//! run as a real process.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn stories_dir() -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    root.join("models/stories260K")
}

/// Runs `cmd` and checks it exits 0, showing its stderr when it does not.
fn succeeds(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().expect("fission runs");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn generate_json_matches_reference_greedy() {
    let dir = stories_dir();
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference_greedy.json")).expect("reference readable"),
    )
    .expect("reference parses");
    for r in refs["references"].as_array().expect("references") {
        let out = succeeds(
            Command::new(env!("CARGO_BIN_EXE_fission"))
                .args(["generate", "--model"])
                .arg(&dir)
                .args(["--prompt", r["prompt"].as_str().expect("prompt")])
                .args(["--max-new-tokens", "32", "--ignore-eos", "--json"]),
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(got["input_ids"], r["input_ids"]);
        assert_eq!(got["output_ids"], r["output_ids"]);
        assert_eq!(got["finish_reason"], "length");
        let text = format!(
            "{}{}",
            r["prompt"].as_str().expect("prompt"),
            got["text"].as_str().expect("text")
        );
        assert_eq!(text, r["text"].as_str().expect("text"));
    }
}

#[test]
fn missing_model_is_a_clear_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_fission"))
        .args(["generate", "--model", "./no/such/dir", "--prompt", "hi"])
        .output()
        .expect("fission runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no/such/dir"), "{err}");
}

#[test]
fn random_model_generation_loads_and_decodes_every_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    succeeds(
        Command::new(env!("CARGO_BIN_EXE_fission"))
            .args(["make-random-model", "--shape", "tiny", "--out"])
            .arg(dir.path())
            .arg("--tokenizer-from")
            .arg(stories_dir()),
    );
    let out = succeeds(
        Command::new(env!("CARGO_BIN_EXE_fission"))
            .args(["generate", "--model"])
            .arg(dir.path())
            .args([
                "--prompt",
                "hello",
                "--max-new-tokens",
                "8",
                "--ignore-eos",
                "--json",
            ]),
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(got["output_ids"].as_array().expect("ids").len(), 8);
}

/// `make-random-model --format gguf` writes a file `fission generate` serves: the F32 file gives
/// the safetensors model's greedy ids (the same weights through llama.cpp's layout), and the
/// Q8_0 file loads and generates.
#[test]
fn random_model_as_gguf_serves_the_same_ids() {
    let dir = tempfile::tempdir().expect("tempdir");
    let make = |out: PathBuf, extra: &[&str]| {
        succeeds(
            Command::new(env!("CARGO_BIN_EXE_fission"))
                .args([
                    "make-random-model",
                    "--shape",
                    "tiny",
                    "--seed",
                    "7",
                    "--out",
                ])
                .arg(out)
                .args(extra),
        );
    };
    let generate = |model: &PathBuf| -> Vec<serde_json::Value> {
        let out = succeeds(
            Command::new(env!("CARGO_BIN_EXE_fission"))
                .args(["generate", "--model"])
                .arg(model)
                .args(["--prompt", "Once upon a time", "--max-new-tokens", "12"])
                .args(["--ignore-eos", "--json"]),
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        got["output_ids"].as_array().expect("ids").clone()
    };
    let st = dir.path().join("st");
    let f32 = dir.path().join("tiny-f32.gguf");
    let q8 = dir.path().join("tiny-q8_0.gguf");
    make(st.clone(), &[]);
    make(f32.clone(), &["--format", "gguf"]);
    make(q8.clone(), &["--format", "gguf", "--gguf-type", "q8_0"]);
    let want = generate(&st);
    assert_eq!(want.len(), 12);
    assert_eq!(
        generate(&f32),
        want,
        "F32 GGUF against the safetensors model"
    );
    assert_eq!(generate(&q8).len(), 12);
}
