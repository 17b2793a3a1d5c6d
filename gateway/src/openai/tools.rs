//! Tool calling in chat completions: `tools`, `tool_choice` and `parallel_tool_calls`.
//!
//! The tools go to the chat template (as `tools`, the way transformers passes them), which
//! writes them into the prompt in the model's own format. What the model answers is parsed
//! back into `tool_calls` in its family's format ([`ToolSyntax`], read from the template):
//! Hermes/Qwen-style `<tool_call>{...}</tool_call>` blocks, Mistral's `[TOOL_CALLS]`,
//! Phi-4-mini's `<|tool_call|>`, and for every family the whole output as a JSON call object
//! (Llama 3.1 style, optionally after `<|python_tag|>` or in a code fence) or a list of them. `required` and a named function are enforced, not hoped for: the output is
//! constrained by a JSON schema built from the functions' parameters.

use serde::Deserialize;
use serde_json::{json, Value};

use super::family::{ToolSyntax, HERMES_OPEN};
use super::tool_syntax::{
    array_calls, call_from, mistral_calls, phi_calls, strip_fence, ParsedCall,
};
use crate::error::GatewayError;
use crate::structured::RequestGrammar;
use crate::validation::invalid;

/// `tool_choice`: a mode, or one function by name.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub(crate) enum ToolChoice {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub(crate) struct NamedFunction {
    name: String,
}

/// How the output is treated, from `tools` and `tool_choice`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ToolMode {
    /// No tools, or `tool_choice: "none"`: plain text.
    Off,
    /// The model may call tools; its output is parsed.
    Auto,
    /// The model must call (one of) the tools: the output is constrained by `grammar`.
    Forced(RequestGrammar),
}

/// What the chat endpoint does with a request's tools.
#[derive(Debug, Clone)]
pub(crate) struct ToolPlan {
    /// For the chat template: the `tools` list as given (empty renders no tools).
    pub tools: Vec<Value>,
    /// Function names, to recognise calls in the output.
    names: Vec<String>,
    /// `parallel_tool_calls`: whether an answer may hold more than one call.
    parallel: bool,
    pub mode: ToolMode,
    /// How the model writes calls (Hermes until the caller says otherwise).
    pub syntax: ToolSyntax,
}

impl ToolPlan {
    /// Checks `tools` (each `{"type": "function", "function": {"name", "parameters"?}}`) and
    /// resolves `tool_choice` (default `auto` with tools, `none` without) and
    /// `parallel_tool_calls` (default true).
    pub(crate) fn resolve(
        tools: Option<Vec<Value>>,
        choice: Option<ToolChoice>,
        parallel: Option<bool>,
    ) -> Result<Self, GatewayError> {
        let tools = tools.unwrap_or_default();
        let parallel = parallel.unwrap_or(true);
        let mut names = Vec::with_capacity(tools.len());
        let mut functions = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            let function = tool.get("function").filter(|_| {
                tool.get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("function")
                    == "function"
            });
            let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
            let (Some(function), Some(name)) = (function, name) else {
                return Err(invalid(
                    "tools",
                    format!("tool {i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    tool,
                ));
            };
            if !valid_function_name(name) {
                return Err(invalid(
                    "tools",
                    format!("tool {i}'s function name must match ^[a-zA-Z0-9_-]{{1,64}}$"),
                    name,
                ));
            }
            check_parameters(i, function)?;
            names.push(name.to_string());
            functions.push(function);
        }
        let mode = match choice {
            None if tools.is_empty() => ToolMode::Off,
            None => ToolMode::Auto,
            Some(ToolChoice::Mode(mode)) => match mode.as_str() {
                "none" => ToolMode::Off,
                "auto" if tools.is_empty() => ToolMode::Off,
                "auto" => ToolMode::Auto,
                "required" if tools.is_empty() => {
                    return Err(invalid("tool_choice", "`required` needs `tools`", &mode))
                }
                "required" => {
                    let one_of: Vec<Value> = functions.iter().map(|f| call_schema(f)).collect();
                    let call = json!({"anyOf": one_of});
                    // Bounded: a model that keeps adding calls stops after the last one
                    // allowed, instead of running into max_tokens halfway through a call.
                    let schema = if parallel {
                        json!({"type": "array", "items": call, "minItems": 1,
                            "maxItems": MAX_PARALLEL_CALLS})
                    } else {
                        call
                    };
                    ToolMode::Forced(forced(schema))
                }
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        "must be `none`, `auto`, `required` or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        &mode,
                    ))
                }
            },
            Some(ToolChoice::Named { function }) => {
                let Some(i) = names.iter().position(|n| *n == function.name) else {
                    return Err(invalid(
                        "tool_choice",
                        "names no function in `tools`",
                        &function.name,
                    ));
                };
                ToolMode::Forced(forced(call_schema(functions[i])))
            }
        };
        Ok(ToolPlan {
            tools,
            names,
            parallel,
            mode,
            syntax: ToolSyntax::default(),
        })
    }

    /// Whether the output is parsed for calls.
    pub(crate) fn parses_calls(&self) -> bool {
        self.mode != ToolMode::Off
    }

    /// The calls in `text` (only the first without `parallel_tool_calls`), with any text
    /// before them; `None` when it holds no complete call to a known function (it is then
    /// plain content). Calls come in order up to the first that is incomplete, malformed or
    /// to an unknown function, which is dropped with all after it: [`Calls::clean`] then
    /// says so. Before the end (`at_end` false) a call counts only once nothing that follows
    /// can change it, so the calls of a prefix of the output are a prefix of its calls.
    pub(crate) fn calls(&self, text: &str, at_end: bool) -> Option<Calls> {
        let mut found = scan_tool_calls(text, at_end, self.syntax)?;
        if let Some(unknown) = found
            .calls
            .iter()
            .position(|c| !self.names.contains(&c.name))
        {
            found.calls.truncate(unknown);
            found.clean = false;
        }
        if !self.parallel {
            found.calls.truncate(1);
        }
        (!found.calls.is_empty()).then_some(found)
    }
}

/// Tool calls found in an output.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Calls {
    /// The text before the first call (Hermes style), if any.
    pub content: Option<String>,
    pub calls: Vec<ParsedCall>,
    /// Nothing was dropped: no incomplete or malformed call, nothing after the calls. When
    /// false, the answer's finish reason is the sequence's own (`length` when it was cut
    /// off), not `tool_calls`.
    pub clean: bool,
}

fn forced(schema: Value) -> RequestGrammar {
    RequestGrammar {
        field: "tool_choice",
        spec: grammar::GrammarSpec::JsonSchema(schema),
    }
}

/// `{"name": <the name>, "arguments": <its parameters' schema>}`.
fn call_schema(function: &Value) -> Value {
    let parameters = function
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    json!({
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": parameters,
        },
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

const CALL_CLOSE: &str = "</tool_call>";

/// The most calls a `required` answer may hold with `parallel_tool_calls` (the grammar's
/// bound).
pub(crate) const MAX_PARALLEL_CALLS: usize = 16;

/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A function's `parameters` must be a JSON schema (an object) that the server can compile:
/// `auto` never constrains with it, but a client that sends a broken one learns of it now, not
/// when it first forces a call. Keywords the grammar compiler does not implement are let
/// through: the schema is valid, the model just sees it.
fn check_parameters(i: usize, function: &Value) -> Result<(), GatewayError> {
    let Some(parameters) = function.get("parameters") else {
        return Ok(());
    };
    let reason = format!("tool {i}'s `parameters` must be a JSON schema object");
    if !parameters.is_object() {
        return Err(invalid("tools", reason, parameters));
    }
    match crate::structured::check_spec(&grammar::GrammarSpec::JsonSchema(call_schema(function))) {
        Err(grammar::GrammarError::Invalid { message, .. })
            if !message.contains("Unimplemented") =>
        {
            Err(invalid("tools", reason, message))
        }
        _ => Ok(()),
    }
}

/// Finds tool calls in a model's output: from the opening of `syntax`'s calls on (the text
/// before it, but for trailing whitespace, is content, as a stream sends it), else the whole
/// output as a call object or a list of them (Llama style, optionally after `<|python_tag|>`
/// or in a code fence). `None` when the output is not in one of these forms. With `at_end`,
/// an unclosed last block or an unterminated list item that parses counts (some models end
/// without the closing tag); before the end it may still grow, so it does not.
pub(crate) fn scan_tool_calls(text: &str, at_end: bool, syntax: ToolSyntax) -> Option<Calls> {
    if let Some(start) = syntax.opening().and_then(|open| text.find(open)) {
        let content = text[..start].trim_end();
        let content = (!content.trim_start().is_empty()).then(|| content.to_string());
        let from = &text[start..];
        let (calls, clean) = match syntax {
            ToolSyntax::Mistral => mistral_calls(from, at_end),
            ToolSyntax::Phi4Mini => phi_calls(from, at_end),
            ToolSyntax::Hermes | ToolSyntax::Json => hermes_calls(from, at_end),
        };
        return Some(Calls {
            content,
            calls,
            clean,
        });
    }
    let body = text.trim_start();
    let body = body
        .strip_prefix("<|python_tag|>")
        .unwrap_or(body)
        .trim_start();
    let body = strip_fence(body);
    let (calls, clean) = if body.starts_with('[') {
        array_calls(body, at_end)
    } else if body.starts_with('{') {
        let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
        match values.next() {
            Some(Ok(value)) => match call_from(&value) {
                Some(call) => (vec![call], body[values.byte_offset()..].trim().is_empty()),
                None => (Vec::new(), false),
            },
            _ => (Vec::new(), false),
        }
    } else {
        return None;
    };
    Some(Calls {
        content: None,
        calls,
        clean,
    })
}

/// The calls of `<tool_call>` blocks, `text` starting at the first; stops at the first that
/// does not parse. Text between and after the blocks is not part of the answer (as in vLLM's
/// Hermes parser).
fn hermes_calls(text: &str, at_end: bool) -> (Vec<ParsedCall>, bool) {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        let Some(open) = rest.find(HERMES_OPEN) else {
            return (calls, true);
        };
        let body = &rest[open + HERMES_OPEN.len()..];
        let (inner, after) = match body.find(CALL_CLOSE) {
            Some(close) => (&body[..close], &body[close + CALL_CLOSE.len()..]),
            None if at_end => (body, ""),
            None => return (calls, false),
        };
        let parsed = serde_json::from_str::<Value>(inner.trim())
            .ok()
            .and_then(|v| call_from(&v));
        match parsed {
            Some(call) => calls.push(call),
            None => return (calls, false),
        }
        rest = after;
    }
}

/// A message's `tool_calls` as templates expect them: arguments as objects, where the client
/// sent OpenAI's JSON texts (transformers' templates `tojson` them).
pub(crate) fn template_tool_calls(calls: Value) -> Value {
    let Value::Array(mut calls) = calls else {
        return calls;
    };
    for call in &mut calls {
        if let Some(args) = call.pointer_mut("/function/arguments") {
            if let Some(parsed) = args
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
            {
                *args = parsed;
            }
        }
    }
    Value::Array(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }})
    }

    #[test]
    fn qwen_hermes_output_parses() {
        // As Qwen2.5-Instruct answers with two parallel calls.
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let Calls {
            content,
            calls,
            clean,
        } = scan_tool_calls(text, true, ToolSyntax::Hermes).unwrap();
        assert_eq!(content, None);
        assert!(clean);
        assert_eq!(
            calls,
            vec![
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Rome"}"#.into()
                },
            ]
        );
    }

    #[test]
    fn content_before_a_call_and_an_unclosed_call() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}";
        let Calls { content, calls, .. } = scan_tool_calls(text, true, ToolSyntax::Hermes).unwrap();
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls[0].name, "f");
    }

    #[test]
    fn llama_json_output_parses() {
        let text =
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        let calls = scan_tool_calls(text, true, ToolSyntax::Hermes)
            .unwrap()
            .calls;
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        let list = r#"[{"name": "a", "arguments": "{\"x\": 1}"}, {"name": "b", "arguments": {}}]"#;
        let calls = scan_tool_calls(list, true, ToolSyntax::Hermes)
            .unwrap()
            .calls;
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, "{\"x\": 1}");
    }

    #[test]
    fn plain_text_and_broken_calls_are_not_calls() {
        for text in [
            "Hello there",
            "{\"no_name\": 1}",
            "<tool_call>{not json</tool_call>",
            "[]",
            "42",
        ] {
            let calls = scan_tool_calls(text, true, ToolSyntax::Hermes);
            assert!(calls.is_none_or(|c| c.calls.is_empty()), "{text}");
        }
    }

    #[test]
    fn choices_resolve() {
        let plan = ToolPlan::resolve(Some(vec![weather()]), None, None).unwrap();
        assert_eq!(plan.mode, ToolMode::Auto);
        let plan = ToolPlan::resolve(None, None, None).unwrap();
        assert_eq!(plan.mode, ToolMode::Off);
        let none = ToolChoice::Mode("none".into());
        assert_eq!(
            ToolPlan::resolve(Some(vec![weather()]), Some(none), None)
                .unwrap()
                .mode,
            ToolMode::Off
        );
        let named: ToolChoice = serde_json::from_value(
            json!({"type": "function", "function": {"name": "get_weather"}}),
        )
        .unwrap();
        let ToolMode::Forced(g) = ToolPlan::resolve(Some(vec![weather()]), Some(named), None)
            .unwrap()
            .mode
        else {
            panic!("named is forced");
        };
        crate::structured::check(&g).unwrap();
        let required = ToolChoice::Mode("required".into());
        let ToolMode::Forced(g) =
            ToolPlan::resolve(Some(vec![weather()]), Some(required), Some(true))
                .unwrap()
                .mode
        else {
            panic!("required is forced");
        };
        crate::structured::check(&g).unwrap();
    }

    #[test]
    fn bad_choices_name_the_field() {
        let unknown: ToolChoice =
            serde_json::from_value(json!({"type": "function", "function": {"name": "nope"}}))
                .unwrap();
        for (tools, choice) in [
            (Some(vec![weather()]), unknown),
            (None, ToolChoice::Mode("required".into())),
            (Some(vec![weather()]), ToolChoice::Mode("sometimes".into())),
        ] {
            match ToolPlan::resolve(tools, Some(choice), None) {
                Err(GatewayError::InvalidParameter { field, .. }) => {
                    assert_eq!(field, "tool_choice")
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(ToolPlan::resolve(Some(vec![json!({"type": "function"})]), None, None).is_err());
    }

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Issue 31: a `required` list of calls cut off by max_tokens came back as content with no
    /// calls. The complete ones are calls; the cut one is dropped and the answer is not clean.
    #[test]
    fn a_list_cut_off_keeps_its_complete_calls() {
        let plan = ToolPlan::resolve(
            Some(vec![weather()]),
            Some(ToolChoice::Mode("required".into())),
            Some(true),
        )
        .unwrap();
        let one = r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#;
        let paris = call("get_weather", r#"{"city":"Paris"}"#);
        let cut = format!(r#"[{one},{one},{{"name":"get_weather","arguments":{{"ci"#);
        let found = plan.calls(&cut, true).unwrap();
        assert_eq!(found.calls, vec![paris.clone(), paris.clone()]);
        assert!(!found.clean);
        let closed = format!("[{one},{one}]");
        assert!(plan.calls(&closed, true).unwrap().clean);
        // Before the end, an item counts once a `,` or `]` closes it.
        assert!(plan.calls(&format!("[{one}"), false).is_none());
        assert_eq!(
            plan.calls(&format!("[{one},"), false).unwrap().calls.len(),
            1
        );
        // At the end, an unterminated item that parses counts.
        assert_eq!(plan.calls(&format!("[{one}"), true).unwrap().calls.len(), 1);
        // Hermes blocks: a cut last block is dropped, closed ones stay.
        let block = format!("<tool_call>\n{one}\n</tool_call>");
        let found = plan
            .calls(&format!("{block}\n<tool_call>\n{{\"name\": \"get_w"), true)
            .unwrap();
        assert_eq!((found.calls, found.clean), (vec![paris], false));
        assert!(plan.calls(&format!("<tool_call>\n{one}"), false).is_none());
        // Strings with brackets and commas do not split items.
        let tricky = r#"[{"name":"get_weather","arguments":{"city":"a,]}[\"x"}}]"#;
        let found = plan.calls(tricky, true).unwrap();
        assert_eq!(found.calls[0].arguments, r#"{"city":"a,]}[\"x"}"#);
        assert!(found.clean);
    }

    /// Issue 31: `required`'s grammar bounds the number of parallel calls.
    #[test]
    fn required_bounds_the_parallel_calls() {
        let ToolMode::Forced(g) = ToolPlan::resolve(
            Some(vec![weather()]),
            Some(ToolChoice::Mode("required".into())),
            None,
        )
        .unwrap()
        .mode
        else {
            panic!("required is forced");
        };
        let grammar::GrammarSpec::JsonSchema(schema) = g.spec else {
            panic!("a schema");
        };
        assert_eq!(schema["maxItems"], json!(MAX_PARALLEL_CALLS));
    }

    /// Issue 31: bad names and parameters that are not a schema were accepted with `auto`.
    #[test]
    fn tools_are_checked_whatever_the_choice() {
        let tool = |name: &str, parameters: Value| json!({"type": "function", "function": {"name": name, "parameters": parameters}});
        let object = json!({"type": "object"});
        for bad in [
            tool("get weather", object.clone()),
            tool("", object.clone()),
            tool(&"x".repeat(65), object.clone()),
            tool("fn.call", object.clone()),
            tool("f", json!("not a schema")),
            tool("f", json!({"type": 12})),
            tool(
                "f",
                json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
            ),
        ] {
            for choice in [None, Some("auto"), Some("none")] {
                let choice = choice.map(|c| ToolChoice::Mode(c.into()));
                match ToolPlan::resolve(Some(vec![bad.clone()]), choice, None) {
                    Err(GatewayError::InvalidParameter { field, .. }) => {
                        assert_eq!(field, "tools", "{bad}")
                    }
                    other => panic!("{bad}: {other:?}"),
                }
            }
        }
        for good in [
            tool(&"a-Z_9".repeat(12), object.clone()),
            tool("f", json!({"type": "object", "not": {"required": ["a"]}})),
            json!({"type": "function", "function": {"name": "no_parameters"}}),
        ] {
            ToolPlan::resolve(Some(vec![good.clone()]), None, None)
                .unwrap_or_else(|e| panic!("{good}: {e}"));
        }
    }

    #[test]
    fn templates_get_arguments_as_objects() {
        let calls = json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        assert_eq!(
            template_tool_calls(calls)[0]["function"]["arguments"],
            json!({"a": 1})
        );
    }
}
