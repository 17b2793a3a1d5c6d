//! What TGI's and OpenAI's clients expect beyond the basics: TGI's `POST /` and `best_of`,
//! OpenAI's prompt shapes, `n`, `best_of`, model names, `system_fingerprint`, limits lowered to
//! the nodes' context, and the OpenAPI document.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_error, chat_tokenizer_config, config, TestServer};
use gateway::fake::FakeScript;
use serde_json::{json, Value};

fn parse(events: &[String]) -> (Vec<Value>, usize) {
    let done = events.iter().filter(|e| *e == "[DONE]").count();
    let chunks = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("chunks are JSON"))
        .collect();
    (chunks, done)
}

#[tokio::test]
async fn post_root_answers_a_list_or_streams_by_the_stream_field() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": true}}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body[0]["generated_text"], " Once upon", "{body}");
    assert_eq!(body[0]["details"]["generated_tokens"], 2, "{body}");
    assert_eq!(body.as_array().unwrap().len(), 1);

    let events = server
        .stream(
            "/",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2}, "stream": true}),
        )
        .await
        .collect()
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    let last: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(last["generated_text"], " Once upon");
    assert_eq!(last["index"], 2);
    // Errors on `/` keep TGI's shape.
    let response = server
        .post("/", json!({"inputs": "Hi", "parameters": {"top_p": 3.0}}))
        .await;
    assert_error(response, 422, "validation").await;
    server.stop().await;
}

#[tokio::test]
async fn tgi_best_of_samples_several_and_reports_the_others() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let body: Value = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 3, "best_of": 3, "do_sample": true, "details": true}}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["generated_text"], " Once upon a", "{body}");
    let others = body["details"]["best_of_sequences"].as_array().unwrap();
    assert_eq!(others.len(), 2, "{body}");
    assert_eq!(others[0]["generated_tokens"], 3);
    assert_eq!(server.fake.counts().started, 3);
    // TGI's rules: sampling, no seed, no streaming.
    for (parameters, field) in [
        (json!({"best_of": 2}), "best_of"),
        (
            json!({"best_of": 2, "do_sample": true, "seed": 1}),
            "best_of",
        ),
        (json!({"best_of": 0}), "best_of"),
        (json!({"best_of": 99, "do_sample": true}), "best_of"),
    ] {
        let response = server
            .post(
                "/generate",
                json!({"inputs": "Hi", "parameters": parameters}),
            )
            .await;
        let message = assert_error(response, 422, "validation").await;
        assert!(message.contains(field), "{parameters}: {message}");
    }
    let response = server
        .post(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": true}}),
        )
        .await;
    assert_error(response, 422, "validation").await;
    server.stop().await;
}

#[tokio::test]
async fn tgi_decoder_input_details_lists_the_prompt_with_its_logprobs() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let parameters = json!({"max_new_tokens": 2, "details": true, "decoder_input_details": true,
        "best_of": 2, "do_sample": true});
    let body: Value = server
        .post(
            "/",
            json!({"inputs": "Once upon", "parameters": parameters}),
        )
        .await
        .json()
        .await
        .unwrap();
    let details = &body[0]["details"];
    let prefill = details["prefill"].as_array().unwrap();
    let prompt = server.fake.last_request().unwrap().prompt_ids;
    let ids: Vec<u64> = prefill.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert_eq!(
        ids,
        prompt.iter().map(|&i| i as u64).collect::<Vec<_>>(),
        "{body}"
    );
    // Nothing precedes the first token; every other has the node's figure (the fake's -1).
    assert!(prefill[0]["logprob"].is_null(), "{body}");
    assert!(prefill[1..].iter().all(|t| t["logprob"] == -1.0), "{body}");
    assert!(prefill.iter().all(|t| t["text"].is_string()));
    // best_of's other sequence shares the prompt, and only the first computed it.
    let other = &details["best_of_sequences"][0]["prefill"];
    assert_eq!(other, &details["prefill"]);
    assert_eq!(server.fake.counts().started, 2);
    // Not asked for: an empty list, as TGI answers.
    let body: Value = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"details": true}}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["details"]["prefill"], json!([]), "{body}");
    // TGI refuses them when streaming.
    let response = server
        .post(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"decoder_input_details": true}}),
        )
        .await;
    let message = assert_error(response, 422, "validation").await;
    assert!(message.contains("decoder_input_details"), "{message}");
    server.stop().await;
}

#[tokio::test]
async fn openai_prompts_may_be_lists_of_strings_or_ids_and_n_gives_choices() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let body: Value = server
        .post(
            "/v1/completions",
            json!({"prompt": ["Hi", "Once"], "max_tokens": 2, "n": 2, "seed": 7}),
        )
        .await
        .json()
        .await
        .unwrap();
    let choices = body["choices"].as_array().unwrap();
    let indices: Vec<u64> = choices
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3], "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    assert_eq!(server.fake.counts().started, 4);
    // Each sequence has its own seed, so sampled choices differ.
    let seed = server.fake.last_request().unwrap().sampling.seed;
    assert!(seed == 7 || seed == 8, "{seed}");

    server
        .post(
            "/v1/completions",
            json!({"prompt": [1, 300, 301], "max_tokens": 1}),
        )
        .await
        .error_for_status()
        .unwrap();
    assert_eq!(
        server.fake.last_request().unwrap().prompt_ids,
        [1, 300, 301]
    );
    let body: Value = server
        .post(
            "/v1/completions",
            json!({"prompt": [[1, 300], [1, 302, 303]], "max_tokens": 1}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["choices"].as_array().unwrap().len(), 2, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], 5, "{body}");

    // best_of runs more and returns n.
    let body: Value = server
        .post(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 2, "best_of": 3, "n": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["choices"].as_array().unwrap().len(), 2, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
    server.stop().await;
}

#[tokio::test]
async fn a_stream_of_n_choices_ends_once_after_all() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let events = server
        .stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 3, "n": 3, "stream": true,
                   "stream_options": {"include_usage": true}}),
        )
        .await
        .collect()
        .await;
    let (chunks, done) = parse(&events);
    assert_eq!(done, 1, "{events:?}");
    assert_eq!(events.last().unwrap(), "[DONE]");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 9, "{usage}");
    for index in 0..3 {
        let finished = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .filter(|c| c["choices"][0]["finish_reason"] == "length")
            .count();
        assert_eq!(finished, 1, "choice {index}: {events:?}");
    }
    assert!(chunks
        .iter()
        .all(|c| c["system_fingerprint"].as_str().is_some()));
    // TGI's own client sends `model: "tgi"` and cannot parse `[DONE]`.
    let events = server
        .stream(
            "/v1/completions",
            json!({"model": "tgi", "prompt": "Hi", "max_tokens": 2, "stream": true}),
        )
        .await
        .collect()
        .await;
    assert_eq!(parse(&events).1, 0, "{events:?}");
    assert_eq!(events.len(), 2, "{events:?}");
    server.stop().await;
}

#[tokio::test]
async fn unknown_models_are_404_and_aliases_are_served() {
    let mut cfg = config();
    cfg.served_model_names = vec!["tiny".into()];
    let (_dir, template) = chat_tokenizer_config();
    cfg.tokenizer_config_path = Some(template);
    let server = TestServer::start(cfg, FakeScript::default()).await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = json!({"model": "gpt-4", "prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1});
        let response = server.post(path, body).await;
        assert_eq!(response.status(), 404, "{path}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["code"], "model_not_found", "{error}");
        assert_eq!(error["error"]["param"], "model", "{error}");
        assert!(error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("gpt-4"));
    }
    // The id, an alias and TGI's placeholder are all served, and named after the id.
    for model in ["stories260K", "tiny", "tgi", "dummy"] {
        let body: Value = server
            .post(
                "/v1/chat/completions",
                json!({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
            )
            .await
            .json()
            .await
            .unwrap();
        assert_eq!(body["model"], "stories260K", "{body}");
        assert!(
            body["system_fingerprint"]
                .as_str()
                .unwrap()
                .starts_with("fission-"),
            "{body}"
        );
    }
    let models: Value = server.get("/v1/models").await.json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["stories260K", "tiny"]);
    server.stop().await;
}

#[tokio::test]
async fn limits_are_lowered_to_the_nodes_context() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let info: Value = server.get("/info").await.json().await.unwrap();
    assert_eq!(
        (&info["max_input_tokens"], &info["max_total_tokens"]),
        (&json!(64), &json!(128))
    );
    server.fake.set_max_context(40);
    let info: Value = server.get("/info").await.json().await.unwrap();
    assert_eq!(
        (&info["max_input_tokens"], &info["max_total_tokens"]),
        (&json!(39), &json!(40))
    );
    let models: Value = server.get("/v1/models").await.json().await.unwrap();
    assert_eq!(models["data"][0]["max_model_len"], 40);
    let response = server
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 60}))
        .await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`prompt`")
            && message.contains("`max_tokens` (60)")
            && message.contains("max_total_tokens 40"),
        "{message}"
    );
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 60}}),
        )
        .await;
    let message = assert_error(response, 422, "validation").await;
    assert!(message.contains("max_total_tokens 40"), "{message}");
    server.stop().await;
}

#[tokio::test]
async fn the_openapi_document_covers_every_api_route() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let doc: Value = server.get("/openapi.json").await.json().await.unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    for path in [
        "/",
        "/generate",
        "/generate_stream",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/info",
        "/health",
        "/tokenize",
    ] {
        assert!(doc["paths"][path].is_object(), "{path} missing");
    }
    let schemas = &doc["components"]["schemas"];
    for schema in [
        "GenerateRequest",
        "CompletionRequest",
        "ChatRequest",
        "ErrorBody",
    ] {
        assert!(schemas[schema].is_object(), "{schema} missing");
    }
    server.stop().await;
}
