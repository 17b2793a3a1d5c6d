//! The call formats of Mistral and Phi-4-mini, and the code fence around a bare JSON call
//! (Gemma); Hermes blocks and bare JSON are in [`super::tools`]. Each parser takes the text
//! from its family's opening on and returns the calls in order up to the first that is
//! incomplete or malformed, and whether nothing was dropped (see `ToolPlan::calls`).

use serde_json::Value;

use super::family::{MISTRAL_ARGS, MISTRAL_CALL_ID, MISTRAL_OPEN, PHI_CLOSE, PHI_OPEN};

/// `[TOOL_CALLS][{"name", "arguments"}, ...]` (Mistral Nemo, v3 tokenizers) or
/// `[TOOL_CALLS]name[ARGS]{...}` repeated, with an optional `[CALL_ID]id` before `[ARGS]`
/// (Mistral Small 3.2, Devstral, Magistral). A call counts once its arguments' object closed.
pub(crate) fn mistral_calls(text: &str, at_end: bool) -> (Vec<ParsedCall>, bool) {
    let body = text[MISTRAL_OPEN.len()..].trim_start();
    if body.starts_with('[') {
        return array_calls(body, at_end);
    }
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        let Some(call) = rest.strip_prefix(MISTRAL_OPEN) else {
            return (calls, rest.trim().is_empty());
        };
        let Some(args_at) = call.find(MISTRAL_ARGS) else {
            return (calls, false);
        };
        let name = call[..args_at]
            .split(MISTRAL_CALL_ID)
            .next()
            .unwrap_or_default()
            .trim();
        let args = &call[args_at + MISTRAL_ARGS.len()..];
        let mut values = serde_json::Deserializer::from_str(args).into_iter::<Value>();
        match values.next() {
            Some(Ok(arguments @ Value::Object(_))) if !name.is_empty() => {
                calls.push(ParsedCall {
                    name: name.to_string(),
                    arguments: arguments.to_string(),
                });
                rest = args[values.byte_offset()..].trim_start();
            }
            _ => return (calls, false),
        }
    }
}

/// `<|tool_call|>[{"name", "arguments"}, ...]<|/tool_call|>`, as Phi-4-mini writes calls; the
/// closing tag may be missing at the end, and the list's brackets too (the model sometimes
/// writes `{...}, {...}`). Text between and after blocks is not part of the answer.
pub(crate) fn phi_calls(text: &str, at_end: bool) -> (Vec<ParsedCall>, bool) {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        let Some(open) = rest.find(PHI_OPEN) else {
            return (calls, true);
        };
        let body = &rest[open + PHI_OPEN.len()..];
        let (inner, closed, after) = match body.find(PHI_CLOSE) {
            Some(close) => (&body[..close], true, &body[close + PHI_CLOSE.len()..]),
            None => (body, at_end, ""),
        };
        let inner = inner.trim();
        let listed;
        let list = if inner.starts_with('[') {
            inner
        } else {
            listed = if closed {
                format!("[{inner}]")
            } else {
                format!("[{inner}")
            };
            &listed
        };
        let (found, clean) = array_calls(list, closed);
        calls.extend(found);
        if !clean {
            return (calls, false);
        }
        rest = after;
    }
}

/// The body of a bare call inside a code fence (```` ```json ````, ```` ```tool_code ```` or
/// a plain one), without the fence; `text` unchanged when it opens none.
pub(crate) fn strip_fence(text: &str) -> &str {
    let Some(fenced) = text.strip_prefix("```") else {
        return text;
    };
    let body = match fenced.find('\n') {
        Some(eol)
            if fenced[..eol]
                .trim()
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_') =>
        {
            &fenced[eol + 1..]
        }
        _ => return text,
    };
    match body.trim_end().strip_suffix("```") {
        Some(inner) => inner.trim_end(),
        None => body,
    }
}

/// Whether `text` (leading whitespace trimmed) may be the start of a fenced call.
pub(crate) fn may_open_fence(text: &str) -> bool {
    "```".starts_with(text)
        || (text.starts_with("```") && !text.contains('\n'))
        || strip_fence(text) != text
}

/// Whether `text` opens with `marker`, or is the start of it.
pub(crate) fn opens_with(text: &str, marker: &str) -> bool {
    marker.starts_with(text) || text.starts_with(marker)
}

/// One parsed call, in OpenAI's shape apart from the id.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI sends them.
    pub arguments: String,
}

/// The calls of a JSON list, `text` starting at its `[`: each item once a `,` or the `]`
/// ends it (or the text ends, with `at_end`). Clean when the list closed with nothing after.
pub(super) fn array_calls(text: &str, at_end: bool) -> (Vec<ParsedCall>, bool) {
    let (items, closed_at) = array_items(text);
    let mut items: Vec<&str> = items;
    if closed_at.is_none() && at_end {
        let tail_start = items.last().map_or(1, |last| {
            last.as_ptr() as usize - text.as_ptr() as usize + last.len() + 1
        });
        if let Some(tail) = text.get(tail_start..).filter(|t| !t.trim().is_empty()) {
            items.push(tail);
        }
    }
    let mut calls = Vec::with_capacity(items.len());
    for item in items {
        match serde_json::from_str::<Value>(item.trim())
            .ok()
            .and_then(|v| call_from(&v))
        {
            Some(call) => calls.push(call),
            None => return (calls, false),
        }
    }
    let clean = !calls.is_empty() && closed_at.is_some_and(|end| text[end..].trim().is_empty());
    (calls, clean)
}

/// The items of the JSON list `text` opens, each ended by a `,` or the closing `]` at the
/// list's own depth (strings and nested values skipped), and where the list closed.
fn array_items(text: &str) -> (Vec<&str>, Option<usize>) {
    let mut items = Vec::new();
    let (mut depth, mut in_string, mut escaped, mut start) = (0usize, false, false, 1);
    for (i, b) in text.bytes().enumerate().skip(1) {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' if depth > 0 => depth -= 1,
            b',' if depth == 0 => {
                items.push(&text[start..i]);
                start = i + 1;
            }
            b']' => {
                if !text[start..i].trim().is_empty() {
                    items.push(&text[start..i]);
                }
                return (items, Some(i + 1));
            }
            _ => {}
        }
    }
    (items, None)
}

/// `{"name": ..., "arguments" | "parameters": {...} or a JSON text}`.
pub(super) fn call_from(value: &Value) -> Option<ParsedCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments").or_else(|| value.get("parameters")) {
        None => "{}".to_string(),
        Some(Value::String(text)) => {
            serde_json::from_str::<Value>(text).ok()?;
            text.clone()
        }
        Some(args @ Value::Object(_)) => args.to_string(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(found: &(Vec<ParsedCall>, bool)) -> Vec<(&str, &str)> {
        found
            .0
            .iter()
            .map(|c| (c.name.as_str(), c.arguments.as_str()))
            .collect()
    }

    #[test]
    fn mistral_list_and_named_forms() {
        let list = r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "abcDEF123"}, {"name": "get_time", "arguments": {}}]"#;
        let found = mistral_calls(list, true);
        assert_eq!(
            names(&found),
            [("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")]
        );
        assert!(found.1);
        let named = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"#;
        let found = mistral_calls(named, true);
        assert_eq!(
            names(&found),
            [("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")]
        );
        assert!(found.1);
        // Before the end, a call counts once its arguments closed.
        let cut = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Pa"#;
        assert!(mistral_calls(cut, false).0.is_empty());
        assert!(!mistral_calls(cut, true).1);
        assert_eq!(mistral_calls("[TOOL_CALLS]get_wea", false).0.len(), 0);
        // Text after the calls spoils them.
        assert!(!mistral_calls(r#"[TOOL_CALLS]f[ARGS]{} and more"#, true).1);
    }

    #[test]
    fn phi_blocks_with_and_without_brackets_and_closing_tag() {
        for text in [
            r#"<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]<|/tool_call|>"#,
            r#"<|tool_call|>{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}<|/tool_call|>"#,
            r#"<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]"#,
            r#"<|tool_call|>{"name": "f", "arguments": {"a": 1}}<|/tool_call|><|tool_call|>{"name": "g", "arguments": {}}<|/tool_call|>"#,
        ] {
            let found = phi_calls(text, true);
            assert_eq!(names(&found), [("f", r#"{"a":1}"#), ("g", "{}")], "{text}");
            assert!(found.1, "{text}");
        }
        // Before the end, an unclosed block's items count as they complete.
        let open = r#"<|tool_call|>[{"name": "f", "arguments": {}}, {"name": "g"#;
        assert_eq!(names(&phi_calls(open, false)), [("f", "{}")]);
    }

    #[test]
    fn fences_are_stripped() {
        assert_eq!(strip_fence("```json\n[1]\n```"), "[1]");
        assert_eq!(strip_fence("```tool_code\n{\"a\": 1}"), "{\"a\": 1}");
        assert_eq!(strip_fence("```\n{}\n```\n"), "{}");
        assert_eq!(strip_fence("``` not a fence"), "``` not a fence");
        assert_eq!(strip_fence("plain"), "plain");
        for text in ["`", "``", "```", "```tool_co", "```json\n{"] {
            assert!(may_open_fence(text), "{text}");
        }
        assert!(!may_open_fence("`x`"));
    }
}
