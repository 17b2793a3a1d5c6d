//! Each service has two entry points, its own binary and a `fission` subcommand (which
//! `fission up` uses): both must take exactly the same flags, compared on the real binaries'
//! `--help`, so a flag added to one entry point only fails here; and a node's must read
//! `--model` alike (`stories260K` is the embedded default model on both), run as processes.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::fission::{http_get, signal, wait_exit, KillOnDrop};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// A service binary built beside `fission` (`cargo build --workspace` builds them all).
fn sibling(name: &str) -> Option<PathBuf> {
    let path = Path::new(FISSION).with_file_name(name);
    if path.is_file() {
        return Some(path);
    }
    assert!(
        std::env::var_os("FISSION_REQUIRE_TEST_TOOLS").is_none(),
        "{} is missing: build the workspace (cargo build --workspace --release --all-targets)",
        path.display()
    );
    eprintln!(
        "\n*** SKIPPED: {} is not built; run `cargo build --workspace --release` first ***\n",
        path.display()
    );
    None
}

/// The long flags a `--help` lists, except the program's own `--help` and `--version`.
fn flags(program: &Path, args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(program)
        .args(args)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{program:?} {args:?} --help failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| {
            w.trim_end_matches([',', '.'])
                .split(['=', '[', '<'])
                .next()
                .unwrap()
                .to_string()
        })
        .filter(|f| f != "--help" && f != "--version")
        .collect()
}

#[test]
fn both_entry_points_of_each_service_take_the_same_flags() {
    let fission = Path::new(FISSION);
    for (binary, subcommand) in [
        ("fission-prefill", &["node", "prefill"][..]),
        ("fission-decode", &["node", "decode"][..]),
        ("fission-gateway", &["gateway"][..]),
    ] {
        let Some(own) = sibling(binary) else { return };
        let theirs = flags(fission, subcommand);
        let ours = flags(&own, &[]);
        assert!(
            ours.contains("--model") || ours.contains("--model-dir"),
            "{ours:?}"
        );
        assert_eq!(
            ours,
            theirs,
            "{binary} and `fission {}` take different flags",
            subcommand.join(" ")
        );
    }
    // `fission node start --role R` parses the role's own flags (after `--`, `--help` is
    // theirs, not `start`'s).
    for role in ["prefill", "decode"] {
        assert_eq!(
            flags(fission, &["node", "start", "--role", role, "--"]),
            flags(fission, &["node", role]),
            "fission node start --role {role}"
        );
    }
}

/// Starts `program args` as a node of `role` on free ports with `--model stories260K` and a
/// cache of its own, waits until it serves (its `/health` answers once the model is loaded),
/// and stops it. Returns the cache it wrote.
fn serves_the_embedded_model(program: &Path, args: &[&str], role: &str) -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .args([
            "--model",
            "stories260K",
            "--kv-transport",
            "tcp",
            "--insecure",
        ])
        .args([
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(
            (role == "decode")
                .then_some(["--kv-addr", "127.0.0.1:0"])
                .into_iter()
                .flatten(),
        )
        .env("XDG_CACHE_HOME", cache.path())
        .env_remove("FISSION_MODEL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut node = KillOnDrop(cmd.spawn().unwrap());
    // "{role} node grpc=ADDR metrics=http://ADDR/metrics", printed once the sockets are bound.
    let mut stdout = BufReader::new(node.0.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    // Drained to the end, so the node never writes into a closed pipe.
    std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let metrics = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("metrics="))
        .unwrap_or_else(|| panic!("{program:?} {args:?} printed {line:?}"));
    let health = metrics.replace("/metrics", "/health");
    testkit::wait_until(
        &format!("{program:?} {args:?} to load stories260K"),
        Duration::from_secs(60),
        || {
            let exited = node.0.try_wait().unwrap();
            assert!(exited.is_none(), "{program:?} {args:?} exited: {exited:?}");
            http_get(&health).is_some_and(|body| body.contains("\"ok\""))
        },
    );
    signal(&node.0, libc::SIGTERM);
    assert!(wait_exit(&mut node.0, Duration::from_secs(30)).success());
    cache
}

/// The model directory a node wrote under `cache` (`fission/models/<hash>/stories260K`).
fn written_model(cache: &Path) -> PathBuf {
    let root = cache.join("fission").join("models");
    let hashes: Vec<_> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(hashes.len(), 1, "{hashes:?}");
    hashes[0].join("stories260K")
}

#[test]
fn every_node_entry_point_serves_the_embedded_model_by_name() {
    let fission = PathBuf::from(FISSION);
    let (Some(prefill), Some(decode)) = (sibling("fission-prefill"), sibling("fission-decode"))
    else {
        return;
    };
    let mut written = Vec::new();
    for (program, args, role) in [
        (prefill, &[][..], "prefill"),
        (decode, &[][..], "decode"),
        (fission.clone(), &["node", "prefill"][..], "prefill"),
        (fission, &["node", "decode"][..], "decode"),
    ] {
        let cache = serves_the_embedded_model(&program, args, role);
        let dir = written_model(cache.path());
        assert!(dir.join("model.safetensors").is_file(), "{}", dir.display());
        written.push(dir.strip_prefix(cache.path()).unwrap().to_path_buf());
    }
    // One resolution: every entry point wrote the same files under the same name.
    assert!(written.windows(2).all(|w| w[0] == w[1]), "{written:?}");
}
