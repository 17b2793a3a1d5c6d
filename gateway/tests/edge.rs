//! The HTTP edge on a real socket: API keys and their failure counts, and bodies over the
//! limit answered with a JSON 413 rather than a reset connection.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{config, TestServer};
use gateway::auth::{AuthConfig, KeyStore};
use gateway::fake::FakeScript;
use serde_json::{json, Value};

const KEY: &str = "sk-edge-test";

async fn keyed_server(public_metrics: bool) -> TestServer {
    let mut config = config();
    config.auth = AuthConfig {
        keys: KeyStore::load(vec![KEY.parse().unwrap()], None).unwrap(),
        public_health: false,
        public_metrics,
    };
    TestServer::start(config, FakeScript::default()).await
}

/// The failure count for `reason` in the gateway's exposition.
async fn auth_failures(server: &TestServer, reason: &str) -> f64 {
    let text = server.get("/metrics").await.text().await.unwrap();
    let series = format!("fission_gateway_auth_failures_total{{reason=\"{reason}\"}}");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0.0, |value| value.trim().parse().unwrap())
}

#[tokio::test]
async fn auth_failures_are_counted_by_reason() {
    let server = keyed_server(true).await;
    // The recorder is the process's: other tests here may count too, so compare deltas.
    let (missing, invalid) = (
        auth_failures(&server, "missing").await,
        auth_failures(&server, "invalid").await,
    );
    for _ in 0..3 {
        assert_eq!(server.get("/info").await.status(), 401);
    }
    let response = server
        .client
        .get(server.url("/v1/models"))
        .bearer_auth("sk-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "invalid_api_key");
    let response = server
        .client
        .get(server.url("/info"))
        .header("x-api-key", KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(auth_failures(&server, "missing").await - missing, 3.0);
    assert_eq!(auth_failures(&server, "invalid").await - invalid, 1.0);
    let exposition = server.get("/metrics").await.text().await.unwrap();
    assert!(
        !exposition.contains(KEY) && !exposition.contains("sk-wrong"),
        "no key in the metrics"
    );
    server.stop().await;
}

/// Posts `body` the way Python's `http.client` does: every byte written before the response is
/// read. A server that answered without reading the body and closed would reset the connection
/// under the writes; returns the status line's code and the JSON body.
fn post_whole(
    addr: std::net::SocketAddr,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, Value)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    stream.write_all(body)?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_default();
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/json"),
        "{head}"
    );
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// The 413's body names the limit, in the shape of the path's API.
fn assert_413(status: u16, body: &Value, openai: bool) {
    assert_eq!(status, 413, "{body}");
    let message = if openai {
        assert_eq!(body["error"]["type"], "payload_too_large", "{body}");
        &body["error"]["message"]
    } else {
        assert_eq!(body["error_type"], "payload_too_large", "{body}");
        &body["error"]
    };
    let message = message.as_str().unwrap();
    assert!(message.contains("65536"), "names the limit: {message}");
}

#[tokio::test]
async fn bodies_over_the_limit_get_a_json_413_declared_or_chunked() {
    let mut config = config();
    config.max_body_bytes = 64 << 10;
    let server = TestServer::start(config, FakeScript::default()).await;
    // Far past the limit and the sockets' buffers: left unread, it would reset the connection.
    let prompt = "once upon a time ".repeat((24 << 20) / 17);
    for (path, field, openai) in [
        ("/generate", "inputs", false),
        ("/v1/completions", "prompt", true),
    ] {
        let body = json!({field: &prompt}).to_string();
        for _ in 0..2 {
            let (addr, whole) = (server.addr, body.clone());
            let (status, json) =
                tokio::task::spawn_blocking(move || post_whole(addr, path, whole.as_bytes()))
                    .await
                    .unwrap()
                    .expect("a 413, not a reset connection");
            assert_413(status, &json, openai);
        }
        let chunks: Vec<reqwest::Result<Vec<u8>>> = body
            .as_bytes()
            .chunks(256 << 10)
            .map(|c| Ok(c.to_vec()))
            .collect();
        let chunked = server
            .client
            .post(server.url(path))
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
            .send()
            .await
            .expect("a 413, not a reset connection");
        assert_eq!(chunked.headers()["content-type"], "application/json");
        let status = chunked.status().as_u16();
        assert_413(status, &chunked.json().await.unwrap(), openai);
    }
    // Under the limit, both ways still work.
    let small = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}).to_string();
    let chunks = [Ok::<_, std::io::Error>(small.clone())];
    let response = server
        .client
        .post(server.url("/generate"))
        .body(reqwest::Body::wrap_stream(futures::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let response = server.client.post(server.url("/generate")).body(small);
    assert_eq!(response.send().await.unwrap().status(), 200);
    server.stop().await;
}
