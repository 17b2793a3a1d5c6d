//! Each service has two entry points, its own binary and a `fission` subcommand (which
//! `fission up` uses): both must take exactly the same flags. Compared on the real binaries'
//! `--help`, so a flag added to one entry point only fails here.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

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
