//! Streaming a chat completion whose output may be tool calls. Text that cannot start a call
//! streams as content at once; output that may be a call is held back until the end, then
//! sent as one `delta.tool_calls` chunk (every call complete, arguments included) and a
//! final chunk with `finish_reason: "tool_calls"`. A forced choice holds everything back.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};

use super::tools::{ParsedCall, ToolPlan};
use super::Usage;
use crate::request::GeneratedToken;
use crate::sequences::TokenItems;
use crate::sse::json_event;

/// Where the output stands.
enum Phase {
    /// Only whitespace so far, or a prefix of a call's opening.
    Undecided(String),
    /// May be a call: held back until the end.
    Held(String),
    /// Plain content: streamed as it comes.
    Content,
}

/// The chunks' fixed fields.
pub(crate) struct ChunkIds {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub system_fingerprint: String,
    pub include_usage: bool,
}

impl ChunkIds {
    /// A `chat.completion.chunk` with these choices, and the usage when given.
    fn envelope(&self, choices: Value, usage: Option<Usage>) -> Event {
        let mut chunk = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        });
        if let Some(usage) = usage {
            chunk["usage"] = json!(usage);
        }
        json_event(&chunk)
    }

    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Event {
        let choice =
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason});
        self.envelope(json!([choice]), None)
    }

    /// A content delta, with the role on the stream's first chunk.
    fn content(&self, role_sent: &mut bool, text: String, finish: Option<&str>) -> Event {
        let mut delta = json!({"content": text});
        if !std::mem::replace(role_sent, true) {
            delta["role"] = json!("assistant");
        }
        self.chunk(delta, finish)
    }

    fn usage(&self, usage: Usage) -> Event {
        self.envelope(json!([]), Some(usage))
    }
}

/// OpenAI's `tool_calls` entries, with ids unique to the request.
pub(crate) fn tool_calls_json(request_id: &str, calls: &[ParsedCall], with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, call)| {
                let mut entry = json!({
                    "id": format!("call_{}{i}", &request_id[..request_id.len().min(20)]),
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                });
                if with_index {
                    entry["index"] = json!(i);
                }
                entry
            })
            .collect(),
    )
}

/// Whether `text` (leading whitespace trimmed) may be the start of a call.
fn may_be_call(text: &str) -> bool {
    const OPENINGS: [&str; 2] = ["<tool_call>", "<|python_tag|>"];
    text.starts_with('{')
        || text.starts_with('[')
        || OPENINGS
            .iter()
            .any(|o| o.starts_with(text) || text.starts_with(o))
}

/// `tokens` are the one sequence's, `request_id` its id (the calls' ids are made from it).
pub(crate) fn tool_sse_response(
    request_id: String,
    tokens: TokenItems,
    prompt_tokens: usize,
    plan: ToolPlan,
    forced: bool,
    ids: ChunkIds,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut completion_tokens = 0;
    let mut phase = if forced {
        Phase::Held(String::new())
    } else {
        Phase::Undecided(String::new())
    };
    let mut role_sent = false;
    let events = tokens
        .map(move |item| {
            let token: GeneratedToken = match item {
                Ok(token) => token,
                Err(error) => return vec![error.to_openai_sse_event()],
            };
            completion_tokens += 1;
            let mut events = Vec::new();
            let last = token.finish_reason;
            let finish = last.map(|r| r.as_openai_str());
            let (mut held, undecided) = match std::mem::replace(&mut phase, Phase::Content) {
                Phase::Content => {
                    events.push(ids.content(&mut role_sent, token.text, finish));
                    return with_end(
                        events,
                        &ids,
                        last.is_some(),
                        prompt_tokens,
                        completion_tokens,
                    );
                }
                Phase::Undecided(held) => (held, true),
                Phase::Held(held) => (held, false),
            };
            held.push_str(&token.text);
            let trimmed = held.trim_start();
            if undecided && !trimmed.is_empty() && !may_be_call(trimmed) {
                // Plain text: what was held goes out now, and the rest as it comes.
                events.push(ids.content(&mut role_sent, held, finish));
            } else if let Some(reason) = last {
                match plan.parse(&held) {
                    Some((text, calls)) => {
                        let mut delta = json!({
                            "content": text,
                            "tool_calls": tool_calls_json(&request_id, &calls, true),
                        });
                        if !std::mem::replace(&mut role_sent, true) {
                            delta["role"] = json!("assistant");
                        }
                        events.push(ids.chunk(delta, None));
                        events.push(ids.chunk(json!({}), Some("tool_calls")));
                    }
                    None => {
                        events.push(ids.content(&mut role_sent, held, Some(reason.as_openai_str())))
                    }
                }
            } else {
                phase = if undecided {
                    Phase::Undecided(held)
                } else {
                    Phase::Held(held)
                };
            }
            with_end(
                events,
                &ids,
                last.is_some(),
                prompt_tokens,
                completion_tokens,
            )
        })
        .flat_map(|events| futures::stream::iter(events.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// After the last token: the usage chunk when asked for, then `[DONE]`.
fn with_end(
    mut events: Vec<Event>,
    ids: &ChunkIds,
    last: bool,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Vec<Event> {
    if last {
        if ids.include_usage {
            events.push(ids.usage(Usage::new(prompt_tokens, completion_tokens)));
        }
        events.push(Event::default().data("[DONE]"));
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openings_of_calls_are_held() {
        for text in [
            "<",
            "<tool",
            "<tool_call>",
            "<tool_call>\n{\"na",
            "{",
            "[{",
            "<|python",
        ] {
            assert!(may_be_call(text), "{text}");
        }
        for text in ["Hello", "<b>", "Sure, {"] {
            assert!(!may_be_call(text), "{text}");
        }
    }
}
