//! OpenAI's API on a real socket: completions and chat, streaming and not, with usage.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{chat_tokenizer_config, config, tokenizer, TestServer};
use gateway::fake::FakeScript;
use serde_json::{json, Value};

fn parse(events: &[String]) -> (Vec<Value>, bool) {
    let done = events.last().map(String::as_str) == Some("[DONE]");
    let chunks = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).expect("chunks are JSON"))
        .collect();
    (chunks, done)
}

#[tokio::test]
async fn completions_report_text_and_usage() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/v1/completions",
            json!({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "seed": 3}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let prompt_tokens = tokenizer().encode("Once upon a time", true).unwrap().len();
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["model"], "stories260K");
    assert_eq!(body["choices"][0]["text"], " Once upon a");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["choices"][0]["logprobs"], Value::Null);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3})
    );
    let request = server.fake.last_request().unwrap();
    assert_eq!(request.sampling.temperature, 0.0);
    assert_eq!(request.sampling.seed, 3);
    server.stop().await;
}

/// More prompts in one request than the gateway runs at once: the prompts that hold a slot
/// are read to their end and free it for the rest. Each started before any was read, they held
/// every slot while the rest waited for one, and the request timed out as 429.
#[tokio::test]
async fn a_request_with_more_prompts_than_slots_completes() {
    let mut config = config();
    config.max_concurrent_requests = 2;
    config.max_queue_wait_ms = 5_000;
    let server = TestServer::start(config, FakeScript::default()).await;
    let prompts: Vec<String> = (0..7).map(|i| format!("Once {i}")).collect();
    let started = std::time::Instant::now();
    let response = server
        .post(
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 3, "temperature": 0}),
        )
        .await;
    assert_eq!(response.status(), 200, "after {:?}", started.elapsed());
    let body: Value = response.json().await.unwrap();
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 7);
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "length");
    }
    let events = server
        .stream(
            "/v1/completions",
            json!({"prompt": prompts, "max_tokens": 3, "temperature": 0, "stream": true}),
        )
        .await
        .collect()
        .await;
    let (chunks, done) = parse(&events);
    assert!(done, "the stream ends with [DONE]: {events:?}");
    let finished = chunks
        .iter()
        .filter(|c| c["choices"][0]["finish_reason"] == "length")
        .count();
    assert_eq!(finished, 7, "{events:?}");
    server.stop().await;
}

#[tokio::test]
async fn completions_sample_by_default_and_accept_stop_strings_and_logprobs() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let body: Value = server
        .post(
            "/v1/completions",
            json!({"prompt": ["Hi"], "max_tokens": 8, "stop": " a", "logprobs": 2}),
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(body["choices"][0]["text"], " Once upon");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let logprobs = &body["choices"][0]["logprobs"];
    assert_eq!(logprobs["tokens"], json!([" Once", " upon", ""]));
    assert_eq!(logprobs["text_offset"], json!([0, 5, 10]));
    assert_eq!(logprobs["top_logprobs"][0].as_object().unwrap().len(), 2);
    let request = server.fake.last_request().unwrap();
    assert_eq!(request.sampling.temperature, 1.0);
    assert_eq!(request.stopping.stop_strings, vec![" a".to_string()]);
    server.stop().await;
}

#[tokio::test]
async fn streaming_completions_end_with_usage_and_done() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let events = server
        .stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await
        .collect()
        .await;
    let (chunks, done) = parse(&events);
    assert!(done, "{events:?}");
    assert_eq!(chunks.len(), 5, "4 tokens and a usage chunk: {events:?}");
    let text: String = chunks[..4]
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, " Once upon a time");
    for chunk in &chunks[..3] {
        assert_eq!(chunk["choices"][0]["finish_reason"], Value::Null);
        assert_eq!(chunk["object"], "text_completion");
    }
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    let prompt_tokens = tokenizer().encode("Hi", true).unwrap().len();
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(
        chunks[4]["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4})
    );
    // Without include_usage there is no usage chunk.
    let events = server
        .stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 2, "stream": true}),
        )
        .await
        .collect()
        .await;
    let (chunks, done) = parse(&events);
    assert!(done);
    assert_eq!(chunks.len(), 2);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    server.stop().await;
}

#[tokio::test]
async fn chat_completions_render_the_template() {
    let (_dir, tokenizer_config) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(tokenizer_config);
    // ChatML markers take many tokens in this small vocabulary.
    config.max_input_tokens = 256;
    config.max_total_tokens = 512;
    let server = TestServer::start(config, FakeScript::default()).await;
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Tell a story."}]}
    ]);
    let response = server
        .post(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 2}),
        )
        .await;
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(
        body["choices"][0]["message"],
        json!({"role": "assistant", "content": " Once upon"})
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");

    // The prompt is the rendered template, tokenized without adding BOS.
    let prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell a story.<|im_end|>\n<|im_start|>assistant\n";
    let expected = tokenizer().encode(prompt, false).unwrap();
    let request = server.fake.last_request().unwrap();
    assert_eq!(request.prompt_ids, expected.get_ids());
    let prompt_tokens = expected.len();
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": prompt_tokens + 2})
    );
    server.stop().await;
}

#[tokio::test]
async fn streaming_chat_sends_role_then_deltas_then_done() {
    let (_dir, tokenizer_config) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(tokenizer_config);
    // ChatML markers take many tokens in this small vocabulary.
    config.max_input_tokens = 256;
    config.max_total_tokens = 512;
    let server = TestServer::start(config, FakeScript::default()).await;
    let events = server
        .stream(
            "/v1/chat/completions",
            json!({
                "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 3,
                "stream": true,
                "stream_options": {"include_usage": true},
                "logprobs": true,
                "top_logprobs": 1
            }),
        )
        .await
        .collect()
        .await;
    let (chunks, done) = parse(&events);
    assert!(done, "{events:?}");
    assert_eq!(chunks.len(), 4);
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": " Once", "tool_calls": null})
    );
    // The role on every chunk, and `tool_calls`: TGI's client requires both.
    assert_eq!(
        chunks[1]["choices"][0]["delta"],
        json!({"role": "assistant", "content": " upon", "tool_calls": null})
    );
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
    let logprob = &chunks[0]["choices"][0]["logprobs"]["content"][0];
    assert_eq!(logprob["token"], " Once");
    assert_eq!(logprob["top_logprobs"].as_array().unwrap().len(), 1);
    assert_eq!(chunks[3]["usage"]["completion_tokens"], 3);
    let ids: Vec<&str> = chunks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert!(ids.iter().all(|id| *id == ids[0]), "one id per stream");
    server.stop().await;
}

/// OpenAI's ranges, answered in OpenAI's shape with 400 and the field as `param`.
#[tokio::test]
async fn openai_validation_errors() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let cases = [
        ("/v1/completions", json!({"prompt": "Hi", "n": 0}), "n"),
        ("/v1/completions", json!({"prompt": "Hi", "n": 129}), "n"),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "temperature": -0.5}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "temperature": 2.5}),
            "temperature",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "top_p": 2.0}),
            "top_p",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 1000}),
            "max_tokens",
        ),
        ("/v1/completions", json!({"prompt": []}), "prompt"),
        ("/v1/completions", json!({"prompt": [1, 100000]}), "prompt"),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "presence_penalty": 0.5}),
            "presence_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "frequency_penalty": -2.5}),
            "frequency_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "logprobs": 6}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "n": 3, "best_of": 2}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "best_of": 3, "stream": true}),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 21, "logprobs": true}),
            "top_logprobs",
        ),
    ];
    for (path, body, param) in cases {
        let response = server.post(path, body.clone()).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], param, "{body}: {error}");
        assert_eq!(error["error"]["type"], "validation", "{body}: {error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(param), "{body}: {message}");
    }
    // stories260K has no chat template.
    let response = server
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("chat template"), "{message}");
    // A body that is not the request's shape is OpenAI-shaped too.
    let response = server.post("/v1/completions", json!({"prompt": 5})).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["code"], "validation", "{error}");
    server.stop().await;
}

#[tokio::test]
async fn a_failing_openai_stream_ends_with_an_error_and_no_done() {
    let script = FakeScript {
        fail_at: Some(1),
        ..FakeScript::default()
    };
    let (_dir, tokenizer_config) = chat_tokenizer_config();
    let mut config = config();
    config.tokenizer_config_path = Some(tokenizer_config);
    let server = TestServer::start(config, script).await;
    let events = server
        .stream(
            "/v1/completions",
            json!({"prompt": "Hi", "max_tokens": 5, "stream": true}),
        )
        .await
        .collect()
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    // OpenAI's shape, which its SDKs raise an APIError from.
    let error: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error"]["type"], "internal", "{error}");
    assert_eq!(error["error"]["code"], "internal", "{error}");
    assert!(error["error"]["message"].is_string(), "{error}");
    assert!(error.get("error_type").is_none(), "{error}");

    // The chat route too, after its first chunk.
    let events = server
        .stream(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": true}),
        )
        .await
        .collect()
        .await;
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "internal", "{events:?}");
    assert_ne!(events.last().unwrap(), "[DONE]");
    server.stop().await;
}
