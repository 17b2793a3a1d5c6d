//! A chat request's `chat_template_kwargs` (vLLM's and SGLang's field): extra variables for the
//! chat template's render context, as transformers' `apply_chat_template(**kwargs)` passes
//! them. Qwen3's `{"enable_thinking": false}` is the common one: its template then writes an
//! empty `<think>` block into the generation prompt, so the model answers without reasoning.
//!
//! The names the gateway itself puts in the context (the messages, the tools, the special
//! tokens, the template's functions) are refused rather than overridden: transformers fails on
//! them too (a duplicate keyword argument), and a client that replaces `messages` through
//! this field would render a prompt other than the one its request states.

use crate::error::GatewayError;

/// Context variables a request may not set: those the gateway passes (see `TemplateContext`),
/// transformers' other arguments, and the functions registered in the template's environment.
const RESERVED: [&str; 9] = [
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
];

/// The request's variables for the template, checked; empty when the request has none.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
#[serde(transparent)]
pub(crate) struct TemplateKwargs(serde_json::Map<String, serde_json::Value>);

impl TemplateKwargs {
    /// Checks `value` (the request's `chat_template_kwargs`): a JSON object whose keys are none
    /// of the reserved names. `null` is the same as leaving the field out.
    pub(crate) fn from_request(value: Option<serde_json::Value>) -> Result<Self, GatewayError> {
        let map = match value {
            None | Some(serde_json::Value::Null) => return Ok(Self::default()),
            Some(serde_json::Value::Object(map)) => map,
            Some(other) => {
                return Err(invalid(
                    "must be an object of template variables",
                    kind_of(&other),
                ))
            }
        };
        if let Some(key) = map.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(invalid(
                format!(
                    "must not set `{key}`, which the gateway passes to the template itself \
                     (reserved: {})",
                    RESERVED.join(", ")
                ),
                key,
            ));
        }
        Ok(Self(map))
    }

    /// Sets `key` unless the request's object already does (its own value wins over a
    /// top-level alias such as `enable_thinking`).
    pub(crate) fn set_default(&mut self, key: &str, value: serde_json::Value) {
        self.0.entry(key).or_insert(value);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

fn invalid(reason: impl Into<String>, given: impl ToString) -> GatewayError {
    GatewayError::InvalidParameter {
        field: "chat_template_kwargs",
        reason: reason.into(),
        given: given.to_string(),
    }
}

fn kind_of(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::chat_template::{ChatMessage, ChatTemplate};

    /// Qwen3's real template (`tests/fixtures/templates/qwen3.jinja`, see its PROVENANCE.md).
    fn qwen3() -> ChatTemplate {
        let path = format!(
            "{}/tests/fixtures/templates/qwen3.jinja",
            env!("CARGO_MANIFEST_DIR")
        );
        let source = std::fs::read_to_string(path).unwrap();
        ChatTemplate::new(source, String::new(), "<|im_end|>".into()).unwrap()
    }

    fn kwargs(value: serde_json::Value) -> TemplateKwargs {
        TemplateKwargs::from_request(Some(value)).unwrap()
    }

    fn render(kwargs: &TemplateKwargs) -> String {
        let messages = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
            ..ChatMessage::default()
        }];
        qwen3().apply_with(&messages, &[], kwargs).unwrap()
    }

    const TURN: &str = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";

    /// The template's last lines: `{%- if enable_thinking is defined and enable_thinking is
    /// false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}` after the assistant's turn opens.
    #[test]
    fn qwen3_enable_thinking_false_writes_the_empty_think_block() {
        let off = render(&kwargs(json!({"enable_thinking": false})));
        assert_eq!(off, format!("{TURN}<think>\n\n</think>\n\n"));
    }

    #[test]
    fn qwen3_enable_thinking_true_or_absent_leaves_the_turn_open() {
        assert_eq!(render(&kwargs(json!({"enable_thinking": true}))), TURN);
        assert_eq!(render(&TemplateKwargs::default()), TURN);
        // A variable the template does not read changes nothing; a falsy non-boolean is not
        // `false` to the template (`is false` is an identity test in Jinja).
        assert_eq!(render(&kwargs(json!({"unused": [1, 2]}))), TURN);
        assert_eq!(render(&kwargs(json!({"enable_thinking": 0}))), TURN);
    }

    #[test]
    fn a_top_level_alias_does_not_override_the_object() {
        let mut both = kwargs(json!({"enable_thinking": true}));
        both.set_default("enable_thinking", json!(false));
        assert_eq!(render(&both), TURN);
        let mut alias = TemplateKwargs::default();
        alias.set_default("enable_thinking", json!(false));
        assert_eq!(render(&alias), format!("{TURN}<think>\n\n</think>\n\n"));
    }

    #[test]
    fn non_objects_and_reserved_names_are_refused() {
        assert_eq!(
            TemplateKwargs::from_request(Some(json!(null))).unwrap(),
            TemplateKwargs::default()
        );
        for bad in [json!(true), json!("enable_thinking"), json!([1]), json!(3)] {
            let error = TemplateKwargs::from_request(Some(bad.clone())).unwrap_err();
            assert!(
                matches!(
                    &error,
                    GatewayError::InvalidParameter {
                        field: "chat_template_kwargs",
                        ..
                    }
                ),
                "{bad}: {error:?}"
            );
        }
        for name in RESERVED {
            let error = TemplateKwargs::from_request(Some(json!({ name: 1 }))).unwrap_err();
            assert!(error.to_string().contains(&format!("`{name}`")), "{error}");
        }
    }
}
