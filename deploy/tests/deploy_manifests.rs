//! The deployment files against the binaries they run (deploy/tests/deploy_manifests.py, in
//! the test venv with PyYAML and kubernetes-validate): the Dockerfiles' binaries exist, the
//! compose file and the rendered kustomize overlays give each Fission process only flags,
//! variables and ports it takes, the Kubernetes objects validate against their API schemas,
//! and the autoscalers query metrics the code exports. And the gateway takes the hub id the
//! compose file and the ConfigMap may give every process as its model.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::fission::{free_port, http_get, KillOnDrop};

#[test]
fn deployment_files_name_only_what_the_binaries_take() {
    let python = testkit::phoenix::venv_dir().join("bin/python");
    let has_tools = Command::new(&python)
        .args(["-c", "import yaml, kubernetes_validate"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_tools {
        assert!(
            !testkit::phoenix::tools_required(),
            "PyYAML and kubernetes-validate are required in {} (./deploy/install-test-tools.sh)",
            python.display()
        );
        eprintln!(
            "SKIPPED: no PyYAML and kubernetes-validate in {}",
            python.display()
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_fission")).parent().unwrap();
    let out = Command::new(&python)
        .arg(root.join("deploy/tests/deploy_manifests.py"))
        .arg(root)
        .arg(bin_dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // It checked something: both Dockerfiles, the compose services and the Kubernetes pools.
    let mut expected = vec![
        "Dockerfile:".to_string(),
        "Dockerfile.cuda:".into(),
        "compose decode".into(),
        "compose: host folders read-only".into(),
        "decode: fission node decode".into(),
        "ScaledObject decode trigger 1: Value".into(),
        "deploy/README.md: ".into(),
    ];
    if testkit::phoenix::tools_required() {
        // Required tools mean every overlay rendered, none fell back to the bare base.
        for overlay in std::fs::read_dir(root.join("deploy/k8s/overlays")).unwrap() {
            let name = overlay.unwrap().file_name();
            expected.push(format!("k8s/{}: ", name.to_string_lossy()));
        }
    }
    for what in &expected {
        assert!(
            stdout.contains(what.as_str()),
            "{what} was not checked:\n{stdout}"
        );
    }
}

/// compose's FISSION_MODEL and the ConfigMap's FISSION_MODEL_DIR may be a hub id: `fission
/// gateway` resolves it through the hub cache (here a warm one, offline) as the nodes do, and
/// serves the model under the repo id.
#[test]
fn the_gateway_takes_a_hub_id_like_the_nodes() {
    let hf_home = tempfile::tempdir().unwrap();
    let repo = hf_home.path().join("hub/models--fission-test--stories260K");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), commit).unwrap();
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("default-model/stories260K");
    for file in std::fs::read_dir(&model).unwrap() {
        let file = file.unwrap();
        std::fs::copy(file.path(), snapshot.join(file.file_name())).unwrap();
    }

    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let log = hf_home.path().join("gateway.log");
    let mut gateway = Command::new(env!("CARGO_BIN_EXE_fission"));
    gateway
        .args(["gateway", "--insecure", "--decode-nodes", "127.0.0.1:1"])
        .arg(format!("--addr=127.0.0.1:{port}"))
        // As compose and the ConfigMap give it.
        .env("FISSION_MODEL_DIR", "fission-test/stories260K")
        .env("HF_HOME", hf_home.path())
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("FISSION_MODEL_ID")
        .env_remove("FISSION_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut gateway = KillOnDrop(gateway.spawn().unwrap());
    let mut models = String::new();
    let up = testkit::wait::try_wait_until(
        "the gateway serving /v1/models",
        Duration::from_secs(30),
        || {
            if let Ok(Some(status)) = gateway.0.try_wait() {
                panic!(
                    "the gateway exited ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            models = http_get(&format!("{url}/v1/models")).unwrap_or_default();
            !models.is_empty()
        },
    );
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(up.is_ok(), "{up:?}\n{log_text}");
    let ids: serde_json::Value = serde_json::from_str(&models).unwrap();
    assert_eq!(
        ids["data"][0]["id"], "fission-test/stories260K",
        "{models}\n{log_text}"
    );
    println!("fission gateway --model-dir fission-test/stories260K: {models}");
}
