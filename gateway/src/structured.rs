//! Structured output at the gateway: OpenAI's `response_format` and TGI's `grammar` become a
//! [`GrammarSpec`] on the request, checked here so that a bad schema or regex gets a 4xx naming
//! the field before anything is routed. The nodes compile it again against their model's
//! vocabulary and apply the mask while sampling; the gateway never sees a model.

use std::sync::OnceLock;

use grammar::{GrammarSpec, Vocabulary};
use serde::Deserialize;
use serde_json::Value;

use crate::error::GatewayError;

/// A request's grammar and the field it came from, for error messages.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RequestGrammar {
    pub field: &'static str,
    pub spec: GrammarSpec,
}

/// OpenAI's `response_format`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub(crate) struct JsonSchemaFormat {
    #[allow(dead_code)] // part of OpenAI's shape; the schema alone constrains the output
    name: Option<String>,
    /// Absent: any JSON value.
    schema: Option<Value>,
    #[allow(dead_code)] // the output always follows the schema strictly
    strict: Option<bool>,
}

impl ResponseFormat {
    pub(crate) fn grammar(&self) -> Option<RequestGrammar> {
        let spec = match self {
            ResponseFormat::Text => return None,
            ResponseFormat::JsonObject => GrammarSpec::json_object(),
            ResponseFormat::JsonSchema { json_schema } => GrammarSpec::JsonSchema(
                json_schema
                    .schema
                    .clone()
                    .unwrap_or_else(|| serde_json::json!({})),
            ),
        };
        Some(RequestGrammar {
            field: "response_format",
            spec,
        })
    }
}

/// TGI's `grammar` parameter: `{"type": "json", "value": schema}` (the schema as an object or
/// as a JSON string), `{"type": "regex", "value": "..."}`, or the newer
/// `{"type": "json_schema", "value": {"name": ..., "schema": {...}}}`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub(crate) enum TgiGrammar {
    Json(Value),
    Regex(String),
    JsonSchema(Value),
}

impl TgiGrammar {
    pub(crate) fn grammar(self) -> Result<RequestGrammar, GatewayError> {
        let spec = match self {
            TgiGrammar::Json(Value::String(text)) => {
                GrammarSpec::JsonSchema(serde_json::from_str(&text).map_err(|e| {
                    GatewayError::InvalidParameter {
                        field: "grammar",
                        reason: "the json grammar's value must be a JSON schema".into(),
                        given: e.to_string(),
                    }
                })?)
            }
            TgiGrammar::Json(schema) => GrammarSpec::JsonSchema(schema),
            TgiGrammar::JsonSchema(value) => {
                GrammarSpec::JsonSchema(value.get("schema").cloned().unwrap_or(value))
            }
            TgiGrammar::Regex(rx) => GrammarSpec::Regex(rx),
        };
        Ok(RequestGrammar {
            field: "grammar",
            spec,
        })
    }
}

/// Fails with a 4xx naming the field when `grammar` does not compile. CPU work (a few
/// milliseconds for a large schema): call it where tokenization runs, off the runtime.
pub(crate) fn check(grammar: &RequestGrammar) -> Result<(), GatewayError> {
    static BYTES: OnceLock<Option<Vocabulary>> = OnceLock::new();
    let vocab = BYTES
        .get_or_init(|| Vocabulary::bytes_only().ok())
        .as_ref()
        .expect("the 257-token byte vocabulary always builds");
    vocab
        .check(&grammar.spec)
        .map_err(|e| GatewayError::InvalidParameter {
            field: grammar.field,
            reason: "must be a grammar the server can follow".into(),
            given: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn response_formats_parse() {
        let text: ResponseFormat = serde_json::from_value(json!({"type": "text"})).unwrap();
        assert!(text.grammar().is_none());
        let object: ResponseFormat =
            serde_json::from_value(json!({"type": "json_object"})).unwrap();
        assert_eq!(object.grammar().unwrap().spec, GrammarSpec::json_object());
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format: ResponseFormat = serde_json::from_value(json!({
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}
        }))
        .unwrap();
        assert_eq!(
            format.grammar().unwrap().spec,
            GrammarSpec::JsonSchema(schema)
        );
    }

    #[test]
    fn tgi_grammars_parse() {
        let schema = json!({"type": "object"});
        for value in [schema.clone(), Value::String(schema.to_string())] {
            let g: TgiGrammar =
                serde_json::from_value(json!({"type": "json", "value": value})).unwrap();
            assert_eq!(
                g.grammar().unwrap().spec,
                GrammarSpec::JsonSchema(schema.clone())
            );
        }
        let g: TgiGrammar =
            serde_json::from_value(json!({"type": "regex", "value": "[a-z]+"})).unwrap();
        assert_eq!(
            g.grammar().unwrap().spec,
            GrammarSpec::Regex("[a-z]+".into())
        );
        let g: TgiGrammar = serde_json::from_value(
            json!({"type": "json_schema", "value": {"name": "n", "schema": schema}}),
        )
        .unwrap();
        assert_eq!(
            g.grammar().unwrap().spec,
            GrammarSpec::JsonSchema(json!({"type": "object"}))
        );
    }

    #[test]
    fn bad_grammars_name_their_field() {
        let bad = RequestGrammar {
            field: "response_format",
            spec: GrammarSpec::JsonSchema(json!({"type": 12})),
        };
        match check(&bad) {
            Err(GatewayError::InvalidParameter { field, given, .. }) => {
                assert_eq!(field, "response_format");
                assert!(given.contains("json schema"), "{given}");
            }
            other => panic!("{other:?}"),
        }
        let bad = RequestGrammar {
            field: "grammar",
            spec: GrammarSpec::Regex("(unclosed".into()),
        };
        assert!(check(&bad).is_err());
        let ok = RequestGrammar {
            field: "grammar",
            spec: GrammarSpec::Regex("[0-9]{2}".into()),
        };
        check(&ok).unwrap();
    }
}
