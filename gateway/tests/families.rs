//! Chat completions of the model families the engine serves (issue 32), over the fake backend
//! with each family's real chat template (`tests/fixtures/templates/`): Qwen3's `<think>` block
//! comes back as `reasoning_content` and its `<tool_call>` blocks as calls, Mistral's
//! `[TOOL_CALLS]` in both its forms, Phi-4-mini's `<|tool_call|>` lists, and Gemma 3's bare or
//! fenced JSON. Streamed and non-streamed answers agree however the output is cut into tokens,
//! and no marker leaks into a stream's content.
//!
//! The tokenizer is stories260K's with the families' markers added as tokens, special where
//! the real tokenizers have them special (`[TOOL_CALLS]`, `<|tool_call|>`): the engine decodes
//! those to empty text, as the fake's script does here, and the gateway reads them by id.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;

use common::{config, tokenizer, TestServer};
use gateway::fake::FakeScript;
use gateway::GatewayConfig;
use serde_json::{json, Value};
use tokenizers::AddedToken;

const EOS: u32 = 2;
const SPECIAL: [&str; 5] = [
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|tool_call|>",
    "<|/tool_call|>",
];
const PLAIN: [&str; 4] = ["<think>", "</think>", "<tool_call>", "</tool_call>"];

/// A gateway serving `template` (a fixture's name) with the marker-bearing tokenizer.
fn family_config(template: &str) -> (tempfile::TempDir, GatewayConfig) {
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_with_markers();
    let tokenizer_path = dir.path().join("tokenizer.json");
    tok.save(&tokenizer_path, false).unwrap();
    let source = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join(format!("tests/fixtures/templates/{template}.jinja")),
    )
    .unwrap();
    let path = dir.path().join("tokenizer_config.json");
    let body = json!({"chat_template": source, "bos_token": "<s>", "eos_token": "</s>"});
    std::fs::write(&path, body.to_string()).unwrap();
    let mut config = config();
    config.tokenizer_path = tokenizer_path;
    config.tokenizer_config_path = Some(path);
    config.max_input_tokens = 6000;
    config.max_total_tokens = 8000;
    (dir, config)
}

/// `output` as the engine would stream it: each marker one token (with empty text when it is
/// special), the text between cut into tokens of `size` characters; then EOS.
fn script(output: &str, size: usize) -> FakeScript {
    let augmented = tokenizer_with_markers();
    let markers: Vec<&str> = SPECIAL.iter().chain(PLAIN.iter()).copied().collect();
    let mut tokens = Vec::new();
    let mut rest = output;
    while !rest.is_empty() {
        let next = markers
            .iter()
            .filter_map(|m| rest.find(m).map(|at| (at, *m)))
            .min();
        let (text, marker) = match next {
            Some((0, marker)) => ("", Some(marker)),
            Some((at, _)) => (&rest[..at], None),
            None => (rest, None),
        };
        if let Some(marker) = marker {
            let id = augmented.token_to_id(marker).unwrap();
            let text = if SPECIAL.contains(&marker) {
                ""
            } else {
                marker
            };
            tokens.push((id, text.to_string()));
            rest = &rest[marker.len()..];
            continue;
        }
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(size) {
            tokens.push((100, piece.iter().collect()));
        }
        rest = &rest[text.len()..];
    }
    tokens.push((EOS, String::new()));
    FakeScript {
        tokens,
        ..FakeScript::default()
    }
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

fn request(with_tools: bool, stream: bool) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 1000,
        "stream": stream,
    });
    if with_tools {
        body["tools"] = tools();
    }
    body
}

/// What a client makes of an answer.
#[derive(Debug, PartialEq)]
struct Answer {
    reasoning: Option<String>,
    content: Option<String>,
    /// (name, arguments as JSON)
    calls: Vec<(String, Value)>,
    ids: Vec<String>,
    finish: String,
}

impl Answer {
    fn same_as(&self, other: &Answer) -> bool {
        (&self.reasoning, &self.content, &self.calls, &self.finish)
            == (
                &other.reasoning,
                &other.content,
                &other.calls,
                &other.finish,
            )
    }
}

fn nonempty(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_string)
}

async fn non_streamed(server: &TestServer, with_tools: bool) -> Answer {
    let response = server
        .post("/v1/chat/completions", request(with_tools, false))
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let choice = &body["choices"][0];
    let calls = choice["message"]["tool_calls"].as_array().cloned();
    let calls = calls.unwrap_or_default();
    Answer {
        reasoning: nonempty(&choice["message"]["reasoning_content"]),
        content: nonempty(&choice["message"]["content"]),
        calls: calls
            .iter()
            .map(|c| {
                let args = c["function"]["arguments"].as_str().unwrap();
                (
                    c["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(args).unwrap(),
                )
            })
            .collect(),
        ids: calls
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect(),
        finish: choice["finish_reason"].as_str().unwrap().to_string(),
    }
}

/// The streamed answer assembled as OpenAI's SDK does, and the stream's chunks.
async fn streamed(server: &TestServer, with_tools: bool) -> (Answer, Vec<Value>) {
    let events = server
        .stream("/v1/chat/completions", request(with_tools, true))
        .await
        .collect()
        .await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut finish = None;
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        content.push_str(delta["content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if calls.len() <= index {
                calls.resize(index + 1, Default::default());
            }
            let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
            calls[index].0.push_str(&text(&call["id"]));
            calls[index].1.push_str(&text(&call["function"]["name"]));
            calls[index]
                .2
                .push_str(&text(&call["function"]["arguments"]));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    let answer = Answer {
        reasoning: Some(reasoning).filter(|r| !r.is_empty()),
        content: Some(content).filter(|c| !c.is_empty()),
        calls: calls
            .iter()
            .map(|(_, n, a)| (n.clone(), serde_json::from_str(a).unwrap()))
            .collect(),
        ids: calls.iter().map(|(id, _, _)| id.clone()).collect(),
        finish: finish.unwrap(),
    };
    (answer, chunks)
}

/// Serves `output` with `template` in tokens of several sizes, and checks that the streamed
/// and the whole answer both equal `expected` and no marker reaches a stream's content.
async fn check(template: &str, output: &str, with_tools: bool, expected: &Answer) {
    for size in [1, 2, 5, output.len()] {
        let (_dir, config) = family_config(template);
        let server = TestServer::start(config, script(output, size)).await;
        let case = format!("{template}: {output:?} in tokens of {size}");
        let whole = non_streamed(&server, with_tools).await;
        assert!(whole.same_as(expected), "{case}: {whole:?}");
        let (stream, chunks) = streamed(&server, with_tools).await;
        assert!(stream.same_as(expected), "{case}: {stream:?} {chunks:?}");
        assert_eq!(stream.ids.len(), whole.ids.len(), "{case}");
        for chunk in &chunks {
            let content = chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default();
            for marker in SPECIAL.iter().chain(&PLAIN) {
                assert!(!content.contains(marker), "{case}: {marker} in {chunk}");
            }
        }
        server.stop().await;
    }
}

fn answer(
    reasoning: Option<&str>,
    content: Option<&str>,
    calls: &[(&str, Value)],
    finish: &str,
) -> Answer {
    Answer {
        reasoning: reasoning.map(str::to_string),
        content: content.map(str::to_string),
        calls: calls
            .iter()
            .map(|(n, a)| (n.to_string(), a.clone()))
            .collect(),
        ids: Vec::new(),
        finish: finish.to_string(),
    }
}

#[tokio::test]
async fn qwen3_thinks_then_answers_or_calls() {
    let paris = json!({"city": "Paris"});
    let think = "<think>\nThe user wants the weather; I should call get_weather.\n</think>\n\n";
    let thought = Some("The user wants the weather; I should call get_weather.");
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    check(
        "qwen3",
        &format!("{think}{call}"),
        true,
        &answer(
            thought,
            None,
            &[("get_weather", paris.clone())],
            "tool_calls",
        ),
    )
    .await;
    check(
        "qwen3",
        &format!("{think}Let me look.\n{call}"),
        true,
        &answer(
            thought,
            Some("Let me look."),
            &[("get_weather", paris)],
            "tool_calls",
        ),
    )
    .await;
    // Without tools: reasoning and content, on the plain streaming path.
    check(
        "qwen3",
        &format!("{think}It is sunny."),
        false,
        &answer(thought, Some("It is sunny."), &[], "stop"),
    )
    .await;
    // No block at all: content only.
    check(
        "qwen3",
        "It is sunny.",
        true,
        &answer(None, Some("It is sunny."), &[], "stop"),
    )
    .await;
}

#[tokio::test]
async fn mistral_tool_calls_in_both_forms_with_ids_its_templates_take_back() {
    let expected = answer(
        None,
        None,
        &[
            ("get_weather", json!({"city": "Paris"})),
            ("get_time", json!({})),
        ],
        "tool_calls",
    );
    let list = r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]"#;
    check("mistral-nemo", list, true, &expected).await;
    let named = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}"#;
    check("mistral-small-3.2", named, true, &expected).await;

    // The answer goes back as the next request's history: Mistral's templates refuse call ids
    // that are not 9 letters and digits.
    for (template, output) in [("mistral-nemo", list), ("mistral-small-3.2", named)] {
        let (_dir, config) = family_config(template);
        let server = TestServer::start(config, script(output, 3)).await;
        let first = non_streamed(&server, true).await;
        let history = json!({
            "messages": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": first.ids[0], "type": "function", "function": {
                        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": first.ids[0], "content": "18"},
            ],
            "tools": tools(),
            "max_tokens": 10,
        });
        let response = server.post("/v1/chat/completions", history).await;
        assert_eq!(response.status(), 200, "{template}: {first:?}");
        let prompt = server.fake.last_request().unwrap().prompt_ids;
        let prompt = tokenizer_with_markers().decode(&prompt, false).unwrap();
        assert!(prompt.contains(&first.ids[0]), "{prompt}");
        server.stop().await;
    }
}

fn tokenizer_with_markers() -> tokenizers::Tokenizer {
    let mut tok = tokenizer();
    tok.add_special_tokens(SPECIAL.map(|s| AddedToken::from(s, true)))
        .unwrap();
    tok.add_tokens(PLAIN.map(|s| AddedToken::from(s, false)))
        .unwrap();
    tok
}

#[tokio::test]
async fn phi_4_mini_calls_and_its_tools_in_the_system_turn() {
    let expected = answer(
        None,
        None,
        &[("get_weather", json!({"city": "Paris"}))],
        "tool_calls",
    );
    for output in [
        r#"<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>"#,
        r#"<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
    ] {
        check("phi-4-mini", output, true, &expected).await;
    }
    let (_dir, config) = family_config("phi-4-mini");
    let server = TestServer::start(config, script("Hi", 1)).await;
    non_streamed(&server, true).await;
    let prompt = server.fake.last_request().unwrap().prompt_ids;
    let prompt = tokenizer_with_markers().decode(&prompt, false).unwrap();
    assert!(
        prompt.starts_with(
            "<|system|>You are a helpful assistant with some tools.<|tool|>[{\"name\": \"get_weather\""
        ),
        "{prompt}"
    );
    server.stop().await;
}

#[tokio::test]
async fn gemma_3_calls_in_bare_or_fenced_json() {
    let expected = answer(
        None,
        None,
        &[("get_weather", json!({"city": "Paris"}))],
        "tool_calls",
    );
    for output in [
        r#"[{"name": "get_weather", "arguments": {"city": "Paris"}}]"#,
        "```json\n[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]\n```",
        "```tool_code\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
    ] {
        check("gemma-3", output, true, &expected).await;
    }
    check(
        "gemma-3",
        "`x` is a variable.",
        true,
        &answer(None, Some("`x` is a variable."), &[], "stop"),
    )
    .await;
}

/// Issues 32, 33: before any node reports, `/info` and `/v1/models` name the architecture from
/// the gateway's own config.json (stories260K's, beside its tokenizer), the types unknown.
#[tokio::test]
async fn info_and_models_name_the_architecture() {
    let server = TestServer::start(config(), script("Hi", 1)).await;
    let info: Value = server.get("/info").await.json().await.unwrap();
    assert_eq!(info["architecture"], "LlamaForCausalLM", "{info}");
    assert!(
        info["weight_dtype"].is_null() && info["kv_cache_dtype"].is_null(),
        "{info}"
    );
    let models: Value = server.get("/v1/models").await.json().await.unwrap();
    assert_eq!(
        models["data"][0]["architecture"], "LlamaForCausalLM",
        "{models}"
    );
    server.stop().await;
}
