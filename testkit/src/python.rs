//! The test venv's Python (`./deploy/install-test-tools.sh` fills it): third-party clients
//! (openai, text-generation, huggingface_hub, jsonschema) that the end-to-end tests drive
//! against a real cluster, each script printing one JSON document.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The venv's Python when it can import every module in `modules`, or `None` after saying
/// why; a failure when `FISSION_REQUIRE_TEST_TOOLS` is set (CI must not skip silently).
pub fn venv_python_with(modules: &[&str]) -> Option<PathBuf> {
    let python = crate::phoenix::venv_dir().join("bin").join("python");
    let import = format!("import {}", modules.join(", "));
    let ok = Command::new(&python)
        .args(["-c", &import])
        .output()
        .is_ok_and(|out| out.status.success());
    if ok {
        return Some(python);
    }
    let message = format!(
        "`{import}` fails with {}: install them with ./deploy/install-test-tools.sh",
        python.display()
    );
    assert!(
        !crate::phoenix::tools_required(),
        "{message} (FISSION_REQUIRE_TEST_TOOLS is set)"
    );
    eprintln!("\n*** SKIPPED: {message} ***\n");
    None
}

/// What to run: a script's text, or a script file.
#[derive(Debug, Clone, Copy)]
pub enum Script<'a> {
    Inline(&'a str),
    File(&'a Path),
}

/// Runs `script` with `args` and parses its stdout as one JSON document. The clients'
/// environment variables (keys, base URLs, telemetry) are cleared so that only `args` point
/// them anywhere. Panics with the script's stderr when it fails.
pub fn run_json(python: &Path, script: Script<'_>, args: &[&str]) -> serde_json::Value {
    let mut command = Command::new(python);
    match script {
        Script::Inline(text) => command.arg("-c").arg(text),
        Script::File(path) => command.arg(path),
    };
    let out = command
        .args(args)
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HF_TOKEN")
        .env("HF_HUB_DISABLE_TELEMETRY", "1")
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "the client script failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "the script printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}
