//! TGI's API on a real socket: `/generate`, `/generate_stream`, validation, admission, failures
//! and cancellation.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{assert_error, config, tokenizer, TestServer, WAIT};
use gateway::fake::FakeScript;
use serde_json::json;

fn slow(token_delay_ms: u64) -> FakeScript {
    FakeScript {
        token_delay: Duration::from_millis(token_delay_ms),
        ..FakeScript::default()
    }
}

#[tokio::test]
async fn generate_returns_text_and_details() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 3, "details": true, "top_n_tokens": 2}}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["generated_text"], " Once upon a");
    let details = &body["details"];
    assert_eq!(details["finish_reason"], "length");
    assert_eq!(details["generated_tokens"], 3);
    assert_eq!(
        details["seed"],
        serde_json::Value::Null,
        "greedy reports no seed"
    );
    assert_eq!(details["prefill"], json!([]));
    let tokens = details["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 3);
    assert_eq!(
        tokens[0],
        json!({"id": 100, "text": " Once", "logprob": -0.5, "special": false})
    );
    let top = details["top_tokens"].as_array().unwrap();
    assert_eq!(top.len(), 3);
    assert_eq!(top[0].as_array().unwrap().len(), 2);
    assert_eq!(top[0][0]["id"], 100);

    // The backend got the prompt tokenized with BOS, and TGI's greedy defaults.
    let request = server.fake.last_request().unwrap();
    let expected = tokenizer().encode("Once upon a time", true).unwrap();
    assert_eq!(request.prompt_ids, expected.get_ids());
    assert_eq!(request.prompt_ids[0], 1);
    assert_eq!(request.sampling.temperature, 0.0);
    assert_eq!(request.stopping.max_new_tokens, 3);
    assert_eq!(request.stopping.stop_token_ids, vec![2]);
    server.stop().await;
}

#[tokio::test]
async fn generate_without_details_and_with_full_text_and_seed() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 2, "return_full_text": true, "do_sample": true, "seed": 42, "stop": null}}),
        )
        .await;
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body, json!({"generated_text": "Hi Once upon"}));
    let request = server.fake.last_request().unwrap();
    assert_eq!(request.sampling.seed, 42);
    assert_eq!(request.sampling.temperature, 1.0);
    // The default max_new_tokens applies when none is given.
    server.post("/generate", json!({"inputs": "Hi"})).await;
    assert_eq!(
        server.fake.last_request().unwrap().stopping.max_new_tokens,
        8
    );
    server.stop().await;
}

#[tokio::test]
async fn stop_sequences_end_with_stop_sequence() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 8, "stop": [" a"], "details": true}}),
        )
        .await;
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["generated_text"], " Once upon");
    assert_eq!(body["details"]["finish_reason"], "stop_sequence");
    server.stop().await;
}

#[tokio::test]
async fn generate_stream_events_are_tgi_shaped() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let reader = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4, "do_sample": true, "seed": 7}}),
        )
        .await;
    let events: Vec<serde_json::Value> = reader
        .collect()
        .await
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(events.len(), 4);
    for (i, event) in events.iter().enumerate() {
        assert_eq!(event["index"], i + 1);
        let token = event["token"].as_object().unwrap();
        for key in ["id", "text", "logprob", "special"] {
            assert!(token.contains_key(key), "{event}");
        }
        assert_eq!(event["top_tokens"], json!([]));
        if i < 3 {
            assert_eq!(event["generated_text"], serde_json::Value::Null);
            assert_eq!(event["details"], serde_json::Value::Null);
        }
    }
    let last = &events[3];
    assert_eq!(last["generated_text"], " Once upon a time");
    assert_eq!(
        last["details"],
        json!({"finish_reason": "length", "generated_tokens": 4, "seed": 7})
    );
    server.stop().await;
}

#[tokio::test]
async fn eos_ends_the_stream_with_eos_token() {
    let script = FakeScript {
        tokens: vec![(100, " The".into()), (2, String::new())],
        ..FakeScript::default()
    };
    let server = TestServer::start(config(), script).await;
    let events = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 10}}),
        )
        .await
        .collect()
        .await;
    assert_eq!(events.len(), 2);
    let last: serde_json::Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(last["details"]["finish_reason"], "eos_token");
    assert_eq!(last["token"]["special"], true);
    assert_eq!(last["generated_text"], " The");
    server.stop().await;
}

#[tokio::test]
async fn too_long_input_names_the_limit_and_the_value() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let inputs = "Once upon a time there was a little girl. ".repeat(20);
    let tokens = tokenizer().encode(inputs.as_str(), true).unwrap().len();
    assert!(tokens > 64);
    let message = assert_error(
        server.post("/generate", json!({"inputs": inputs})).await,
        422,
        "validation",
    )
    .await;
    assert!(message.contains("64"), "{message}");
    assert!(message.contains(&tokens.to_string()), "{message}");

    let message = assert_error(
        server
            .post(
                "/generate",
                json!({"inputs": "Hi", "parameters": {"max_new_tokens": 500}}),
            )
            .await,
        422,
        "validation",
    )
    .await;
    assert!(
        message.contains("128") && message.contains("500"),
        "{message}"
    );
    assert_eq!(
        server.fake.counts().started,
        0,
        "nothing invalid reaches the backend"
    );
    server.stop().await;
}

#[tokio::test]
async fn bad_parameters_are_422_naming_the_field() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    let cases = [
        (json!({"temperature": -1.0}), "temperature"),
        (json!({"top_p": 0.0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"top_k": -3}), "top_k"),
        (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
        (json!({"max_new_tokens": 0}), "max_new_tokens"),
        (json!({"top_n_tokens": 50}), "top_n_tokens"),
        (
            json!({"stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}),
            "stop",
        ),
    ];
    for (parameters, field) in cases {
        let response = server
            .post(
                "/generate",
                json!({"inputs": "Hi", "parameters": parameters}),
            )
            .await;
        let message = assert_error(response, 422, "validation").await;
        assert!(message.contains(field), "{field}: {message}");
    }
    let message = assert_error(
        server.post("/generate", json!({"inputs": ""})).await,
        422,
        "validation",
    )
    .await;
    assert!(message.contains("inputs"), "{message}");
    server.stop().await;
}

#[tokio::test]
async fn malformed_bodies_get_json_errors() {
    let server = TestServer::start(config(), FakeScript::default()).await;
    for path in [
        "/generate",
        "/generate_stream",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
    ] {
        let response = server
            .client
            .post(server.url(path))
            .header("content-type", "application/json")
            .body("{\"inputs\": ")
            .send()
            .await
            .unwrap();
        assert_error(response, 400, "bad_request").await;
    }
    // JSON of the wrong shape is a 422 that names what is wrong.
    let message = assert_error(
        server.post("/generate", json!({"input": "Hi"})).await,
        422,
        "validation",
    )
    .await;
    assert!(message.contains("inputs"), "{message}");
    let message = assert_error(
        server
            .post(
                "/generate",
                json!({"inputs": "Hi", "parameters": {"max_new_tokens": "ten"}}),
            )
            .await,
        422,
        "validation",
    )
    .await;
    assert!(message.contains("ten"), "{message}");
    // A body without a JSON content type is still parsed.
    let response = server
        .client
        .post(server.url("/generate"))
        .body("{\"inputs\": \"Hi\", \"parameters\": {\"max_new_tokens\": 1}}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_error(server.get("/nope").await, 404, "not_found").await;
    server.stop().await;
}

#[tokio::test]
async fn a_full_gateway_queues_then_answers_429_once_the_queue_is_full() {
    let mut config = config();
    config.max_concurrent_requests = 2;
    config.max_waiting_requests = 1;
    let server = TestServer::start(config, slow(50)).await;
    let body = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 100}});
    let mut first = server.stream("/generate_stream", body.clone()).await;
    let mut second = server.stream("/generate_stream", body.clone()).await;
    first.next_json().await.unwrap();
    second.next_json().await.unwrap();

    // The third waits in the queue for a slot.
    let short = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 1}});
    let queued = {
        let (url, short) = (server.url("/generate"), short.clone());
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&short)
                .send()
                .await
                .unwrap()
        })
    };
    testkit::wait_until_async("the third request queued", WAIT, || {
        let url = server.url("/info");
        async move {
            let info: serde_json::Value = reqwest::get(url).await.unwrap().json().await.unwrap();
            info["queue"]["waiting_requests"] == 1
        }
    })
    .await;
    // With the queue full, more are refused at once, in each API's shape.
    for path in ["/generate_stream", "/generate"] {
        let started = std::time::Instant::now();
        let message = assert_error(server.post(path, body.clone()).await, 429, "overloaded").await;
        assert!(message.contains("queue"), "{message}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "429 comes at once"
        );
    }
    let response = server
        .post("/v1/completions", json!({"prompt": "Hi", "max_tokens": 1}))
        .await;
    assert_error(response, 429, "overloaded").await;

    // A finished or dropped stream gives its slot back: the queued request runs.
    drop(first);
    server
        .fake
        .wait_for(|c| c.cancelled == 1, WAIT)
        .await
        .expect("the dropped stream is cancelled");
    let response = tokio::time::timeout(WAIT, queued).await.unwrap().unwrap();
    assert_eq!(response.status(), 200);
    drop(second);
    server.stop().await;
}

#[tokio::test]
async fn a_backend_error_mid_stream_becomes_an_error_event_and_ends_the_stream() {
    let script = FakeScript {
        fail_at: Some(2),
        ..FakeScript::default()
    };
    let server = TestServer::start(config(), script).await;
    let events = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 10}}),
        )
        .await
        .collect()
        .await;
    assert_eq!(events.len(), 3, "{events:?}");
    let error: serde_json::Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(error["error_type"], "internal");
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("failed at token 2"),
        "{error}"
    );
    assert_eq!(error.as_object().unwrap().len(), 2);

    // Without streaming, the same failure is a 500.
    let response = server
        .post(
            "/generate",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 10}}),
        )
        .await;
    assert_error(response, 500, "internal").await;
    server.stop().await;
}

#[tokio::test]
async fn a_stream_that_ends_without_finish_reason_is_an_error() {
    let script = FakeScript {
        end_early_at: Some(1),
        ..FakeScript::default()
    };
    let server = TestServer::start(config(), script).await;
    let events = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 10}}),
        )
        .await
        .collect()
        .await;
    assert_eq!(events.len(), 2, "{events:?}");
    let error: serde_json::Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(error["error_type"], "internal");
    assert!(
        error["error"].as_str().unwrap().contains("ended early"),
        "{error}"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_client_disconnect_cancels_the_backend_request() {
    let server = TestServer::start(config(), slow(20)).await;
    let mut reader = server
        .stream(
            "/generate_stream",
            json!({"inputs": "Hi", "parameters": {"max_new_tokens": 100}}),
        )
        .await;
    reader.next_json().await.unwrap();
    assert_eq!(server.fake.counts().active, 1);
    drop(reader);
    let counts = server
        .fake
        .wait_for(|c| c.cancelled == 1 && c.active == 0, WAIT)
        .await
        .expect("the backend sees the cancellation");
    assert_eq!(counts.finished, 0);

    // The same holds for a non-streaming request whose client gives up.
    let request = server
        .client
        .post(server.url("/generate"))
        .json(&json!({"inputs": "Hi", "parameters": {"max_new_tokens": 100}}))
        .timeout(Duration::from_millis(300))
        .send();
    assert!(request.await.is_err(), "the client times out");
    server
        .fake
        .wait_for(|c| c.cancelled == 2 && c.active == 0, WAIT)
        .await
        .expect("the backend sees the second cancellation");
    server.stop().await;
}

#[tokio::test]
async fn the_request_timeout_bounds_the_whole_generation() {
    let mut config = config();
    config.request_timeout_ms = 300;
    let server = TestServer::start(config, slow(50)).await;
    let body = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 100}});
    let events = server
        .stream("/generate_stream", body.clone())
        .await
        .collect()
        .await;
    let error: serde_json::Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(error["error_type"], "timeout", "{events:?}");
    assert!(
        error["error"].as_str().unwrap().contains("300 ms"),
        "{error}"
    );
    assert!(
        events.len() > 1 && events.len() < 10,
        "{} events",
        events.len()
    );

    assert_error(server.post("/generate", body).await, 504, "timeout").await;
    server
        .fake
        .wait_for(|c| c.cancelled == 2 && c.active == 0, WAIT)
        .await
        .expect("timed-out requests are cancelled upstream");
    server.stop().await;
}
