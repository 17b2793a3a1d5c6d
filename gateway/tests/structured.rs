//! Structured output and request validation at the gateway (issue 31): a grammar that
//! matches no text is refused before routing, TGI's `response_format` spelling constrains to
//! its schema, tools are checked whatever the choice, and `/tokenize` holds to the input
//! limit.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_error, chat_tokenizer_config, config, TestServer};
use gateway::fake::FakeScript;
use grammar::GrammarSpec;
use serde_json::{json, Value};

/// `[^\s\S]` came back 200 with `" a"` and `finish_reason: eos_token`: a node sampled
/// outside a grammar that admits nothing. It is now refused in each API's error shape, and
/// never reaches a node.
#[tokio::test]
async fn a_grammar_that_matches_nothing_is_refused_before_routing() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let empty = r"[^\s\S]";
    let tgi = json!({"inputs": "Lily was", "parameters": {"max_new_tokens": 4,
        "grammar": {"type": "regex", "value": empty}}});
    for path in ["/generate", "/generate_stream", "/"] {
        let message = assert_error(server.post(path, tgi.clone()).await, 422, "validation").await;
        assert!(
            message.contains("grammar") && message.contains("matches no text"),
            "{message}"
        );
    }
    let openai = json!({"prompt": "Lily was", "max_tokens": 4,
        "response_format": {"type": "regex", "value": empty}});
    let message = assert_error(
        server.post("/v1/completions", openai).await,
        400,
        "validation",
    )
    .await;
    assert!(message.contains("response_format"), "{message}");
    assert_eq!(server.fake.counts().started, 0, "nothing was routed");
    server.stop().await;
}

/// `huggingface_hub.InferenceClient.chat_completion(response_format=...)` sends
/// `{"type": "json_object", "value": schema}`; the schema was ignored.
#[tokio::test]
async fn tgis_response_format_spelling_constrains_to_its_schema() {
    let (_dir, template) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(template);
    let server = TestServer::start(config, FakeScript::default()).await;
    let schema = json!({"type": "object", "properties": {"name": {"type": "string"}},
        "required": ["name"], "additionalProperties": false});
    let chat = |format: Value| {
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": format})
    };
    let cases = [
        (
            chat(json!({"type": "json_object", "value": schema})),
            "/v1/chat/completions",
        ),
        (
            chat(json!({"type": "json_object", "value": schema.to_string()})),
            "/v1/chat/completions",
        ),
        (
            chat(json!({"type": "json_schema", "value": {"name": "n", "schema": schema}})),
            "/v1/chat/completions",
        ),
        (
            json!({"prompt": "Hi", "max_tokens": 4,
                "response_format": {"type": "json", "value": schema}}),
            "/v1/completions",
        ),
    ];
    for (body, path) in cases {
        let response = server.post(path, body.clone()).await;
        assert_eq!(
            response.status(),
            200,
            "{body}: {}",
            response.text().await.unwrap()
        );
        let grammar = server.fake.last_request().unwrap().grammar;
        assert_eq!(
            grammar,
            Some(GrammarSpec::JsonSchema(schema.clone())),
            "{body}"
        );
    }
    // OpenAI's own spelling still means any JSON object.
    let response = server
        .post("/v1/chat/completions", chat(json!({"type": "json_object"})))
        .await;
    assert_eq!(response.status(), 200);
    assert_eq!(
        server.fake.last_request().unwrap().grammar,
        Some(GrammarSpec::json_object())
    );
    let bad = chat(json!({"type": "json_schema"}));
    assert_error(
        server.post("/v1/chat/completions", bad).await,
        400,
        "validation",
    )
    .await;
    server.stop().await;
}

/// Bad function names and `parameters` that are no schema were accepted with `auto`.
#[tokio::test]
async fn tools_are_checked_with_auto_too() {
    let (_dir, template) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(template);
    let server = TestServer::start(config, FakeScript::default()).await;
    let with_tool = |name: &str, parameters: Value| {
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "tool_choice": "auto",
            "tools": [{"type": "function", "function": {"name": name, "parameters": parameters}}]})
    };
    for body in [
        with_tool("get weather", json!({"type": "object"})),
        with_tool(&"f".repeat(65), json!({"type": "object"})),
        with_tool("f", json!({"type": 12})),
        with_tool("f", json!([1, 2])),
    ] {
        let response = server.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], "tools", "{error}");
    }
    let ok = with_tool("get_weather-2", json!({"type": "object"}));
    assert_eq!(server.post("/v1/chat/completions", ok).await.status(), 200);
    server.stop().await;
}

/// `/tokenize` had no limit: it now refuses what `/generate` would, with the limit named.
#[tokio::test]
async fn tokenize_holds_to_the_input_limit() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let short = server
        .post("/tokenize", json!({"inputs": "Once upon a time"}))
        .await;
    assert_eq!(short.status(), 200);
    let long = "Once upon a time there was a girl. ".repeat(20);
    let message = assert_error(
        server.post("/tokenize", json!({"inputs": long})).await,
        422,
        "validation",
    )
    .await;
    assert!(message.contains("at most 64 tokens"), "{message}");
    let generate = server
        .post(
            "/generate",
            json!({"inputs": long, "parameters": {"max_new_tokens": 1}}),
        )
        .await;
    assert_eq!(generate.status(), 422, "the same limit as /generate");
    server.stop().await;
}

/// Schemathesis found requests `/openapi.json` allows that the server refuses (an empty
/// `inputs`, `best_of: 0`, `top_p: 0`, ...) and a status it does not list: the document now
/// carries the validator's bounds.
#[tokio::test]
async fn the_openapi_document_states_the_validators_bounds() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let doc: Value = server.get("/openapi.json").await.json().await.unwrap();
    // A schema's own properties, also where it flattens another (`allOf`).
    let schema = |name: &str| {
        let schema = &doc["components"]["schemas"][name];
        let mut parts = schema["allOf"].as_array().cloned().unwrap_or_default();
        parts.push(schema.clone());
        parts
            .into_iter()
            .map(|part| part["properties"].clone())
            .find(Value::is_object)
            .unwrap_or_else(|| panic!("{name}: {schema}"))
    };
    let tgi = schema("TgiParameters");
    assert_eq!(tgi["best_of"]["minimum"], 1, "{tgi}");
    assert_eq!(tgi["best_of"]["maximum"], 8);
    assert_eq!(tgi["max_new_tokens"]["minimum"], 1);
    assert!(tgi["top_p"]["minimum"].as_f64().unwrap() > 0.0, "{tgi}");
    assert_eq!(tgi["top_p"]["maximum"], 1.0);
    let stop = &tgi["stop"]["oneOf"][1]["$ref"];
    let name = stop.as_str().unwrap().rsplit('/').next().unwrap();
    let stop = &doc["components"]["schemas"][name];
    assert_eq!(stop["maxItems"], 8, "{stop}");
    assert_eq!(stop["items"]["minLength"], 1, "{stop}");
    assert_eq!(schema("GenerateRequest")["inputs"]["minLength"], 1);
    assert_eq!(schema("CompatGenerateRequest")["inputs"]["minLength"], 1);
    let chat = schema("ChatRequest");
    assert_eq!(chat["messages"]["minItems"], 1, "{chat}");
    assert_eq!(chat["top_logprobs"]["maximum"], 20);
    let completion = schema("CompletionRequest");
    assert_eq!(completion["best_of"]["minimum"], 1, "{completion}");
    let common = schema("CommonFields");
    assert!(
        common["top_p"]["minimum"].as_f64().unwrap() > 0.0,
        "{common}"
    );
    assert_eq!(common["n"]["minimum"], 1);
    assert_eq!(common["temperature"]["maximum"], 2.0);
    // Completions' and chat's choices are different schemas under different names.
    let choice = schema("CompletionChoice");
    assert!(
        choice.get("text").is_some() && choice.get("message").is_none(),
        "{choice}"
    );
    assert!(schema("Choice").get("message").is_some());
    let statuses = |path: &str| doc["paths"][path]["post"]["responses"].clone();
    assert!(statuses("/tokenize").get("400").is_some());
    for path in ["/generate", "/v1/chat/completions", "/tokenize"] {
        assert!(statuses(path).get("413").is_some(), "{path}");
    }
    server.stop().await;
}
