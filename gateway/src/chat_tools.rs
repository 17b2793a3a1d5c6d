//! How a request's tools reach a chat template, by what the template reads.
//!
//! Most tool-calling templates read a `tools` list, as transformers passes it (Qwen, Mistral,
//! Llama 3.1). Phi-4-mini's reads them from the system message instead, as a JSON text in the
//! message's `tools` field (its model card's format): the gateway puts them there, in a system
//! message of its own when the request has none. A template that never mentions tools (Gemma 2
//! and 3, which have no tool tokens at all) would drop them, so the gateway writes them into
//! the last user message, with what to answer (a bare JSON list of calls, which the bare-JSON
//! parser reads back), as TGI does for such models; an earlier turn's calls become that JSON
//! in the assistant's text, and tool results become user turns (Gemma's template refuses any
//! role but user and assistant, alternating).

use std::borrow::Cow;

use serde_json::{json, Value};

use crate::chat_template::{python_json, ChatMessage, ToolsInput};

/// Phi-4-mini's system message when the request has none (its model card's).
const PHI_SYSTEM: &str = "You are a helpful assistant with some tools.";

impl ToolsInput {
    /// The messages as the template should see them, and the `tools` for its context.
    pub(crate) fn prepare<'a>(
        self,
        messages: &'a [ChatMessage],
        tools: &'a [Value],
    ) -> (Cow<'a, [ChatMessage]>, Option<&'a [Value]>) {
        if tools.is_empty() {
            return (Cow::Borrowed(messages), None);
        }
        match self {
            ToolsInput::Context => (Cow::Borrowed(messages), Some(tools)),
            ToolsInput::SystemMessage => (Cow::Owned(in_system_message(messages, tools)), None),
            ToolsInput::Instructions => (Cow::Owned(as_instructions(messages, tools)), None),
        }
    }
}

/// The functions of `tools` (`{"type": "function", "function": {...}}` each), as a JSON list.
fn functions(tools: &[Value]) -> Value {
    Value::Array(
        tools
            .iter()
            .map(|t| t.get("function").unwrap_or(t).clone())
            .collect(),
    )
}

/// An assistant turn's calls as `[{"name", "arguments"}, ...]`.
fn calls_json(calls: &Value) -> String {
    let calls: Vec<Value> = calls
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let f = c.get("function").unwrap_or(c);
                    json!({"name": f.get("name"), "arguments": f.get("arguments")})
                })
                .collect()
        })
        .unwrap_or_default();
    python_json(&Value::Array(calls))
}

fn in_system_message(messages: &[ChatMessage], tools: &[Value]) -> Vec<ChatMessage> {
    let listing = python_json(&functions(tools));
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first.role == "system" => first.tools = Some(listing),
        _ => out.insert(
            0,
            ChatMessage {
                role: "system".into(),
                content: PHI_SYSTEM.into(),
                tools: Some(listing),
                ..ChatMessage::default()
            },
        ),
    }
    // The template writes an assistant turn's content alone: its calls go there, in the
    // model's own tags, or the next turn would not see them.
    for message in &mut out {
        if let (Some(calls), true) = (&message.tool_calls, message.content.is_empty()) {
            message.content = format!("<|tool_call|>{}<|/tool_call|>", calls_json(calls));
        }
    }
    out
}

fn as_instructions(messages: &[ChatMessage], tools: &[Value]) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    let mut after_tool = false;
    for message in messages {
        let mut message = message.clone();
        if message.role == "tool" {
            let result = format!("Tool result:\n{}", message.content);
            match out.last_mut() {
                Some(previous) if after_tool => {
                    previous.content.push_str("\n\n");
                    previous.content.push_str(&result);
                }
                _ => out.push(ChatMessage {
                    role: "user".into(),
                    content: result,
                    ..ChatMessage::default()
                }),
            }
            after_tool = true;
            continue;
        }
        after_tool = false;
        if let Some(calls) = message.tool_calls.take() {
            if !message.content.is_empty() {
                message.content.push('\n');
            }
            message.content.push_str(&calls_json(&calls));
        }
        out.push(message);
    }
    let listing: Vec<String> = tools.iter().map(python_json).collect();
    let instructions = format!(
        "You can call functions. To call one or more, answer with nothing but a JSON list of \
         the calls, each {{\"name\": <function name>, \"arguments\": <arguments object>}}; \
         otherwise answer as usual. The functions:\n{}",
        listing.join("\n")
    );
    if let Some(last_user) = out.iter_mut().rev().find(|m| m.role == "user") {
        last_user.content.push_str("\n\n");
        last_user.content.push_str(&instructions);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}),
        ]
    }

    #[test]
    fn inputs_are_read_from_the_template() {
        assert_eq!(
            ToolsInput::of_template("{% if tools %}"),
            ToolsInput::Context
        );
        assert_eq!(
            ToolsInput::of_template("{{ message['tools'] }}"),
            ToolsInput::SystemMessage
        );
        assert_eq!(ToolsInput::of_template("{{ x }}"), ToolsInput::Instructions);
    }

    #[test]
    fn phi_gets_a_system_message_with_the_functions() {
        let messages = [message("user", "Hi")];
        let tools = tools();
        let (out, context) = ToolsInput::SystemMessage.prepare(&messages, &tools);
        assert!(context.is_none());
        assert_eq!(out[0].role, "system");
        assert_eq!(
            out[0].tools.as_deref(),
            Some(r#"[{"name": "f", "parameters": {"type": "object"}}]"#)
        );
        assert_eq!(out[1], messages[0]);
    }

    #[test]
    fn instructions_fold_calls_and_results_into_alternating_turns() {
        let call = ChatMessage {
            role: "assistant".into(),
            tool_calls: Some(json!([{"id": "1", "type": "function",
                "function": {"name": "f", "arguments": {"a": 1}}}])),
            ..ChatMessage::default()
        };
        let messages = [
            message("user", "Go"),
            call,
            message("tool", "one"),
            message("tool", "two"),
        ];
        let tools = tools();
        let (out, context) = ToolsInput::Instructions.prepare(&messages, &tools);
        assert!(context.is_none());
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user"]);
        assert_eq!(out[1].content, r#"[{"name": "f", "arguments": {"a": 1}}]"#);
        assert!(out[2]
            .content
            .starts_with("Tool result:\none\n\nTool result:\ntwo\n\nYou can call functions."));
        assert!(out[2].content.ends_with(
            r#"{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}"#
        ));
        // Without tools nothing changes.
        let (same, none) = ToolsInput::Instructions.prepare(&messages, &[]);
        assert!(matches!(same, Cow::Borrowed(_)) && none.is_none());
    }
}
