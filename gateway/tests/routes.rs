//! The routes around generation, metrics, and graceful shutdown, on a real socket.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{assert_error, config, tokenizer, TestServer, WAIT};
use gateway::fake::FakeScript;
use serde_json::{json, Value};

#[tokio::test]
async fn health_follows_the_backend() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    assert_eq!(server.get("/health").await.status(), 200);
    server.fake.set_ready(false);
    assert_error(server.get("/health").await, 503, "unavailable").await;
    server.stop().await;
}

#[tokio::test]
async fn info_and_models_describe_the_model() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let info: Value = server.get("/info").await.json().await.unwrap();
    assert_eq!(info["model_id"], "stories260K");
    assert_eq!(info["max_input_tokens"], 64);
    assert_eq!(info["max_total_tokens"], 128);
    assert_eq!(info["max_concurrent_requests"], 4);
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(info["backend"]["kind"], "fake");
    let models: Value = server.get("/v1/models").await.json().await.unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "stories260K");
    assert_eq!(models["data"][0]["object"], "model");
    server.stop().await;
}

#[tokio::test]
async fn tokenize_returns_tgi_tokens() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post("/tokenize", json!({"inputs": "Once upon a time"}))
        .await;
    assert_eq!(response.status(), 200);
    let tokens: Vec<Value> = response.json().await.unwrap();
    let expected = tokenizer().encode("Once upon a time", true).unwrap();
    let ids: Vec<u64> = tokens.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    let expected_ids: Vec<u64> = expected.get_ids().iter().map(|&id| id as u64).collect();
    assert_eq!(ids, expected_ids);
    assert_eq!(tokens[0]["id"], 1, "BOS first");
    for token in &tokens[1..] {
        let (start, stop) = (
            token["start"].as_u64().unwrap(),
            token["stop"].as_u64().unwrap(),
        );
        let text: String = "Once upon a time"
            .chars()
            .skip(start as usize)
            .take((stop - start) as usize)
            .collect();
        assert_eq!(token["text"], text);
    }
    let joined: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert_eq!(joined.replace(' ', ""), "Onceuponatime");
    server.stop().await;
}

#[tokio::test]
async fn metrics_expose_gateway_series() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 3}}),
        )
        .await;
    assert_eq!(response.status(), 200);
    server.post("/generate", json!({"inputs": ""})).await;
    let response = server.get("/metrics").await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    for name in [
        "fission_gateway_requests_total",
        "fission_gateway_errors_total",
        "fission_gateway_time_to_first_token_seconds_bucket",
        "fission_gateway_time_per_output_token_seconds_bucket",
        "fission_gateway_request_duration_seconds_bucket",
        "fission_gateway_generated_tokens_bucket",
        "fission_gateway_input_tokens_bucket",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    assert!(text.contains("error_type=\"validation\""), "{text}");
    assert!(text.contains("endpoint=\"generate\""), "{text}");
    server.stop().await;
}

#[tokio::test]
async fn shutdown_lets_in_flight_streams_finish() {
    let script = FakeScript {
        token_delay: Duration::from_millis(20),
        ..FakeScript::default()
    };
    let server = TestServer::start(config(), script).await;
    let mut reader = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 10}}),
        )
        .await;
    reader.next_json().await.unwrap();
    server.shutdown.cancel();
    let mut last = Value::Null;
    let mut count = 1;
    while let Some(event) = reader.next_json().await {
        last = event;
        count += 1;
    }
    assert_eq!(count, 10);
    assert_eq!(last["details"]["finish_reason"], "length");
    let addr = server.addr;
    tokio::time::timeout(WAIT, server.task)
        .await
        .expect("the gateway stops")
        .unwrap()
        .unwrap();
    assert!(
        reqwest::get(format!("http://{addr}/health")).await.is_err(),
        "no new connections after shutdown"
    );
}

#[tokio::test]
async fn shutdown_drops_streams_after_the_grace_period() {
    let mut config = config();
    config.shutdown_grace_ms = 200;
    let script = FakeScript {
        token_delay: Duration::from_millis(50),
        ..FakeScript::default()
    };
    let server = TestServer::start(config, script).await;
    let mut reader = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 100}}),
        )
        .await;
    reader.next_json().await.unwrap();
    server.shutdown.cancel();
    let mut last = Value::Null;
    while let Some(event) = reader.next_json().await {
        last = event;
    }
    assert_eq!(last["error_type"], "unavailable", "{last}");
    assert!(
        last["error"].as_str().unwrap().contains("shutting down"),
        "{last}"
    );
    tokio::time::timeout(WAIT, server.task)
        .await
        .expect("the gateway stops after the grace period")
        .unwrap()
        .unwrap();
    server
        .fake
        .wait_for(|c| c.cancelled == 1, WAIT)
        .await
        .expect("the dropped stream is cancelled upstream");
}
