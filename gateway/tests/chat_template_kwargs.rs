//! `chat_template_kwargs` on `/v1/chat/completions` (issue 32): the request's variables reach
//! the chat template, so Qwen3's real template (`tests/fixtures/templates/qwen3.jinja`) given
//! `{"enable_thinking": false}` ends the prompt with its empty `<think>` block, and the prompt
//! the backend receives is that text's tokens. Bad values are refused in OpenAI's error shape
//! before anything is generated.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{config, tokenizer, TestServer};
use gateway::fake::FakeScript;
use gateway::GatewayConfig;
use serde_json::{json, Value};

/// The prompt of one user turn "Hi", as Qwen3's template writes it without variables.
const TURN: &str = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
/// What the template adds after it when `enable_thinking is false`.
const NO_THINKING: &str = "<think>\n\n</think>\n\n";

fn qwen3_config() -> (tempfile::TempDir, GatewayConfig) {
    let dir = tempfile::tempdir().unwrap();
    let source = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/qwen3.jinja"),
    )
    .unwrap();
    let path = dir.path().join("tokenizer_config.json");
    let body = json!({"chat_template": source, "bos_token": null, "eos_token": "<|im_end|>"});
    std::fs::write(&path, body.to_string()).unwrap();
    let mut config = config();
    config.tokenizer_config_path = Some(path);
    config.max_input_tokens = 1000;
    config.max_total_tokens = 2000;
    (dir, config)
}

fn script() -> FakeScript {
    FakeScript {
        tokens: vec![(100, "Hello".into()), (2, String::new())],
        ..FakeScript::default()
    }
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

/// The ids of `text` as the gateway tokenizes a rendered chat (no special tokens added).
fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap().get_ids().to_vec()
}

/// Posts `extra`'s fields with one user turn; the prompt ids the backend was given.
async fn prompt_of(server: &TestServer, extra: Value) -> Vec<u32> {
    let response = server.post("/v1/chat/completions", request(extra)).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    server.fake.last_request().unwrap().prompt_ids
}

#[tokio::test]
async fn enable_thinking_false_reaches_qwen3s_template() {
    let (_dir, config) = qwen3_config();
    let server = TestServer::start(config, script()).await;
    let (open, closed) = (ids(TURN), ids(&format!("{TURN}{NO_THINKING}")));
    assert_ne!(open, closed);
    for (extra, expected) in [
        (json!({}), &open),
        (json!({"chat_template_kwargs": null}), &open),
        (json!({"chat_template_kwargs": {}}), &open),
        (
            json!({"chat_template_kwargs": {"enable_thinking": true}}),
            &open,
        ),
        (
            json!({"chat_template_kwargs": {"enable_thinking": false}}),
            &closed,
        ),
        // Qwen's top-level spelling, and the object winning over it.
        (json!({"enable_thinking": false}), &closed),
        (
            json!({"enable_thinking": false, "chat_template_kwargs": {"enable_thinking": true}}),
            &open,
        ),
        (
            json!({"enable_thinking": true, "chat_template_kwargs": {"enable_thinking": false}}),
            &closed,
        ),
    ] {
        assert_eq!(
            &prompt_of(&server, extra.clone()).await,
            expected,
            "{extra}"
        );
    }
    // With tools too: the variables and the tools both reach the template.
    let tools = json!([{"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object", "properties": {}}}}]);
    let with_tools = prompt_of(
        &server,
        json!({"tools": tools, "chat_template_kwargs": {"enable_thinking": false}}),
    )
    .await;
    // The tokenizer decodes this ASCII text back as it was.
    assert_eq!(
        tokenizer().decode(&closed, false).unwrap(),
        format!("{TURN}{NO_THINKING}")
    );
    let text = tokenizer().decode(&with_tools, false).unwrap();
    assert!(text.contains("<tools>\n{\"type\": \"function\""), "{text}");
    assert!(text.ends_with(&format!("{TURN}{NO_THINKING}")), "{text}");
    server.stop().await;
}

#[tokio::test]
async fn bad_chat_template_kwargs_are_refused_in_openais_shape() {
    let (_dir, config) = qwen3_config();
    let server = TestServer::start(config, script()).await;
    for kwargs in [
        json!(true),
        json!("enable_thinking=false"),
        json!([{"enable_thinking": false}]),
        json!({"messages": []}),
        json!({"tools": [], "enable_thinking": false}),
        json!({"add_generation_prompt": false}),
        json!({"bos_token": "<s>"}),
        json!({"raise_exception": "x"}),
    ] {
        let response = server
            .post(
                "/v1/chat/completions",
                request(json!({"chat_template_kwargs": kwargs})),
            )
            .await;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        assert!(status == 400 || status == 422, "{kwargs}: {status} {body}");
        let error = &body["error"];
        assert_eq!(error["param"], "chat_template_kwargs", "{kwargs}: {body}");
        assert!(error["message"].is_string(), "{kwargs}: {body}");
        assert!(error["type"].is_string(), "{kwargs}: {body}");
    }
    // A top-level alias of the wrong type is the body's error.
    let response = server
        .post(
            "/v1/chat/completions",
            request(json!({"enable_thinking": "no"})),
        )
        .await;
    assert!(response.status().is_client_error());
    // Nothing reached the backend.
    assert_eq!(server.fake.counts().started, 0);
    server.stop().await;
}
