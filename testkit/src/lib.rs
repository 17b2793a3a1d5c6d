//! Fixtures for tests and benchmarks: where the shared, read-only models live, and seeded
//! random-weight Llama-family models written in the exact layout transformers reads.
//!
//! This crate writes files and nothing else. It must not depend on `engine` (the engine's tests
//! use it to build the models they load, so it stays independent of the code under test) and
//! does no networking, except `phoenix`, which starts a local trace backend and reads it back.

pub mod phoenix;
pub mod promtool;
pub mod random_model;

use std::path::PathBuf;

/// The shared directory beside the repository: `FISSION_SHARED_DIR`, or `<workspace>/../shared`.
pub fn shared_dir() -> PathBuf {
    std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")))
}

/// `<shared>/models/NAME`. Whether it exists is the caller's to check.
pub fn shared_model(name: &str) -> PathBuf {
    shared_dir().join("models").join(name)
}
