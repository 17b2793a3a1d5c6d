//! The README's main command and its "Using the cluster" examples, run verbatim: `./deploy/run.sh`
//! with no `MODEL` serves the embedded stories260K with no network, and every example command
//! succeeds against it. Only `cargo` is stood in for (the test's own build already made
//! `target/release/fission`, and a build inside `cargo test` would wait on its lock), through a
//! `HOME` whose `.cargo/bin` holds a no-op: that also gives the embedded model a fresh cache.

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
    // The README's port when it is free; another only when something else holds it.
    let port = match TcpListener::bind("127.0.0.1:8080") {
        Ok(_) => 8080,
        Err(_) => free_port(),
    };
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
fn readme_sections_split_into_commands() {
    let text = "## Using the cluster\n\nprose\n\n    curl -s a \\\n      -d '{}'\n    curl b\n\n## Next\n\n    not this\n";
    assert_eq!(
        commands_in_section(text, "## Using the cluster"),
        vec!["curl -s a   -d '{}'".to_string(), "curl b".to_string()]
    );
}
