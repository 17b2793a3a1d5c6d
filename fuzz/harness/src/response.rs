//! What every answer of the generation API must look like, whatever the request: a status the
//! input can explain, a content type, a JSON body (or SSE events of JSON) in the API's shape,
//! and, for an error, the documented error body with the `error_type` its status stands for.

use axum::http::header;
use gateway::ValidRequest;
use serde_json::Value;

use crate::gateway_fixture::{Exchange, TestGateway};

/// Statuses a request to the fake backend can earn by its content alone: success, a body that
/// is not JSON (or, on OpenAI's routes, a refused request), a `model` OpenAI's routes do not
/// serve, one over the size limit, and a refused request. 401 (keys are off), 405 (the targets
/// use real routes and POST), 429 (one request at a time), 5xx (the fake does not fail) would
/// each be a bug.
pub(crate) const CONTENT_STATUSES: &[u16] = &[200, 400, 404, 413, 422];

/// A checked answer's body.
pub(crate) enum Body {
    Json(Value),
    /// The `data` of each SSE event, in order.
    Events(Vec<String>),
}

/// Checks what holds for any answer of the generation route `path`, and returns its body.
pub(crate) fn check(path: &str, exchange: &Exchange, allowed: &[u16]) -> Body {
    let status = exchange.status.as_u16();
    assert!(
        allowed.contains(&status),
        "{path}: status {status} outside {allowed:?}; body: {}",
        exchange.body_text()
    );
    // Success and a started generation go together: an error must come before the backend.
    assert_eq!(
        exchange.generated.is_some(),
        status == 200,
        "{path}: status {status}, generation started: {}",
        exchange.generated.is_some()
    );
    let content_type = exchange
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("{path}: a {status} answer without a content type"));
    if content_type.starts_with("text/event-stream") {
        assert_eq!(status, 200, "{path}: an error answered as an event stream");
        return Body::Events(events(path, exchange));
    }
    assert_eq!(
        content_type, "application/json",
        "{path}: a {status} answer of type {content_type}"
    );
    let body: Value = serde_json::from_slice(&exchange.body).unwrap_or_else(|e| {
        panic!(
            "{path}: a {status} answer whose body is not JSON ({e}): {}",
            exchange.body_text()
        )
    });
    if status != 200 {
        check_error(path, status, &body);
    }
    Body::Json(body)
}

/// `{"error": "...", "error_type": "..."}` on TGI's routes, OpenAI's `{"error": {"message",
/// "type", "param", "code"}}` under `/v1/`, where a refused request is a 400 (not a 422) and an
/// unknown `model` a 404.
fn check_error(path: &str, status: u16, body: &Value) {
    let openai = path.starts_with("/v1/");
    let expected_types: &[&str] = match (openai, status) {
        (_, 413) => &["payload_too_large"],
        (false, 400) => &["bad_request"],
        (false, 422) => &["validation"],
        (true, 400) => &["bad_request", "validation"],
        (true, 404) => &["not_found"],
        (_, other) => panic!("{path}: no error_type is known for status {other}"),
    };
    let (message, error_type) = if openai {
        let error = &body["error"];
        (error["message"].as_str(), error["type"].as_str())
    } else {
        (body["error"].as_str(), body["error_type"].as_str())
    };
    let message = message.unwrap_or_else(|| panic!("{path}: error without a message: {body}"));
    assert!(!message.is_empty(), "{path}: an empty error message");
    assert!(
        error_type.is_some_and(|t| expected_types.contains(&t)),
        "{path}: status {status} with {body}"
    );
}

/// The `data` of each event. Every one is JSON, but OpenAI's final `[DONE]`.
fn events(path: &str, exchange: &Exchange) -> Vec<String> {
    let text = std::str::from_utf8(&exchange.body)
        .unwrap_or_else(|e| panic!("{path}: an event stream that is not UTF-8: {e}"));
    let events: Vec<String> = text
        .split("\n\n")
        .filter(|event| !event.trim().is_empty())
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|line| line.strip_prefix("data:"))
                .map(|data| data.strip_prefix(' ').unwrap_or(data))
                .collect();
            // A keep-alive comment has no data.
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect();
    assert!(!events.is_empty(), "{path}: a stream without events");
    for data in &events {
        if data != "[DONE]" {
            let value: Value = serde_json::from_str(data)
                .unwrap_or_else(|e| panic!("{path}: an event that is not JSON ({e}): {data}"));
            assert!(
                value.get("error").is_none(),
                "{path}: the fake backend does not fail, yet: {data}"
            );
        }
    }
    events
}

/// Checks a successful generation against the request the backend was given.
pub(crate) fn check_generation(
    path: &str,
    body: &Body,
    request: &ValidRequest,
    sequences: usize,
    gw: &TestGateway,
) {
    let prompt_tokens = request.prompt_ids.len();
    let max_new_tokens = request.stopping.max_new_tokens;
    match body {
        Body::Json(body) if path == "/generate" => {
            assert!(body["generated_text"].is_string(), "{path}: {body}");
            if let Some(generated) = body["details"]["generated_tokens"].as_u64() {
                assert!(generated as usize <= max_new_tokens, "{path}: {body}");
            }
        }
        Body::Json(body) => {
            let choice = &body["choices"][0];
            let text = if path == "/v1/chat/completions" {
                &choice["message"]["content"]
            } else {
                &choice["text"]
            };
            assert!(text.is_string(), "{path}: {body}");
            check_usage(
                path,
                &body["usage"],
                prompt_tokens,
                max_new_tokens,
                sequences,
                gw,
            );
        }
        Body::Events(events) if path == "/generate_stream" => {
            let last: Value = serde_json::from_str(events.last().expect("checked non-empty"))
                .expect("checked JSON");
            assert!(last["generated_text"].is_string(), "{path}: {last}");
            assert!(
                last["details"]["finish_reason"].is_string(),
                "{path}: {last}"
            );
            assert!(events.len() <= max_new_tokens, "{path}: {events:?}");
        }
        Body::Events(events) => {
            assert_eq!(
                events.last().map(String::as_str),
                Some("[DONE]"),
                "{path}: {events:?}"
            );
            let usage = events.iter().rev().find_map(|data| {
                let value: Value = serde_json::from_str(data).ok()?;
                value.get("usage").filter(|u| !u.is_null()).cloned()
            });
            if let Some(usage) = usage {
                check_usage(path, &usage, prompt_tokens, max_new_tokens, sequences, gw);
            }
        }
    }
}

/// With several sequences (`n`, `best_of`, prompt lists) the usage adds theirs up: `prompt`
/// and `max_new` are the last sequence's, each bound scales with their number.
fn check_usage(
    path: &str,
    usage: &Value,
    prompt: usize,
    max_new: usize,
    sequences: usize,
    gw: &TestGateway,
) {
    let count = |field: &str| {
        usage[field]
            .as_u64()
            .unwrap_or_else(|| panic!("{path}: usage without {field}: {usage}")) as usize
    };
    let (prompt_tokens, completion, total) = (
        count("prompt_tokens"),
        count("completion_tokens"),
        count("total_tokens"),
    );
    if sequences <= 1 {
        assert_eq!(prompt_tokens, prompt, "{path}: {usage}");
    }
    let sequences = sequences.max(1);
    assert!(completion <= max_new * sequences, "{path}: {usage}");
    assert_eq!(total, prompt_tokens + completion, "{path}: {usage}");
    assert!(
        total <= gw.config.max_total_tokens * sequences,
        "{path}: {usage}"
    );
}
