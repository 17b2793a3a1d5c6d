//! The deployment files against the binaries they run (deploy/tests/deploy_manifests.py, in
//! the test venv with PyYAML and kubernetes-validate): the Dockerfiles' binaries exist, the
//! compose file and the rendered kustomize overlays give each Fission process only flags,
//! variables and ports it takes, the Kubernetes objects validate against their API schemas,
//! and the autoscalers query metrics the code exports.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

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
    for what in [
        "Dockerfile:",
        "Dockerfile.cuda:",
        "compose decode",
        "decode: fission node decode",
    ] {
        assert!(stdout.contains(what), "{what} was not checked:\n{stdout}");
    }
}
