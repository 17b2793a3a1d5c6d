//! Tool calling on `/v1/chat/completions` over the fake backend, whose scripted output stands
//! in for what a model answers, with Qwen2.5's real chat template
//! (`fuzz/harness/fixtures/qwen2.5.json`): `auto` turns a call in the template's format into
//! `tool_calls`, the streamed answer says what the non-streamed one says however the output
//! is split into tokens, `parallel_tool_calls` bounds the calls, the tools reach the prompt, and
//! a backend error mid-stream ends the stream without `[DONE]`.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{config, tokenizer, TestServer};
use gateway::fake::FakeScript;
use gateway::GatewayConfig;
use serde_json::{json, Value};

const EOS: u32 = 2;

fn weather_call(city: &str) -> String {
    format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"{city}\"}}}}\n</tool_call>")
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "Local time",
            "parameters": {"type": "object", "properties": {}}}},
    ])
}

/// A gateway whose model has Qwen2.5's template and limits that fit its tool prompt.
fn qwen_config() -> (tempfile::TempDir, GatewayConfig) {
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/harness/fixtures/qwen2.5.json");
    let qwen: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer_config.json");
    let body =
        json!({"chat_template": qwen["chat_template"], "bos_token": "<s>", "eos_token": "</s>"});
    std::fs::write(&path, body.to_string()).unwrap();
    let mut config = config();
    config.tokenizer_config_path = Some(path);
    config.max_input_tokens = 4000;
    config.max_total_tokens = 8000;
    (dir, config)
}

/// The fake answers `pieces`, one token each, then EOS.
fn script(pieces: &[&str]) -> FakeScript {
    let mut tokens: Vec<(u32, String)> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (100 + i as u32, p.to_string()))
        .collect();
    tokens.push((EOS, String::new()));
    FakeScript {
        tokens,
        ..FakeScript::default()
    }
}

/// `text` cut into tokens of `size` characters.
fn split(text: &str, size: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": tools(),
        "max_tokens": 500,
    });
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body
}

/// What a client makes of an answer: content (`None` when absent or empty), the calls'
/// (id, name, arguments), and the finish reason.
#[derive(Debug, PartialEq)]
struct Answer {
    content: Option<String>,
    calls: Vec<(String, String, String)>,
    finish: String,
}

impl Answer {
    /// Without the call ids, which differ between requests.
    fn without_ids(&self) -> (Option<&str>, Vec<(&str, &str)>, &str) {
        let calls = self
            .calls
            .iter()
            .map(|(_, n, a)| (n.as_str(), a.as_str()))
            .collect();
        (self.content.as_deref(), calls, self.finish.as_str())
    }
}

fn calls_of(entries: &Value) -> Vec<(String, String, String)> {
    entries
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    assert_eq!(c["type"], "function", "{c}");
                    let text = |v: &Value| v.as_str().unwrap().to_string();
                    (
                        text(&c["id"]),
                        text(&c["function"]["name"]),
                        text(&c["function"]["arguments"]),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

async fn non_streamed(server: &TestServer, extra: Value) -> Answer {
    let response = server.post("/v1/chat/completions", request(extra)).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let choice = &body["choices"][0];
    Answer {
        content: choice["message"]["content"]
            .as_str()
            .filter(|c| !c.is_empty())
            .map(str::to_string),
        calls: calls_of(&choice["message"]["tool_calls"]),
        finish: choice["finish_reason"].as_str().unwrap().to_string(),
    }
}

/// The streamed answer assembled as OpenAI's SDK does (deltas of content, and of each call by
/// its `index`), with the stream's chunks. The stream must end with exactly one `[DONE]`.
async fn streamed(server: &TestServer, extra: Value) -> (Answer, Vec<Value>) {
    let mut body = request(extra);
    body["stream"] = json!(true);
    let events = server
        .stream("/v1/chat/completions", body)
        .await
        .collect()
        .await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut content = String::new();
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = None;
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        assert!(finish.is_none(), "a chunk after the finish: {chunks:?}");
        content.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = call["index"].as_u64().unwrap() as usize;
            if calls.len() <= index {
                calls.resize(index + 1, Default::default());
            }
            let entry = &mut calls[index];
            entry.0.push_str(call["id"].as_str().unwrap_or_default());
            entry
                .1
                .push_str(call["function"]["name"].as_str().unwrap_or_default());
            entry
                .2
                .push_str(call["function"]["arguments"].as_str().unwrap_or_default());
        }
        finish = choice["finish_reason"].as_str().map(str::to_string);
    }
    let answer = Answer {
        content: (!content.is_empty()).then_some(content),
        calls,
        finish: finish.unwrap_or_else(|| panic!("no finish_reason: {chunks:?}")),
    };
    (answer, chunks)
}

#[tokio::test]
async fn auto_turns_a_call_into_tool_calls_streaming_and_not() {
    let (_dir, config) = qwen_config();
    let output = weather_call("Paris");
    let pieces = split(&output, 5);
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let server = TestServer::start(config, script(&pieces)).await;
    let auto = json!({"tool_choice": "auto"});

    let plain = non_streamed(&server, auto.clone()).await;
    assert_eq!(plain.finish, "tool_calls", "{plain:?}");
    assert_eq!(plain.content, None, "{plain:?}");
    assert_eq!(plain.calls.len(), 1, "{plain:?}");
    let (_, name, arguments) = &plain.calls[0];
    assert_eq!(name, "get_weather");
    let arguments: Value = serde_json::from_str(arguments).unwrap();
    assert_eq!(arguments, json!({"city": "Paris"}));
    assert!(plain.calls[0].0.starts_with("call_"), "{plain:?}");
    // `auto` is parsed, not forced: no grammar reaches the backend.
    assert!(server.fake.last_request().unwrap().grammar.is_none());

    let (stream, chunks) = streamed(&server, auto).await;
    assert_eq!(stream.without_ids(), plain.without_ids());
    assert!(stream.calls[0].0.starts_with("call_"), "{chunks:?}");
    // The role is on the first chunk, and the calls come whole in one chunk before the
    // finish.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let with_calls: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array())
        .collect();
    assert_eq!(with_calls.len(), 1, "{chunks:?}");
    server.stop().await;
}

#[tokio::test]
async fn the_tools_are_rendered_into_the_prompt() {
    let (_dir, config) = qwen_config();
    let server = TestServer::start(config, script(&["Hi"])).await;
    non_streamed(&server, json!({})).await;
    let prompt_ids = server.fake.last_request().unwrap().prompt_ids;
    let prompt = tokenizer().decode(&prompt_ids, false).unwrap();
    // Qwen2.5's tool section, with each tool as transformers' `tojson` writes it.
    for expected in [
        "# Tools",
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n{\"type\": \"function\", \"function\": {\"name\": \"get_time\"",
        "</tools>",
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n",
    ] {
        assert!(prompt.contains(expected), "{expected:?} not in {prompt:?}");
    }
    // Without tools the template writes no tool section.
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    server
        .post("/v1/chat/completions", body)
        .await
        .error_for_status()
        .unwrap();
    let prompt_ids = server.fake.last_request().unwrap().prompt_ids;
    let prompt = tokenizer().decode(&prompt_ids, false).unwrap();
    assert!(!prompt.contains("<tools>"), "{prompt:?}");
    server.stop().await;
}

/// However the output is cut into tokens, the stream and the non-streamed answer agree on the
/// content, the calls and the finish reason.
#[tokio::test]
async fn streamed_and_non_streamed_answers_agree_however_the_output_is_split() {
    let paris = weather_call("Paris");
    let outputs = [
        // (the output, whether it is calls)
        (format!("Let me check.\n{paris}"), true),
        (format!("\n\n{paris}\n{}", weather_call("Rome")), true),
        (format!("  Hmm, one moment. {paris} and that is all"), true),
        (format!("{paris}\n"), true),
        (
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}".to_string(),
            true,
        ),
        ("Once upon a time, a < b.\n".to_string(), false),
        ("Sure.\n<tool_call>{oops</tool_call>".to_string(), false),
        (
            "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>".to_string(),
            false,
        ),
        ("I would use <tool_cal".to_string(), false),
        ("{\"not\": \"a call\"}".to_string(), false),
    ];
    for (output, is_call) in &outputs {
        for size in [1, 3, 7, output.chars().count()] {
            let (_dir, config) = qwen_config();
            let pieces = split(output, size);
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let server = TestServer::start(config, script(&pieces)).await;
            let plain = non_streamed(&server, json!({"tool_choice": "auto"})).await;
            let (stream, chunks) = streamed(&server, json!({"tool_choice": "auto"})).await;
            let case = format!("{output:?} in tokens of {size}");
            assert_eq!(
                stream.without_ids(),
                plain.without_ids(),
                "{case}: {chunks:?}"
            );
            assert_eq!(plain.finish == "tool_calls", *is_call, "{case}: {plain:?}");
            if !is_call {
                assert_eq!(plain.content.as_deref(), Some(output.as_str()), "{case}");
            }
            server.stop().await;
        }
    }
}

#[tokio::test]
async fn text_before_a_call_streams_at_once() {
    let (_dir, config) = qwen_config();
    let paris = weather_call("Paris");
    let mut pieces = vec!["Let", " me", " check", ".", "\n"];
    pieces.push(&paris);
    let server = TestServer::start(config, script(&pieces)).await;
    let (answer, chunks) = streamed(&server, json!({})).await;
    assert_eq!(
        answer.content.as_deref(),
        Some("Let me check."),
        "{chunks:?}"
    );
    assert_eq!(answer.finish, "tool_calls", "{chunks:?}");
    // One chunk per word, the newline held back and then dropped before the call.
    let contents: Vec<&str> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(contents, ["Let", " me", " check", "."], "{chunks:?}");
    server.stop().await;
}

/// Whether the forced-call grammar the backend was given admits `text` whole.
fn grammar_admits(grammar: &grammar::GrammarSpec, text: &str) -> bool {
    let vocab = grammar::Vocabulary::bytes_only().unwrap();
    let mut constraint = vocab.compile(grammar).unwrap();
    for byte in text.bytes() {
        if !constraint
            .allowed_tokens()
            .unwrap()
            .is_allowed(u32::from(byte))
        {
            return false;
        }
        constraint.accept(u32::from(byte)).unwrap();
    }
    constraint.is_accepting()
}

#[tokio::test]
async fn parallel_tool_calls_bounds_the_calls() {
    let (_dir, config) = qwen_config();
    let output = format!(
        "{}\n{}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>",
        weather_call("Paris"),
        weather_call("Rome")
    );
    let pieces = split(&output, 4);
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let server = TestServer::start(config, script(&pieces)).await;
    let three = [
        ("get_weather", r#"{"city":"Paris"}"#),
        ("get_weather", r#"{"city":"Rome"}"#),
        ("get_time", "{}"),
    ];
    for choice in ["auto", "required"] {
        for parallel in [None, Some(true)] {
            let mut extra = json!({"tool_choice": choice});
            if let Some(parallel) = parallel {
                extra["parallel_tool_calls"] = json!(parallel);
            }
            let plain = non_streamed(&server, extra.clone()).await;
            let (stream, _) = streamed(&server, extra.clone()).await;
            for answer in [&plain, &stream] {
                assert_eq!(
                    answer.without_ids(),
                    (None, three.to_vec(), "tool_calls"),
                    "{extra}"
                );
                let ids: std::collections::HashSet<&String> =
                    answer.calls.iter().map(|c| &c.0).collect();
                assert_eq!(ids.len(), 3, "call ids are unique: {answer:?}");
            }
        }
        let extra = json!({"tool_choice": choice, "parallel_tool_calls": false});
        let plain = non_streamed(&server, extra.clone()).await;
        let (stream, _) = streamed(&server, extra.clone()).await;
        for answer in [&plain, &stream] {
            assert_eq!(
                answer.without_ids(),
                (None, three[..1].to_vec(), "tool_calls"),
                "{extra}"
            );
        }
    }

    // `required`'s grammar (the mask on a real node) admits a list of calls with
    // parallel_tool_calls, and exactly one call object without.
    // (llguidance's JSON is compact: no whitespace between tokens.)
    let one = r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#;
    let two = format!(r#"[{one},{{"name":"get_time","arguments":{{}}}}]"#);
    for (parallel, admits_one, admits_two) in [(true, false, true), (false, true, false)] {
        let extra = json!({"tool_choice": "required", "parallel_tool_calls": parallel});
        non_streamed(&server, extra).await;
        let grammar = server.fake.last_request().unwrap().grammar.unwrap();
        assert_eq!(
            grammar_admits(&grammar, one),
            admits_one,
            "parallel {parallel}"
        );
        assert_eq!(
            grammar_admits(&grammar, &two),
            admits_two,
            "parallel {parallel}"
        );
        assert_eq!(
            grammar_admits(&grammar, &format!("[{one}]")),
            parallel,
            "parallel {parallel}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn call_ids_are_unique_across_choices() {
    let (_dir, config) = qwen_config();
    let output = weather_call("Paris");
    let server = TestServer::start(config, script(&[output.as_str()])).await;
    let body: Value = server
        .post("/v1/chat/completions", request(json!({"n": 3})))
        .await
        .json()
        .await
        .unwrap();
    let ids: std::collections::HashSet<String> = body["choices"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| calls_of(&c["message"]["tool_calls"]))
        .map(|(id, _, _)| id)
        .collect();
    assert_eq!(ids.len(), 3, "{body}");
    server.stop().await;
}

#[tokio::test]
async fn a_backend_error_mid_stream_ends_a_tool_stream_with_an_error_and_no_done() {
    let paris = weather_call("Paris");
    // Failing after a complete call went out (each goes out as it completes), while a call
    // is held, and after text went out as content.
    let half = &paris[..20];
    for (pieces, fail_at, contents_before, calls_before) in [
        (vec![paris.as_str(), "\n", "more"], 1, 0, 1),
        (vec![half, "\n", "more"], 1, 0, 0),
        (vec!["Let", " me", " see", paris.as_str()], 3, 3, 0),
    ] {
        let (_dir, config) = qwen_config();
        let script = FakeScript {
            fail_at: Some(fail_at),
            ..script(&pieces)
        };
        let server = TestServer::start(config, script).await;
        let mut body = request(json!({"stream": true, "stream_options": {"include_usage": true}}));
        body["tool_choice"] = json!("auto");
        let events = server
            .stream("/v1/chat/completions", body)
            .await
            .collect()
            .await;
        assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
        let (last, before) = events.split_last().unwrap();
        let error: Value = serde_json::from_str(last).unwrap();
        assert_eq!(error["error"]["type"], "internal", "{events:?}");
        assert_eq!(error["error"]["code"], "internal", "{events:?}");
        assert!(error["error"]["message"].is_string(), "{error}");
        // Only content and complete calls went out before it: no finish, no usage.
        assert_eq!(before.len(), contents_before + calls_before, "{events:?}");
        for (i, event) in before.iter().enumerate() {
            let chunk: Value = serde_json::from_str(event).unwrap();
            let choice = &chunk["choices"][0];
            if i < contents_before {
                assert!(choice["delta"]["content"].is_string(), "{chunk}");
                assert!(choice["delta"].get("tool_calls").is_none(), "{chunk}");
            } else {
                assert_eq!(
                    choice["delta"]["tool_calls"][0]["function"]["name"],
                    "get_weather"
                );
            }
            assert!(choice["finish_reason"].is_null(), "{chunk}");
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn tgis_client_gets_a_tool_stream_without_done() {
    // `text_generation`'s `Client.chat` sends `model: "tgi"` and cannot parse `[DONE]`.
    let (_dir, config) = qwen_config();
    let output = weather_call("Paris");
    let server = TestServer::start(config, script(&[output.as_str()])).await;
    let body = request(json!({"model": "tgi", "stream": true}));
    let events = server
        .stream("/v1/chat/completions", body)
        .await
        .collect()
        .await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"], "tool_calls",
        "{events:?}"
    );
    server.stop().await;
}

/// Issue 31: with `required` and parallel calls, a model that keeps adding calls runs into
/// max_tokens; its complete calls came back as plain content with `tool_calls: []`, streamed
/// as one content chunk at the end. They are now calls, each streamed as it completes, the
/// cut-off one dropped and the finish reason `length`.
#[tokio::test]
async fn calls_cut_off_by_max_tokens_keep_the_complete_ones() {
    let (_dir, config) = qwen_config();
    let one = r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#;
    let two = r#"{"name":"get_time","arguments":{}}"#;
    let output = format!(r#"[{one},{two},{{"name":"get_weather","arguments":{{"ci"#);
    let pieces = split(&output, 6);
    let max_tokens = pieces.len();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let mut script = script(&pieces);
    script.tokens.pop(); // no EOS: max_tokens ends it
    let server = TestServer::start(config, script).await;
    let extra = json!({"tool_choice": "required", "max_tokens": max_tokens});
    let expected = (
        None,
        vec![("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")],
        "length",
    );
    let plain = non_streamed(&server, extra.clone()).await;
    assert_eq!(plain.without_ids(), expected);
    let (stream, chunks) = streamed(&server, extra).await;
    assert_eq!(stream.without_ids(), expected);
    let with_calls: Vec<usize> = chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c["choices"][0]["delta"]["tool_calls"].is_array())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(with_calls.len(), 2, "one delta per call: {chunks:?}");
    assert!(
        with_calls[1] < chunks.len() - 1,
        "the calls go out as they complete, before the end: {chunks:?}"
    );
    server.stop().await;
}
