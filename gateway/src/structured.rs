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

/// `response_format`, in OpenAI's spelling and in TGI's (whose `huggingface_hub`
/// `InferenceClient.chat_completion` sends `{"type": "json_object", "value": schema}`): TGI's
/// `value` is a schema (or a regex) that constrains the output, as TGI does.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum ResponseFormat {
    Text,
    /// Any JSON object; with TGI's `value`, JSON that follows that schema (an object, or the
    /// schema as a JSON text).
    #[serde(alias = "json")]
    JsonObject {
        #[serde(default)]
        value: Option<Value>,
    },
    /// OpenAI's `json_schema` field, or TGI's `value` (`{"name", "schema"}`).
    JsonSchema {
        #[serde(default)]
        json_schema: Option<JsonSchemaFormat>,
        #[serde(default)]
        value: Option<Value>,
    },
    /// TGI's regex grammar.
    Regex {
        value: String,
    },
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
    pub(crate) fn grammar(&self) -> Result<Option<RequestGrammar>, GatewayError> {
        let tgi = match self {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject { value: None } => {
                return Ok(Some(RequestGrammar {
                    field: "response_format",
                    spec: GrammarSpec::json_object(),
                }))
            }
            ResponseFormat::JsonObject { value: Some(value) } => TgiGrammar::Json(value.clone()),
            ResponseFormat::JsonSchema {
                json_schema: Some(format),
                value: None,
            } => TgiGrammar::JsonSchema(
                format
                    .schema
                    .clone()
                    .unwrap_or_else(|| serde_json::json!({})),
            ),
            ResponseFormat::JsonSchema {
                json_schema: None,
                value: Some(value),
            } => TgiGrammar::JsonSchema(value.clone()),
            ResponseFormat::JsonSchema { json_schema, .. } => {
                return Err(GatewayError::InvalidParameter {
                    field: "response_format",
                    reason: "`json_schema` needs exactly one of `json_schema` (OpenAI's) and \
                             `value` (TGI's)"
                        .into(),
                    given: if json_schema.is_some() {
                        "both"
                    } else {
                        "neither"
                    }
                    .into(),
                });
            }
            ResponseFormat::Regex { value } => TgiGrammar::Regex(value.clone()),
        };
        tgi.into_grammar("response_format").map(Some)
    }
}

/// `stop` as the OpenAPI document shows it (TGI's): at most `max_stop_sequences` (8 by
/// default) non-empty strings, as the validator holds them.
pub(crate) struct StopListSchema;

impl utoipa::PartialSchema for StopListSchema {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        schema_literal(stop_list())
    }
}

impl utoipa::ToSchema for StopListSchema {}

/// OpenAI's `stop`: one non-empty string, or a list as TGI's.
pub(crate) struct StopSchema;

impl utoipa::PartialSchema for StopSchema {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        schema_literal(
            serde_json::json!({"oneOf": [{"type": "string", "minLength": 1}, stop_list()]}),
        )
    }
}

impl utoipa::ToSchema for StopSchema {}

fn stop_list() -> Value {
    serde_json::json!({"type": "array", "maxItems": 8, "items": {"type": "string", "minLength": 1}})
}

/// A schema written as JSON, for rules the derived schemas cannot state.
pub(crate) fn schema_literal(
    schema: Value,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::RefOr::T(
        serde_json::from_value(schema).expect("the schema literal is a valid schema"),
    )
}

/// TGI's `grammar` parameter: `{"type": "json", "value": schema}` (the schema as an object or
/// as a JSON string), `{"type": "regex", "value": "..."}`, or the newer
/// `{"type": "json_schema", "value": {"name": ..., "schema": {...}}}`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub(crate) enum TgiGrammar {
    /// TGI also takes `json_object` for `json`.
    #[serde(alias = "json_object")]
    Json(Value),
    Regex(String),
    JsonSchema(Value),
}

impl TgiGrammar {
    pub(crate) fn grammar(self) -> Result<RequestGrammar, GatewayError> {
        self.into_grammar("grammar")
    }

    /// The grammar, with errors naming `field` (TGI's spelling also comes in
    /// `response_format`).
    fn into_grammar(self, field: &'static str) -> Result<RequestGrammar, GatewayError> {
        let spec = match self {
            TgiGrammar::Json(Value::String(text)) => {
                GrammarSpec::JsonSchema(serde_json::from_str(&text).map_err(|e| {
                    GatewayError::InvalidParameter {
                        field,
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
        Ok(RequestGrammar { field, spec })
    }
}

/// The byte vocabulary the gateway checks grammars against.
fn byte_vocabulary() -> &'static Vocabulary {
    static BYTES: OnceLock<Option<Vocabulary>> = OnceLock::new();
    BYTES
        .get_or_init(|| Vocabulary::bytes_only().ok())
        .as_ref()
        .expect("the 257-token byte vocabulary always builds")
}

/// Whether `spec` compiles and matches some text, with the reason when it does not.
pub(crate) fn check_spec(spec: &GrammarSpec) -> Result<(), grammar::GrammarError> {
    byte_vocabulary().check(spec)
}

/// Fails with a 4xx naming the field when `grammar` does not compile, or matches no text at
/// all (the nodes could then only fail mid-stream). CPU work (a few milliseconds for a large
/// schema): call it where tokenization runs, off the runtime.
pub(crate) fn check(grammar: &RequestGrammar) -> Result<(), GatewayError> {
    check_spec(&grammar.spec).map_err(|e| {
        let reason = match e {
            grammar::GrammarError::Empty { .. } => "must match some text",
            _ => "must be a grammar the server can follow",
        };
        GatewayError::InvalidParameter {
            field: grammar.field,
            reason: reason.into(),
            given: e.to_string(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn response_formats_parse() {
        let text: ResponseFormat = serde_json::from_value(json!({"type": "text"})).unwrap();
        assert!(text.grammar().unwrap().is_none());
        let object: ResponseFormat =
            serde_json::from_value(json!({"type": "json_object"})).unwrap();
        assert_eq!(
            object.grammar().unwrap().unwrap().spec,
            GrammarSpec::json_object()
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format: ResponseFormat = serde_json::from_value(json!({
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": true}
        }))
        .unwrap();
        assert_eq!(
            format.grammar().unwrap().unwrap().spec,
            GrammarSpec::JsonSchema(schema)
        );
    }

    /// Issue 31: `huggingface_hub`'s `InferenceClient.chat_completion(response_format=...)`
    /// sends TGI's spelling; its `value` was ignored, leaving only "some JSON object".
    #[test]
    fn tgis_response_format_spelling_constrains_to_its_value() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"]});
        for format in [
            json!({"type": "json_object", "value": schema}),
            json!({"type": "json", "value": schema}),
            json!({"type": "json_object", "value": schema.to_string()}),
            json!({"type": "json_schema", "value": {"name": "x", "schema": schema}}),
        ] {
            let parsed: ResponseFormat = serde_json::from_value(format.clone()).unwrap();
            let grammar = parsed.grammar().unwrap().unwrap();
            assert_eq!(grammar.field, "response_format");
            assert_eq!(
                grammar.spec,
                GrammarSpec::JsonSchema(schema.clone()),
                "{format}"
            );
        }
        let regex: ResponseFormat =
            serde_json::from_value(json!({"type": "regex", "value": "[0-9]+"})).unwrap();
        assert_eq!(
            regex.grammar().unwrap().unwrap().spec,
            GrammarSpec::Regex("[0-9]+".into())
        );
        for bad in [
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "value": {"schema": {}}, "json_schema": {"schema": {}}}),
            json!({"type": "json_object", "value": "{not json"}),
        ] {
            let parsed: ResponseFormat = serde_json::from_value(bad.clone()).unwrap();
            assert!(
                matches!(
                    parsed.grammar(),
                    Err(GatewayError::InvalidParameter {
                        field: "response_format",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    /// Issue 31: `[^\s\S]` passed the check and generated text outside the grammar.
    #[test]
    fn a_grammar_that_matches_nothing_is_refused() {
        let empty = RequestGrammar {
            field: "grammar",
            spec: GrammarSpec::Regex(r"[^\s\S]".into()),
        };
        match check(&empty) {
            Err(GatewayError::InvalidParameter {
                field,
                reason,
                given,
            }) => {
                assert_eq!(field, "grammar");
                assert_eq!(reason, "must match some text");
                assert!(given.contains("matches no text"), "{given}");
            }
            other => panic!("{other:?}"),
        }
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
