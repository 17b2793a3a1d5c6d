//! `--device` and `--path` through the real `fission` binary: a build without the `cuda`
//! feature asked for CUDA fails with NotCompiledWithCuda before it reads a model (the model
//! path given does not exist, so an error naming it would mean loading had begun), and
//! `--device cpu --path tensor` generates transformers' greedy ids, as the host path does.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

fn fission(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fission"))
        .args(args)
        .env_remove("FISSION_DEVICE")
        .env_remove("FISSION_PATH")
        .output()
        .expect("fission runs")
}

fn stories_dir() -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    root.join("models/stories260K")
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cpu_build_refuses_cuda_before_loading_the_model() {
    let missing = "./no/such/model";
    let cases: [&[&str]; 4] = [
        &[
            "generate", "--model", missing, "--prompt", "hi", "--device", "cuda",
        ],
        &["bench", "engine", "--model", missing, "--device", "cuda:1"],
        &["node", "prefill", "--model", missing, "--device", "cuda"],
        &["up", "--model", missing, "--device", "cuda:0"],
    ];
    for args in cases {
        let out = fission(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("NotCompiledWithCuda"), "{args:?}: {err}");
        assert!(
            !err.contains("no/such/model"),
            "{args:?} looked for the model: {err}"
        );
    }
    // The same commands on the CPU get as far as the model, which proves the check above is
    // the device's and not some earlier failure.
    let out = fission(&[
        "generate", "--model", missing, "--prompt", "hi", "--device", "cpu",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no/such/model"));
}

#[test]
fn a_bad_device_name_is_refused_by_the_flag_parser() {
    let out = fission(&[
        "generate", "--model", "m", "--prompt", "hi", "--device", "metal",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device") && err.contains("cuda:N"), "{err}");
}

/// Greedy ids on each path, against the references transformers wrote.
#[test]
fn the_tensor_path_on_the_cpu_generates_transformers_greedy_ids() {
    let dir = stories_dir();
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference_greedy.json")).expect("reference readable"),
    )
    .unwrap();
    let dir = dir.to_str().unwrap();
    for r in refs["references"].as_array().unwrap().iter().take(2) {
        let prompt = r["prompt"].as_str().unwrap();
        for path in ["tensor", "host"] {
            let out = fission(&[
                "generate",
                "--model",
                dir,
                "--prompt",
                prompt,
                "--max-new-tokens",
                "32",
                "--ignore-eos",
                "--json",
                "--device",
                "cpu",
                "--path",
                path,
            ]);
            assert!(
                out.status.success(),
                "--path {path}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(got["input_ids"], r["input_ids"], "--path {path}");
            assert_eq!(got["output_ids"], r["output_ids"], "--path {path}");
        }
    }
}
