//! Tool calling in chat completions: `tools`, `tool_choice` and `parallel_tool_calls`.
//!
//! The tools go to the chat template (as `tools`, the way transformers passes them), which
//! writes them into the prompt in the model's own format. What the model answers is parsed
//! back into `tool_calls`: Hermes/Qwen-style `<tool_call>{...}</tool_call>` blocks, or the
//! whole output as a JSON call object (Llama 3.1 style, optionally after `<|python_tag|>`) or a
//! list of them. `required` and a named function are enforced, not hoped for: the output is
//! constrained by a JSON schema built from the functions' parameters.

use serde::Deserialize;
use serde_json::{json, Value};

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
}

/// One parsed call, in OpenAI's shape apart from the id.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParsedCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI sends them.
    pub arguments: String,
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
                    let schema = if parallel {
                        json!({"type": "array", "items": call, "minItems": 1})
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
        })
    }

    /// Whether the output is parsed for calls.
    pub(crate) fn parses_calls(&self) -> bool {
        self.mode != ToolMode::Off
    }

    /// The calls in `text` (only the first without `parallel_tool_calls`), with any text
    /// before them; `None` when it holds no call to a known function (it is then plain
    /// content).
    pub(crate) fn parse(&self, text: &str) -> Option<(Option<String>, Vec<ParsedCall>)> {
        let (content, mut calls) = parse_tool_calls(text)?;
        if !calls.iter().all(|c| self.names.contains(&c.name)) {
            return None;
        }
        if !self.parallel {
            calls.truncate(1);
        }
        Some((content, calls))
    }
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

/// The opening of a Hermes/Qwen-style call.
pub(crate) const CALL_OPEN: &str = "<tool_call>";

/// Parses tool calls out of a model's output: `<tool_call>` blocks (the text before the first,
/// but for trailing whitespace, is content, as a stream sends it; an unclosed last block runs
/// to the end), else the whole output as a call object or a list of them. `None` when there is
/// no well-formed call.
pub(crate) fn parse_tool_calls(text: &str) -> Option<(Option<String>, Vec<ParsedCall>)> {
    const CLOSE: &str = "</tool_call>";
    if let Some(start) = text.find(CALL_OPEN) {
        let content = text[..start].trim_end();
        let mut calls = Vec::new();
        let mut rest = &text[start..];
        while let Some(open) = rest.find(CALL_OPEN) {
            let body = &rest[open + CALL_OPEN.len()..];
            let (inner, after) = match body.find(CLOSE) {
                Some(close) => (&body[..close], &body[close + CLOSE.len()..]),
                None => (body, ""),
            };
            calls.push(call_from(&serde_json::from_str(inner.trim()).ok()?)?);
            rest = after;
        }
        let content = (!content.trim_start().is_empty()).then(|| content.to_string());
        return Some((content, calls));
    }
    let body = text.trim();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
    let calls = match serde_json::from_str::<Value>(body).ok()? {
        Value::Array(items) if !items.is_empty() => {
            items.iter().map(call_from).collect::<Option<Vec<_>>>()?
        }
        object @ Value::Object(_) => vec![call_from(&object)?],
        _ => return None,
    };
    Some((None, calls))
}

/// `{"name": ..., "arguments" | "parameters": {...} or a JSON text}`.
fn call_from(value: &Value) -> Option<ParsedCall> {
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
        let (content, calls) = parse_tool_calls(text).unwrap();
        assert_eq!(content, None);
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
        let (content, calls) = parse_tool_calls(text).unwrap();
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls[0].name, "f");
    }

    #[test]
    fn llama_json_output_parses() {
        let text =
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        let (_, calls) = parse_tool_calls(text).unwrap();
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        let list = r#"[{"name": "a", "arguments": "{\"x\": 1}"}, {"name": "b", "arguments": {}}]"#;
        let (_, calls) = parse_tool_calls(list).unwrap();
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
            assert!(parse_tool_calls(text).is_none(), "{text}");
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

    #[test]
    fn templates_get_arguments_as_objects() {
        let calls = json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
        assert_eq!(
            template_tool_calls(calls)[0]["function"]["arguments"],
            json!({"a": 1})
        );
    }
}
