//! OpenAI's streaming `/v1/completions` and `/v1/chat/completions`, as Fission, llama.cpp's
//! `llama-server` and vLLM speak them.
//!
//! Servers differ in what they stream, and the count must not depend on it: llama-server opens
//! a chat stream with a role-only delta and closes it with an empty delta carrying the
//! `finish_reason`; Fission sends the role on every chunk; `usage` comes only when asked
//! (`stream_options.include_usage`), and not from every server even then. So a chunk counts as
//! a token when it carries text (an empty text counts too, unless it only carries the
//! `finish_reason`), and a reported `usage.completion_tokens` replaces the count at the end.

use serde_json::{json, Value};

use super::{error_type, EventMeaning};
use crate::client::sse::SseEvent;
use crate::workload::RequestSpec;

/// The streaming request. `ignore_eos` (a vLLM extension that Fission and llama-server
/// accept, and others ignore) makes the output as long as `max_tokens` asks.
pub fn body(spec: &RequestSpec, model: Option<&str>, chat: bool) -> Value {
    let mut body = json!({
        "max_tokens": spec.output_len,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    if chat {
        let mut messages = Vec::new();
        if let Some(system) = &spec.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": spec.user}));
        body["messages"] = Value::Array(messages);
    } else {
        body["prompt"] = Value::String(spec.prompt.clone());
    }
    if let Some(model) = model {
        body["model"] = Value::String(model.to_string());
    }
    body
}

pub fn interpret(event: &SseEvent, chat: bool) -> Result<EventMeaning, serde_json::Error> {
    let data = event.data.trim();
    if data == "[DONE]" {
        return Ok(EventMeaning {
            finished: true,
            ..EventMeaning::default()
        });
    }
    let v: Value = serde_json::from_str(data)?;
    if event.event.as_deref() == Some("error") || v.get("error").is_some_and(|e| !e.is_null()) {
        return Ok(EventMeaning::error(error_type(&v)));
    }
    // vLLM's older error shape.
    if v.get("object").and_then(Value::as_str) == Some("error") {
        return Ok(EventMeaning::error(error_type(&v)));
    }
    let mut meaning = EventMeaning::default();
    for choice in v
        .get("choices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let text = if chat {
            let delta = choice.get("delta");
            delta
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .or_else(|| {
                    delta
                        .and_then(|d| d.get("reasoning_content"))
                        .and_then(Value::as_str)
                })
        } else {
            choice.get("text").and_then(Value::as_str)
        };
        let finishes = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        if let Some(text) = text {
            if !text.is_empty() || !finishes {
                meaning.tokens += 1;
            }
        }
        meaning.finished |= finishes;
    }
    if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
        let count = |k: &str| usage.get(k).and_then(Value::as_u64).map(|n| n as usize);
        meaning.completion_tokens = count("completion_tokens");
        meaning.prompt_tokens = count("prompt_tokens");
    }
    Ok(meaning)
}
