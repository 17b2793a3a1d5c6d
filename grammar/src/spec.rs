//! What a request's output must match.

use serde_json::Value;

/// A constraint on the generated text, as requests carry it from the gateway to the engine.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum GrammarSpec {
    /// A JSON schema (draft 2020-12 subset, as llguidance supports it). `{"type": "object"}`
    /// is OpenAI's `json_object` mode.
    JsonSchema(Value),
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex(String),
    /// A Lark grammar in llguidance's dialect.
    Lark(String),
}

impl GrammarSpec {
    /// OpenAI's `response_format: {"type": "json_object"}`: any JSON object.
    pub fn json_object() -> Self {
        GrammarSpec::JsonSchema(serde_json::json!({"type": "object"}))
    }

    /// The kind's name for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "json schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "lark grammar",
        }
    }

    /// The llguidance grammar. JSON schemas default to compact separators without free
    /// whitespace (a schema may override it with llguidance's `x-guidance` key): free
    /// whitespace lets a weak model pad forever instead of closing the object.
    pub(crate) fn to_llguidance(&self) -> llguidance::api::TopLevelGrammar {
        use llguidance::api::TopLevelGrammar;
        match self {
            GrammarSpec::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if let Value::Object(map) = &mut schema {
                    map.entry("x-guidance")
                        .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_shape_is_tagged() {
        let spec = GrammarSpec::Regex("[0-9]+".into());
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"type": "regex", "value": "[0-9]+"})
        );
        assert_eq!(serde_json::from_value::<GrammarSpec>(json).unwrap(), spec);
    }
}
