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
    // ChatML's template takes no tools: the gateway describes them in the user's turn
    // (chat_tools.rs), which needs more room than the small test limits.
    config.max_input_tokens = 2000;
    config.max_total_tokens = 4000;
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

/// `/tokenize` had no limit: it now takes at most 4 characters per token of
/// `max_input_tokens` (a limit the OpenAPI document states exactly), and refuses longer
/// text as `/generate` does, with the limit named.
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
    assert!(message.contains("at most 256 characters"), "{message}");
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
    assert_eq!(tgi["top_p"]["exclusiveMinimum"], 0.0, "{tgi}");
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
    assert_eq!(common["top_p"]["exclusiveMinimum"], 0.0, "{common}");
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

/// Schemathesis (issue 31 item 8): JSON Schema's `integer` admits `92254.0`, which the
/// server refused ("expected u32"), also inside a completions prompt of token ids. Every
/// request integer now takes an integral float, and still refuses a fraction.
#[tokio::test]
async fn integers_written_as_integral_floats_are_accepted() {
    let (_dir, template) = chat_tokenizer_config();
    let mut cfg = config();
    cfg.tokenizer_config_path = Some(template);
    let server = TestServer::start(cfg, FakeScript::default()).await;
    let tgi = json!({"inputs": "Lily was", "parameters": {"max_new_tokens": 4.0,
        "seed": 7.0, "top_k": 3.0, "top_n_tokens": 1.0, "best_of": 1.0, "do_sample": true}});
    for path in ["/generate", "/"] {
        let response = server.post(path, tgi.clone()).await;
        assert_eq!(
            response.status(),
            200,
            "{path}: {}",
            response.text().await.unwrap()
        );
    }
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2.0,
        "max_completion_tokens": 3.0, "seed": 1.0, "n": 1.0, "top_k": -1.0,
        "logprobs": true, "top_logprobs": 2.0});
    let response = server.post("/v1/chat/completions", chat).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let completion = json!({"prompt": [[1.0, 100.0, 101], [1, 102.0]], "max_tokens": 2.0,
        "logprobs": 1.0, "best_of": 1.0});
    let response = server.post("/v1/completions", completion).await;
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"].as_array().unwrap().len(), 2, "{body}");

    let fraction = json!({"inputs": "Lily", "parameters": {"max_new_tokens": 1.5}});
    let message = assert_error(server.post("/generate", fraction).await, 422, "validation").await;
    assert!(
        message.contains("1.5") && message.contains("integer"),
        "{message}"
    );
    for (field, value) in [
        ("max_tokens", json!(2.5)),
        ("seed", json!(18446744073709551616.0)),
    ] {
        let mut body = json!({"prompt": "Lily", "max_tokens": 2});
        body[field] = value;
        let response = server.post("/v1/completions", body).await;
        assert_eq!(response.status(), 400, "{field}");
    }
    let ids = json!({"prompt": [[1, 2.5]], "max_tokens": 1});
    assert_eq!(server.post("/v1/completions", ids).await.status(), 400);
    server.stop().await;
}

/// Schemathesis (issue 31 item 8) found the document and the server apart: `seed: 2^63`
/// (past `int64`) and chat's `max_tokens: 2^31` (past `int32`) were "invalid" yet taken; a
/// string json grammar, a long `/tokenize` text and token ids past the vocabulary were
/// "valid" yet refused; and the event streams' schema described the payload where OpenAPI
/// puts the event. Each is now stated as the server holds it, and checked both ways here.
#[tokio::test]
async fn the_openapi_document_and_the_server_agree_at_the_edges() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let doc: Value = server.get("/openapi.json").await.json().await.unwrap();
    let schemas = &doc["components"]["schemas"];
    let tgi = &schemas["TgiParameters"]["properties"];
    assert_eq!(tgi["seed"]["maximum"], json!(u64::MAX), "{tgi}");
    assert_ne!(tgi["seed"]["format"], "int64");
    // A prompt is at least one token.
    assert_eq!(tgi["max_new_tokens"]["maximum"], 127, "{tgi}");
    let too_many = json!({"inputs": "Lily", "parameters": {"max_new_tokens": 128}});
    assert_eq!(server.post("/generate", too_many).await.status(), 422);
    let chat = &schemas["ChatRequest"]["allOf"][1]["properties"];
    assert_eq!(chat["max_tokens"]["maximum"], 127, "{chat}");
    // Checked whichever spelling wins.
    let both = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 128,
        "max_completion_tokens": 1});
    let message = assert_error(
        server.post("/v1/chat/completions", both).await,
        400,
        "validation",
    )
    .await;
    assert!(message.contains("max_tokens"), "{message}");
    assert!(schemas["TgiParameters"].get("allOf").is_none());
    assert_eq!(
        tgi["top_n_tokens"]["maximum"], 20,
        "a tighter maximum stays"
    );
    assert_eq!(tgi["top_k"]["maximum"], json!(i64::MAX), "{tgi}");
    // The document's edges, as the server takes them.
    let generate = |parameters: Value| json!({"inputs": "Lily", "parameters": parameters});
    for parameters in [
        json!({"seed": u64::MAX, "max_new_tokens": 1}),
        json!({"top_k": i64::MAX, "max_new_tokens": 1}),
        json!({"temperature": 1e300, "top_p": 1e-300, "repetition_penalty": 1e300,
            "max_new_tokens": 1}),
    ] {
        let response = server.post("/generate", generate(parameters.clone())).await;
        assert_eq!(response.status(), 200, "{parameters}");
    }
    let past = generate(json!({"seed": 18446744073709551616.0}));
    assert_eq!(server.post("/generate", past).await.status(), 422);
    // Read as 64-bit, 2.0000001 is above chat's maximum temperature (as a 32-bit float it
    // rounded to 2 and passed).
    let hot = json!({"prompt": "Lily", "max_tokens": 1, "temperature": 2.0000001});
    assert_eq!(server.post("/v1/completions", hot).await.status(), 400);

    let grammar = &schemas["TgiGrammar"]["oneOf"];
    let value = |kind: &str| {
        grammar
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["properties"]["type"]["enum"][0] == kind)
            .map(|v| v["properties"]["value"].clone())
            .unwrap_or_else(|| panic!("{kind}: {grammar}"))
    };
    assert_eq!(value("regex")["type"], "string");
    for kind in ["json", "json_schema"] {
        let value = value(kind).to_string();
        assert!(
            !value.contains("\"string\"") && value.contains("object"),
            "{kind}: {value}"
        );
    }
    let string_schema = generate(json!({"grammar": {"type": "json_schema", "value": "x"}}));
    assert_eq!(server.post("/generate", string_schema).await.status(), 422);

    let inputs = &schemas["TokenizeRequest"]["properties"]["inputs"];
    let max_chars = inputs["maxLength"].as_u64().unwrap() as usize;
    assert_eq!(max_chars, 4 * 64, "{inputs}");
    // The densest text there is: every character is 4 byte-fallback tokens.
    let dense = "\u{1d4e3}".repeat(max_chars);
    let response = server.post("/tokenize", json!({"inputs": dense})).await;
    assert_eq!(response.status(), 200);
    let tokens: Value = response.json().await.unwrap();
    assert!(tokens.as_array().unwrap().len() > 64, "{tokens}");
    let over = "a".repeat(max_chars + 1);
    let over = server.post("/tokenize", json!({"inputs": over})).await;
    assert_eq!(over.status(), 422);

    let prompt = &schemas["PromptSchema"]["oneOf"];
    let vocab = common::tokenizer().get_vocab_size(true) as u64;
    let ids = prompt
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["items"]["type"] == "integer")
        .unwrap();
    assert_eq!(ids["items"]["maximum"], vocab - 1, "{prompt}");
    assert_eq!(ids["maxItems"], 64, "{prompt}");
    for (id, status) in [(vocab - 1, 200), (vocab, 400)] {
        let body = json!({"prompt": [id], "max_tokens": 1});
        assert_eq!(
            server.post("/v1/completions", body).await.status(),
            status,
            "{id}"
        );
    }

    // TGI's rules across fields: best_of above 1 needs sampling and no seed, and a stream
    // takes neither it nor decoder_input_details.
    let rules = &schemas["TgiParameters"];
    assert_eq!(
        rules["if"]["properties"]["best_of"]["minimum"], 2,
        "{rules}"
    );
    assert_eq!(
        rules["then"]["properties"]["seed"]["type"], "null",
        "{rules}"
    );
    let request = &doc["paths"]["/generate_stream"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"]["$ref"];
    let name = request.as_str().unwrap().rsplit('/').next().unwrap();
    let streamed = schemas[name]["allOf"][1]["properties"]["parameters"]["properties"].clone();
    assert_eq!(streamed["best_of"]["maximum"], 1, "{streamed}");
    assert_eq!(
        schemas["CompatGenerateRequest"]["then"]["properties"],
        schemas[name]["allOf"][1]["properties"]
    );
    for parameters in [
        json!({"best_of": 2, "seed": 1, "do_sample": true}),
        json!({"best_of": 2, "temperature": 1.0}),
    ] {
        let body = generate(parameters.clone());
        assert_eq!(
            server.post("/generate", body).await.status(),
            422,
            "{parameters}"
        );
    }
    let sampled = generate(json!({"best_of": 2, "top_k": 1, "max_new_tokens": 1}));
    assert_eq!(
        server.post("/generate", sampled.clone()).await.status(),
        200
    );
    assert_eq!(server.post("/generate_stream", sampled).await.status(), 422);

    // Each event's `data` is a JSON payload: TGI's token, or an error.
    for path in ["/generate_stream", "/"] {
        let stream = &doc["paths"][path]["post"]["responses"]["200"]["content"]
            ["text/event-stream"]["schema"];
        assert_eq!(stream["required"], json!(["data"]), "{path}: {stream}");
        let data = &stream["properties"]["data"];
        assert_eq!(data["contentMediaType"], "application/json", "{data}");
        let payload = data["contentSchema"].to_string();
        assert!(payload.contains("StreamResponse"), "{payload}");
    }
    server.stop().await;
}
