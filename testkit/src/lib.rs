//! Fixtures for tests: where the shared, read-only models live, and what the services' tests
//! share (a span capture, `/metrics` reading, waiting on conditions, real clusters of real
//! processes). A dev-dependency only: no production code uses it.
//!
//! It must not depend on `engine` or on the services (the engine's tests use it to build the
//! models they load, so it stays independent of the code under test). Its networking is for
//! tests only: `phoenix` starts a local trace backend and reads it back, `metrics` and
//! `serving` talk to a service a test started on 127.0.0.1.

pub mod certs;
pub mod cluster_builder;
pub mod fission;
pub mod kv_gauges;
pub mod metrics;
pub mod netns;
pub mod netns_cluster;
pub mod phoenix;
pub mod promtool;
pub mod python;
pub mod references;
pub mod serving;
pub mod span_capture;
pub mod wait;

use std::path::PathBuf;

pub use wait::{wait_until, wait_until_async};

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
pub mod streams;
