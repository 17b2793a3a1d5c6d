//! Streaming a chat completion whose output may be tool calls, so that the stream says what
//! the non-streamed answer would. A thinking model's `<think>` block goes out first as
//! `reasoning_content` deltas ([`ThinkSplitter`]); what follows is the answer. Its text streams
//! as content at once, except a tail that may be the start of the family's call opening
//! (`<tool_call>`, `[TOOL_CALLS]`, `<|tool_call|>`, and the whitespace before it), which waits
//! for the next token. From the opening of a call on, or from the start when the output may
//! be a whole-output call (`{`, `[`, `<|python_tag|>`, a code fence) or the choice is forced,
//! the output is held back, and each call
//! goes out as a `delta.tool_calls` chunk (complete, arguments included) as soon as it is
//! complete; the end sends the rest and a final chunk with `finish_reason: "tool_calls"` (the
//! sequence's own reason when a call was cut off and dropped). Held output that holds no call
//! goes out as content at the end. A backend error ends the stream with an error event and no
//! `[DONE]`.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde_json::{json, Value};

use super::family::{call_id, Markers, ThinkStart, ToolSyntax};
use super::reasoning::{partial_marker_start, ThinkSplitter};
use super::stream::ChunkHeader;
use super::tool_syntax::ParsedCall;
use super::tool_syntax::{may_open_fence, opens_with};
use super::tools::ToolPlan;
use super::Usage;
use crate::error::GatewayError;
use crate::request::{FinishReason, GeneratedToken};
use crate::sequences::TokenItems;

/// Where the output stands.
enum Phase {
    /// Only whitespace so far, or the possible start of a whole-output call.
    Undecided(String),
    /// Plain content, streamed as it comes; the held-back tail (see [`held_tail_start`]).
    Content(String),
    /// May be a call: held back until the end.
    Held(String),
}

/// The chunks' fixed fields, and how the stream ends.
pub(crate) struct ChunkIds {
    pub header: ChunkHeader,
    pub include_usage: bool,
    /// Whether the stream ends with `data: [DONE]` (see `CommonFields::sends_done`).
    pub sends_done: bool,
}

impl ChunkIds {
    fn chunk(&self, delta: Value, finish_reason: Option<&str>) -> Event {
        let choice =
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason});
        self.header.event(vec![choice], None)
    }

    fn usage(&self, usage: Usage) -> Event {
        self.header.event(Vec::<Value>::new(), Some(usage))
    }
}

/// OpenAI's `tool_calls` entries for choice `choice`, with ids unique to the request (in the
/// form `syntax`'s templates take back); the first of `calls` is the answer's call number
/// `first_index`.
pub(crate) fn tool_calls_json(
    syntax: ToolSyntax,
    request_id: &str,
    choice: usize,
    calls: &[ParsedCall],
    first_index: usize,
    with_index: bool,
) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, call)| (first_index + i, call))
            .map(|(i, call)| {
                let mut entry = json!({
                    "id": call_id(syntax, request_id, choice, i),
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
fn may_be_call(text: &str, syntax: ToolSyntax) -> bool {
    text.starts_with('{')
        || text.starts_with('[')
        || opens_with(text, "<|python_tag|>")
        || syntax.opening().is_some_and(|o| opens_with(text, o))
        || may_open_fence(text)
}

/// Where the part of plain `text` that must wait for the next token starts: an end that may
/// be the start of `syntax`'s call opening, and the whitespace before it (which the
/// non-streamed answer drops from the content before a call).
fn held_tail_start(text: &str, syntax: ToolSyntax) -> usize {
    let opening = syntax
        .opening()
        .map_or(text.len(), |o| partial_marker_start(text, o));
    text[..opening].trim_end().len()
}

/// One tool-call stream's state.
struct ToolStream {
    request_id: String,
    plan: ToolPlan,
    ids: ChunkIds,
    prompt_tokens: usize,
    completion_tokens: usize,
    phase: Phase,
    role_sent: bool,
    /// Calls already sent, each as it completed.
    sent_calls: usize,
    /// A backend error was sent: the stream is over.
    failed: bool,
    /// Splits off a thinking model's reasoning; `None` for the others.
    think: Option<ThinkSplitter>,
    markers: Markers,
}

impl ToolStream {
    /// The events for one item from the backend; `None` once the stream has failed.
    fn on_item(&mut self, item: Result<GeneratedToken, GatewayError>) -> Option<Vec<Event>> {
        if self.failed {
            return None;
        }
        let token = match item {
            Ok(token) => token,
            Err(error) => {
                self.failed = true;
                return Some(vec![error.to_openai_sse_event()]);
            }
        };
        self.completion_tokens += 1;
        let last = token.finish_reason;
        let mut events = Vec::new();
        let output = self.markers.text(&token);
        let text = match &mut self.think {
            Some(think) => {
                let split = think.push(output, last.is_some());
                if !split.reasoning.is_empty() {
                    let delta = json!({"reasoning_content": split.reasoning});
                    events.push(self.delta(delta, None));
                }
                split.content
            }
            None => output.to_string(),
        };
        match std::mem::replace(&mut self.phase, Phase::Content(String::new())) {
            Phase::Undecided(mut held) => {
                held.push_str(&text);
                let trimmed = held.trim_start();
                if !trimmed.is_empty() && !may_be_call(trimmed, self.plan.syntax) {
                    self.on_content(held, last, &mut events);
                } else if let Some(reason) = last {
                    self.finish_held(held, reason, &mut events);
                } else {
                    self.send_complete_calls(&held, &mut events);
                    self.phase = Phase::Undecided(held);
                }
            }
            Phase::Content(mut tail) => {
                tail.push_str(&text);
                self.on_content(tail, last, &mut events);
            }
            Phase::Held(mut held) => {
                held.push_str(&text);
                match last {
                    Some(reason) => self.finish_held(held, reason, &mut events),
                    None => {
                        self.send_complete_calls(&held, &mut events);
                        self.phase = Phase::Held(held);
                    }
                }
            }
        }
        if last.is_some() {
            if self.ids.include_usage {
                let usage = Usage::new(self.prompt_tokens, self.completion_tokens);
                events.push(self.ids.usage(usage));
            }
            if self.ids.sends_done {
                events.push(Event::default().data("[DONE]"));
            }
        }
        Some(events)
    }

    /// Plain `text` (the held-back tail and what followed): sent, but for a call's opening
    /// (from which on everything is held) or a tail that may become one.
    fn on_content(&mut self, text: String, last: Option<FinishReason>, events: &mut Vec<Event>) {
        if let Some(open) = self.plan.syntax.opening().and_then(|o| text.find(o)) {
            let content_end = text[..open].trim_end().len();
            if content_end > 0 {
                events.push(self.content(text[..content_end].to_string(), None));
            }
            let held = text[content_end..].to_string();
            match last {
                Some(reason) => self.finish_held(held, reason, events),
                None => {
                    self.send_complete_calls(&held, events);
                    self.phase = Phase::Held(held);
                }
            }
            return;
        }
        if let Some(reason) = last {
            events.push(self.content(text, Some(reason.as_openai_str())));
            return;
        }
        let split = held_tail_start(&text, self.plan.syntax);
        if split > 0 {
            events.push(self.content(text[..split].to_string(), None));
        }
        self.phase = Phase::Content(text[split..].to_string());
    }

    /// Sends the calls of `held` (output held back so far) that completed since the last
    /// token: a client sees each call as soon as nothing can change it.
    fn send_complete_calls(&mut self, held: &str, events: &mut Vec<Event>) {
        if let Some(found) = self.plan.calls(held, false) {
            self.send_calls(found.content, &found.calls, events);
        }
    }

    /// One `tool_calls` delta with `calls` past those sent already (and `content`, the text
    /// before the first call, with the first).
    fn send_calls(
        &mut self,
        content: Option<String>,
        calls: &[ParsedCall],
        events: &mut Vec<Event>,
    ) {
        let Some(new) = calls.get(self.sent_calls..).filter(|c| !c.is_empty()) else {
            return;
        };
        let delta = json!({
            "content": if self.sent_calls == 0 { content } else { None },
            "tool_calls": tool_calls_json(self.plan.syntax, &self.request_id, 0, new, self.sent_calls, true),
        });
        self.sent_calls = calls.len();
        events.push(self.delta(delta, None));
    }

    /// The end of held output: its calls not sent yet, or the text as content when it holds
    /// none. A call cut off (by max_tokens) is dropped, and the finish reason is then the
    /// sequence's own rather than `tool_calls`.
    fn finish_held(&mut self, held: String, reason: FinishReason, events: &mut Vec<Event>) {
        match self.plan.calls(&held, true) {
            Some(found) => {
                self.send_calls(found.content, &found.calls, events);
                let finish = if found.clean {
                    "tool_calls"
                } else {
                    reason.as_openai_str()
                };
                events.push(self.ids.chunk(json!({}), Some(finish)));
            }
            // Calls found before the end stay found (see `ToolPlan::calls`): this is text.
            None if self.sent_calls == 0 => {
                events.push(self.content(held, Some(reason.as_openai_str())))
            }
            None => events.push(self.ids.chunk(json!({}), Some(reason.as_openai_str()))),
        }
    }

    /// A content delta, with the role on the stream's first chunk.
    fn content(&mut self, text: String, finish: Option<&str>) -> Event {
        self.delta(json!({"content": text}), finish)
    }

    /// A chunk with `delta`, and the role when it is the stream's first.
    fn delta(&mut self, mut delta: Value, finish: Option<&str>) -> Event {
        if !std::mem::replace(&mut self.role_sent, true) {
            delta["role"] = json!("assistant");
        }
        self.ids.chunk(delta, finish)
    }
}

/// How the model's output reads: its marker tokens, and where its reasoning starts (`None`
/// for a model that does not think aloud).
pub(crate) struct OutputReading {
    pub markers: Markers,
    pub think: Option<ThinkStart>,
}

/// `tokens` are the one sequence's, `request_id` its id (the calls' ids are made from it).
pub(crate) fn tool_sse_response(
    request_id: String,
    tokens: TokenItems,
    prompt_tokens: usize,
    plan: ToolPlan,
    forced: bool,
    ids: ChunkIds,
    reading: OutputReading,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut stream = ToolStream {
        request_id,
        plan,
        ids,
        prompt_tokens,
        completion_tokens: 0,
        phase: if forced {
            Phase::Held(String::new())
        } else {
            Phase::Undecided(String::new())
        },
        role_sent: false,
        sent_calls: 0,
        failed: false,
        think: reading.think.map(ThinkSplitter::new),
        markers: reading.markers,
    };
    let events = tokens
        .map(move |item| stream.on_item(item))
        .take_while(|events| futures::future::ready(events.is_some()))
        .flat_map(|events| futures::stream::iter(events.unwrap_or_default().into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
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
            assert!(may_be_call(text, ToolSyntax::Hermes), "{text}");
        }
        for text in ["Hello", "<b>", "Sure, {"] {
            assert!(!may_be_call(text, ToolSyntax::Hermes), "{text}");
        }
    }

    #[test]
    fn tails_that_may_open_a_call_wait() {
        for (text, tail) in [
            ("Hello", ""),
            ("Hello ", " "),
            ("Hello\n<", "\n<"),
            ("Hello <tool_cal", " <tool_cal"),
            ("a < b", ""),
            ("<tool_call", "<tool_call"),
            ("x<t", "<t"),
        ] {
            assert_eq!(
                &text[held_tail_start(text, ToolSyntax::Hermes)..],
                tail,
                "{text:?}"
            );
        }
    }
}
