//! A gateway over the fake backend for an external API fuzzer (Schemathesis) to check
//! `/openapi.json` against what the server accepts. Ignored: run it by hand, it serves until
//! `FISSION_SERVE_SECS` pass.
//!
//!     FISSION_SERVE_ADDR=127.0.0.1:18080 cargo test --release -p gateway \
//!         --test schemathesis_target -- --ignored --nocapture
//!     schemathesis run http://127.0.0.1:18080/openapi.json --checks all

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{chat_tokenizer_config, config};
use gateway::fake::{FakeBackend, FakeScript};
use gateway::Backend;

#[tokio::test]
#[ignore = "serves for an external fuzzer; run by hand"]
async fn serve_for_schemathesis() {
    let addr = std::env::var("FISSION_SERVE_ADDR").unwrap_or_else(|_| "127.0.0.1:18080".into());
    let secs: u64 = std::env::var("FISSION_SERVE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let (_dir, template) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(template);
    let listener = tokio::net::TcpListener::bind(&addr).await.unwrap();
    let backend: std::sync::Arc<dyn Backend> =
        std::sync::Arc::new(FakeBackend::new(FakeScript::default()));
    let shutdown = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(gateway::run(config, listener, backend, shutdown.clone()));
    eprintln!("serving on {addr} for {secs} s");
    tokio::time::sleep(Duration::from_secs(secs)).await;
    shutdown.cancel();
    server.await.unwrap().unwrap();
}
