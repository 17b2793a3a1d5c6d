//! The README's commands, run verbatim with no network:
//! - the main command and the "Using the cluster" examples: `./deploy/run.sh` with no `MODEL`
//!   serves the embedded stories260K, and every example command succeeds against it;
//! - "The `fission` command": generate, make a random model and benchmark the engine on it;
//! - "API keys": `fission up --api-key "$KEY"`, then the `curl` with the key (and without it,
//!   a 401).
//!
//! Every command of those sections is run, or named in [`NOT_RUN`] with the reason. Only `cargo`
//! is stood in for (the test's own build already made `target/release/fission`, and a build
//! inside `cargo test` would wait on its lock), through a `HOME` whose `.cargo/bin` holds a
//! no-op: that also gives the embedded model a fresh cache. `fission` and `target/release/fission`
//! are the binary this test was built with.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use testkit::fission::{free_port, http_get, signal, wait_exit, KillOnDrop};
use testkit::wait::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// The README's commands this test does not run, with why; each must still be in the README.
const NOT_RUN: &[(&str, &str)] = &[(
    "fission gateway ... --api-key-file /etc/fission/api-keys --public-health",
    "`...` stands for the gateway's other flags (its etcd, TLS credentials and model) and the \
     key file is a deployment's path; `fission up --api-key` above runs the same key check, and \
     gateway/tests/key_reload.rs and deploy/tests/api_keys_e2e.rs cover key files and \
     `--public-health`",
)];

/// One README test at a time: each wants the README's port 8080.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The README's port when it is free; another only when something else holds it.
fn readme_port() -> u16 {
    match TcpListener::bind("127.0.0.1:8080") {
        Ok(_) => 8080,
        Err(_) => free_port(),
    }
}

/// A home and a working directory for the README's commands: `$HOME/.cargo/bin` holds the
/// no-op `cargo` and `fission`, and `target/release/fission` in `work` is this test's binary.
struct Sandbox {
    home: tempfile::TempDir,
    work: tempfile::TempDir,
}

impl Sandbox {
    fn new() -> Self {
        let home = tempfile::tempdir().unwrap();
        let bin = home.path().join(".cargo/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("cargo"), "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(bin.join("cargo"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        std::os::unix::fs::symlink(FISSION, bin.join("fission")).unwrap();
        let work = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(work.path().join("target/release")).unwrap();
        std::os::unix::fs::symlink(FISSION, work.path().join("target/release/fission")).unwrap();
        Sandbox { home, work }
    }

    /// `bash -c command` in the work directory, offline, with `env` set.
    fn command(&self, command: &str, env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.args(["-c", command])
            .current_dir(self.work.path())
            .env("HOME", self.home.path())
            .env(
                "PATH",
                format!(
                    "{}:{}",
                    self.home.path().join(".cargo/bin").display(),
                    std::env::var("PATH").unwrap()
                ),
            )
            .env_remove("MODEL")
            .env_remove("FISSION_MODEL")
            .env_remove("FISSION_API_KEY")
            .env_remove("XDG_CACHE_HOME")
            .env_remove("HF_HOME")
            .env("HF_HUB_OFFLINE", "1")
            .envs(env.iter().copied());
        cmd
    }

    /// Runs `command` to its end (at most `timeout_s`); its stdout, after checking it exited 0.
    fn run(&self, command: &str, env: &[(&str, &str)], timeout_s: u32) -> String {
        let wrapped = format!("timeout {timeout_s} bash -c {}", shell_quote(command));
        let out = self.command(&wrapped, env).output().unwrap();
        assert!(
            out.status.success(),
            "{command}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The commands of `heading`'s section less those in [`NOT_RUN`], which must be there.
fn commands_to_run(readme: &str, heading: &str) -> Vec<String> {
    commands_in_section(readme, heading)
        .into_iter()
        .filter(|c| !NOT_RUN.iter().any(|(skipped, _)| c.starts_with(skipped)))
        .collect()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The indented shell lines of the README section that starts with `heading`, with `\`
/// continuations joined: one entry per command.
fn commands_in_section(readme: &str, heading: &str) -> Vec<String> {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("the README has no {heading:?} section"));
    let body = &readme[start + heading.len()..];
    let end = body.find("\n#").unwrap_or(body.len());
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in body[..end].lines() {
        let Some(code) = line.strip_prefix("    ") else {
            continue;
        };
        match code.trim_end().strip_suffix('\\') {
            Some(head) => current.push_str(head),
            None => {
                current.push_str(code);
                commands.push(std::mem::take(&mut current));
            }
        }
    }
    commands
}

/// What one example printed is a success: JSON without an `error`, or an SSE stream whose
/// events all parse and whose last event ends it.
fn assert_succeeded(command: &str, stdout: &str) {
    let text = stdout.trim();
    assert!(!text.is_empty(), "{command} printed nothing");
    if text.starts_with("data:") {
        let events: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .collect();
        assert!(events.len() > 1, "{command}: {text}");
        let last = *events.last().unwrap();
        let finished = last == "[DONE]"
            || serde_json::from_str::<Value>(last).is_ok_and(|v| {
                !v["details"]["finish_reason"].is_null() || !v["generated_text"].is_null()
            });
        assert!(finished, "{command}: the stream did not end: {last}");
        for event in events.iter().filter(|e| **e != "[DONE]") {
            let v: Value = serde_json::from_str(event)
                .unwrap_or_else(|e| panic!("{command}: event {event:?}: {e}"));
            assert!(v.get("error").is_none(), "{command}: {v}");
        }
    } else {
        let v: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{command}: not JSON ({e}): {text}"));
        assert!(v.get("error").is_none(), "{command}: {v}");
    }
}

#[test]
fn the_readme_main_command_serves_the_embedded_model_and_its_examples_run_verbatim() {
    let _serial = serial();
    let root = repo_root();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    assert!(
        readme.contains("\n    ./deploy/run.sh\n"),
        "the README's main command moved"
    );
    let examples = commands_in_section(&readme, "## Using the cluster");
    assert!(examples.len() >= 4, "{examples:?}");

    let home = tempfile::tempdir().unwrap();
    let shim = home.path().join(".cargo/bin");
    std::fs::create_dir_all(&shim).unwrap();
    std::fs::write(shim.join("cargo"), "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::set_permissions(shim.join("cargo"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let port = readme_port();
    let log = home.path().join("run.log");
    let mut cmd = Command::new("bash");
    cmd.arg("deploy/run.sh")
        .current_dir(&root)
        .env("HOME", home.path())
        .env(
            "PATH",
            format!("{}:{}", shim.display(), std::env::var("PATH").unwrap()),
        )
        .env_remove("MODEL")
        .env_remove("FISSION_MODEL")
        .env_remove("FISSION_API_KEY")
        .env_remove("XDG_CACHE_HOME")
        .env_remove("HF_HOME")
        // The hub must not be needed.
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    if port != 8080 {
        cmd.env("PORT", port.to_string());
    }
    let mut run = KillOnDrop(cmd.spawn().unwrap());
    let mut lines = BufReader::new(run.0.stdout.take().unwrap()).lines();
    let up = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("Fission is up: "));
    assert!(
        up.is_some(),
        "run.sh did not come up:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    std::thread::spawn(move || lines.for_each(drop));
    let base = format!("http://127.0.0.1:{port}");
    wait_until(
        "both nodes ready at the gateway",
        Duration::from_secs(60),
        || {
            http_get(&format!("{base}/info"))
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .and_then(|v| {
                    v["backend"]["nodes"]
                        .as_array()
                        .map(|a| a.iter().filter(|n| n["ready"] == true).count())
                })
                .is_some_and(|ready| ready >= 2)
        },
    );

    // The embedded model, from the fresh cache, with its stand-in template declared.
    let info: Value = serde_json::from_str(&http_get(&format!("{base}/info")).unwrap()).unwrap();
    assert_eq!(info["model_id"], "stories260K", "{info}");
    assert!(
        info["chat_template_stand_in"]
            .as_str()
            .is_some_and(|s| s.contains("stand-in") || s.contains("stories")),
        "{info}"
    );
    let cached = std::fs::read_dir(home.path().join(".cache/fission/models"))
        .unwrap()
        .map(|e| e.unwrap().path().join("stories260K/model.safetensors"))
        .filter(|p| p.exists())
        .count();
    assert_eq!(cached, 1, "the embedded model was not written to the cache");

    for example in &examples {
        let command = example.replace("localhost:8080", &format!("localhost:{port}"));
        let out = Command::new("timeout")
            .args(["60", "bash", "-c", &command])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{command}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert_succeeded(&command, &String::from_utf8_lossy(&out.stdout));
    }

    // Ctrl-C's path: every process stops and run.sh (exec'd into `fission up`) exits 0.
    signal(&run.0, libc::SIGTERM);
    let status = wait_exit(&mut run.0, Duration::from_secs(60));
    assert!(status.success(), "{status}");
}

#[test]
fn the_readme_fission_command_section_runs_verbatim() {
    let _serial = serial();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let commands = commands_to_run(&readme, "## The `fission` command");
    let expected = [
        "cargo build",
        "target/release/fission generate",
        "target/release/fission make-random-model",
        "target/release/fission bench engine",
    ];
    assert_eq!(commands.len(), expected.len(), "{commands:?}");
    let sandbox = Sandbox::new();
    for (command, kind) in commands.iter().zip(expected) {
        assert!(command.starts_with(kind), "{command:?} is not {kind:?}");
        // The benchmark's default sweep takes minutes on a few cores.
        let stdout = sandbox.run(command, &[], 900);
        match kind {
            "target/release/fission generate" => {
                let v: Value = serde_json::from_str(stdout.trim())
                    .unwrap_or_else(|e| panic!("{command}: not JSON ({e}): {stdout}"));
                assert!(
                    v["text"].as_str().is_some_and(|t| !t.is_empty()),
                    "{command}: {v}"
                );
                assert!(
                    v["output_ids"]
                        .as_array()
                        .is_some_and(|ids| !ids.is_empty()),
                    "{v}"
                );
            }
            "target/release/fission make-random-model" => {
                let dir = sandbox.work.path().join(".models/smollm2-135m-random");
                for file in ["config.json", "model.safetensors", "tokenizer.json"] {
                    assert!(dir.join(file).exists(), "{command}: no {file}");
                }
            }
            "target/release/fission bench engine" => {
                let v: Value = serde_json::from_str(stdout.trim())
                    .unwrap_or_else(|e| panic!("{command}: not JSON ({e}): {stdout}"));
                let rate = v["decode_single_tok_s"].as_f64();
                assert!(rate.is_some_and(|r| r > 0.0), "{command}: {v}");
            }
            _ => {}
        }
    }
}

#[test]
fn the_readme_api_key_section_runs_verbatim() {
    let _serial = serial();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    for (skipped, why) in NOT_RUN {
        assert!(
            readme.contains(skipped),
            "{skipped:?} left the README: drop it ({why})"
        );
    }
    let commands = commands_to_run(&readme, "### API keys");
    let [up, curl] = commands.as_slice() else {
        panic!("expected `fission up` and `curl`: {commands:?}");
    };
    assert!(up.starts_with("fission up --api-key \"$KEY\""), "{up}");
    assert!(
        curl.contains("$KEY") && curl.contains("127.0.0.1:8080"),
        "{curl}"
    );

    let sandbox = Sandbox::new();
    let key = "readme-test-key-4f0c2a";
    let port = readme_port();
    // `fission up` takes its port from `--port` alone: given before the line's comment.
    let up = match (port, up.find(" #")) {
        (8080, _) => up.clone(),
        (_, Some(comment)) => format!("{} --port {port}{}", &up[..comment], &up[comment..]),
        (_, None) => format!("{up} --port {port}"),
    };
    let log = sandbox.home.path().join("up.log");
    let mut cluster = sandbox.command(&format!("exec {up}"), &[("KEY", key)]);
    cluster
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut cluster = KillOnDrop(cluster.spawn().unwrap());
    let mut lines = BufReader::new(cluster.0.stdout.take().unwrap()).lines();
    let came_up = lines
        .by_ref()
        .map_while(Result::ok)
        .any(|l| l.starts_with("Fission is up: "));
    assert!(
        came_up,
        "{up} did not come up:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    std::thread::spawn(move || lines.for_each(drop));

    let curl = curl.replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"));
    let models: Value = serde_json::from_str(sandbox.run(&curl, &[("KEY", key)], 60).trim())
        .unwrap_or_else(|e| panic!("{curl}: not JSON: {e}"));
    assert_eq!(models["data"][0]["id"], "stories260K", "{models}");
    // The key is what let it in: without it, or with another, the same route is 401.
    for (key, code) in [("", "missing_api_key"), ("wrong-key", "invalid_api_key")] {
        let command = if key.is_empty() {
            format!("curl -s http://127.0.0.1:{port}/v1/models")
        } else {
            curl.clone()
        };
        let body: Value =
            serde_json::from_str(sandbox.run(&command, &[("KEY", key)], 60).trim()).unwrap();
        assert_eq!(body["error"]["code"], code, "{command}: {body}");
    }

    signal(&cluster.0, libc::SIGTERM);
    let status = wait_exit(&mut cluster.0, Duration::from_secs(60));
    assert!(status.success(), "{status}");
}

#[test]
fn readme_sections_split_into_commands() {
    let text = "## Using the cluster\n\nprose\n\n    curl -s a \\\n      -d '{}'\n    curl b\n\n## Next\n\n    not this\n";
    assert_eq!(
        commands_in_section(text, "## Using the cluster"),
        vec!["curl -s a   -d '{}'".to_string(), "curl b".to_string()]
    );
}
