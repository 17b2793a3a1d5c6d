//! Replays every committed fuzz input as an ordinary test, on stable and without libFuzzer:
//! the minimised corpus of each target (`fuzz/corpus/TARGET/`) and the inputs that once broke
//! it (`fuzz/regressions/TARGET/`). A panic on any file fails the target's test, which names
//! the files.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use fuzz_harness::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The files of `fuzz/corpus/TARGET` and `fuzz/regressions/TARGET`, sorted.
fn inputs(target: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["corpus", "regressions"] {
        let dir = fuzz_dir().join(dir).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry
                .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
                .path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn replay(target: &str) {
    let run = TARGETS
        .iter()
        .find_map(|(name, run)| (*name == target).then_some(*run))
        .unwrap_or_else(|| panic!("no fuzz target named {target}"));
    let files = inputs(target);
    assert!(
        !files.is_empty(),
        "no committed inputs for {target} under {}",
        fuzz_dir().display()
    );
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let data =
                std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            catch_unwind(AssertUnwindSafe(|| run(&data))).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{target}: {} of {} inputs panicked (messages above):\n{}",
        failed.len(),
        files.len(),
        failed.join("\n")
    );
}

macro_rules! replay_tests {
    ($($target:ident),* $(,)?) => {
        $(
            #[test]
            fn $target() {
                replay(stringify!($target));
            }
        )*

        #[test]
        fn every_target_is_replayed() {
            let replayed = [$(stringify!($target)),*];
            let targets: Vec<&str> = TARGETS.iter().map(|(name, _)| *name).collect();
            assert_eq!(targets, replayed, "add the new target to replay_tests!");
        }
    };
}

replay_tests!(
    http_generate,
    http_completions,
    http_chat,
    chat_template,
    tokenizer,
    kv_frame,
    gguf,
);
