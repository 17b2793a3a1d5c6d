//! Structured output and tool calling on real clusters (`fission up`), through real clients.
//!
//! - 100 seeded requests with a JSON schema, 8 at a time, through OpenAI's Python SDK: every
//!   output validates against the schema (Python's `jsonschema`).
//! - `response_format: {"type": "json_object"}` on completions, and a `json_schema` on chat
//!   completions (streaming and not, through the embedded model's chat template), through the
//!   SDK: every chat output parses (`json.loads`) and validates, and every `json_object` output
//!   is an object, or the start of one where max_tokens cut it.
//! - A seeded constrained request gives the same output alone, in a batch, disaggregated
//!   (prefill node + decode node) and colocated (prefill on the decode node).
//! - TGI's `grammar` (regex and JSON) on `/generate`, and TGI's `response_format` spelling
//!   (`{"type": "json_object", "value": schema}`) on chat; a bad schema, or a grammar that
//!   matches no text, is a 4xx naming the field.
//! - Tool calls through the SDK's tools API on a random Qwen2-architecture model carrying
//!   Qwen2.5's real chat template (`fuzz/harness/fixtures/qwen2.5.json`: the `chat_template` of
//!   Qwen/Qwen2.5-Instruct's `tokenizer_config.json`, Apache-2.0, by the Qwen team).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
            "happy": {"type": "boolean"}
        },
        "required": ["name", "age", "pets", "happy"],
        "additionalProperties": false
    })
}

/// The embedded default model: stories260K (the shared copy's weights and tokenizer) with its
/// stand-in chat template, so that the chat route serves it.
fn embedded_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("default-model/stories260K")
}

fn python() -> Option<PathBuf> {
    testkit::python::venv_python_with(&["openai", "jsonschema"])
}

fn run_script(python: &Path, script: &str, args: &[&str]) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/structured")
        .join(script);
    testkit::python::run_json(python, testkit::python::Script::File(&path), args)
}

async fn post(client: &reqwest::Client, up: &Up, path: &str, body: Value) -> (u16, Value) {
    let response = client
        .post(format!("{}{path}", up.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// A seeded completion under the schema; its text.
async fn seeded(client: &reqwest::Client, up: &Up, seed: u64) -> String {
    let (status, body) = post(
        client,
        up,
        "/v1/completions",
        json!({
            "prompt": "Once upon a time",
            "max_tokens": 200,
            "temperature": 1.0,
            "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema()}},
        }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The seeded output of seed 7, alone and amid a batch of others (some unconstrained).
async fn alone_and_batched(up: &Up) -> String {
    let client = reqwest::Client::new();
    let alone = seeded(&client, up, 7).await;
    let free = |seed: u64| {
        let client = client.clone();
        let url = format!("{}/v1/completions", up.url);
        async move {
            client
                .post(url)
                .json(&json!({"prompt": "The cat", "max_tokens": 40, "temperature": 1.0, "seed": seed}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let (a, b, c, d, e) = tokio::join!(
        seeded(&client, up, 7),
        seeded(&client, up, 8),
        free(1),
        seeded(&client, up, 9),
        free(2),
    );
    assert_eq!(a, alone, "seed 7 alone vs in a batch");
    for other in [b, d] {
        serde_json::from_str::<Value>(&other).unwrap_or_else(|e| panic!("{other:?}: {e}"));
    }
    assert!(c.is_success() && e.is_success());
    alone
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_outputs_validate_and_are_deterministic_everywhere() {
    let python = python();
    let _serial = SERIAL.lock().await;
    let client = reqwest::Client::new();

    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = embedded_model();
    let disaggregated = Up::start(&config);
    if let Some(python) = &python {
        let url = format!("{}/v1", disaggregated.url);
        let result = run_script(python, "schema_sdk.py", &[&url, &schema().to_string()]);
        assert_eq!(result["invalid"], json!([]), "{result}");
        assert_eq!(result["outputs"].as_array().unwrap().len(), 100);
        // The grammar's end ends every output: none runs into max_tokens.
        assert_eq!(result["finish"], json!({"stop": 100}), "{result}");

        let count = 16;
        let result = run_script(
            python,
            "formats_sdk.py",
            &[&url, &schema().to_string(), &count.to_string()],
        );
        for format in ["json_object", "chat"] {
            let found = &result[format];
            assert_eq!(found["invalid"], json!([]), "{format}: {found}");
            assert_eq!(
                found["outputs"].as_array().unwrap().len(),
                count,
                "{format}"
            );
        }
        // The schema's bounds end every chat output; a free-form object may run into
        // max_tokens (the script checks such an output is the start of an object).
        assert_eq!(result["chat"]["finish"], json!({"stop": count}), "{result}");
        let finish = result["json_object"]["finish"].as_object().unwrap();
        let ended: u64 = ["stop", "length"]
            .iter()
            .filter_map(|reason| finish.get(*reason).and_then(Value::as_u64))
            .sum();
        assert_eq!(ended, count as u64, "{result}");
    }
    let disaggregated_text = alone_and_batched(&disaggregated).await;
    let parsed: Value = serde_json::from_str(&disaggregated_text).unwrap();
    assert!(parsed["name"].is_string(), "{parsed}");

    // TGI's grammar parameter: a regex and a JSON schema.
    let (status, body) = post(
        &client,
        &disaggregated,
        "/generate",
        json!({"inputs": "Once upon a time", "parameters": {
            "max_new_tokens": 20, "grammar": {"type": "regex", "value": "(yes|no), [a-z]{2,6}!"}}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let text = body["generated_text"]
        .as_str()
        .unwrap()
        .trim_start()
        .to_string();
    assert!(
        (text.starts_with("yes, ") || text.starts_with("no, ")) && text.ends_with('!'),
        "{text:?}"
    );
    let (status, body) = post(
        &client,
        &disaggregated,
        "/generate",
        json!({"inputs": "Once upon a time", "parameters": {
            "max_new_tokens": 200, "do_sample": true, "seed": 3,
            "grammar": {"type": "json", "value": schema()}}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let generated: Value = serde_json::from_str(body["generated_text"].as_str().unwrap()).unwrap();
    assert!(generated["age"].as_u64().unwrap() <= 120, "{generated}");

    // TGI's `response_format` spelling (huggingface_hub's InferenceClient sends it) is held
    // to its schema, not just to "some JSON object" (issue 31).
    let (status, body) = post(
        &client,
        &disaggregated,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 200, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_object", "value": schema()}}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let generated: Value = serde_json::from_str(content).unwrap();
    let mut keys: Vec<&String> = generated.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["age", "happy", "name", "pets"], "{generated}");
    assert!(generated["age"].as_u64().unwrap() <= 120, "{generated}");

    // A schema that cannot compile, or a grammar that matches no text (which a node could
    // only break), is refused up front, naming the field.
    for (path, body, field) in [
        (
            "/generate",
            json!({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": r"[^\s\S]"}}}),
            "grammar",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": 5}}}}),
            "response_format",
        ),
        (
            "/generate",
            json!({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(unclosed"}}}),
            "grammar",
        ),
    ] {
        let (status, body) = post(&client, &disaggregated, path, body).await;
        assert!((400..500).contains(&status), "{path}: {status} {body}");
        assert!(body.to_string().contains(field), "{path}: {body}");
    }
    drop(disaggregated);

    // Colocated: the decode node prefills every prompt itself.
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = embedded_model();
    config.args = vec!["--max-local-prefill-tokens=100000".into()];
    let colocated = Up::start(&config);
    assert_eq!(
        alone_and_batched(&colocated).await,
        disaggregated_text,
        "colocated vs disaggregated"
    );
}

/// A tiny random Qwen2-architecture model (attention biases, stories260K's tokenizer) whose
/// `tokenizer_config.json` carries Qwen2.5's chat template.
fn qwen_shaped_model(dir: &Path) {
    let spec = random_model::ModelSpec {
        architecture: random_model::Architecture::Qwen2,
        attention_bias: true,
        max_pos: 4096,
        ..random_model::ModelSpec::tiny()
    };
    random_model::write_model(dir, &spec, &testkit::fission::stories_dir()).unwrap();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/harness/fixtures/qwen2.5.json");
    let qwen: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let config = json!({
        "chat_template": qwen["chat_template"],
        "bos_token": "<s>",
        "eos_token": "</s>",
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_through_the_openai_sdk() {
    let Some(python) = python() else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let model = tempfile::tempdir().unwrap();
    qwen_shaped_model(model.path());
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = model.path().to_path_buf();
    let up = Up::start(&config);
    let result = run_script(&python, "tools_sdk.py", &[&format!("{}/v1", up.url)]);
    assert_eq!(result["named_and_required"], "ok", "{result}");
    assert_eq!(result["stream_matches"], true, "{result}");
    let auto = &result["auto"];
    assert_eq!(
        auto["calls"].as_u64().unwrap() + auto["text"].as_u64().unwrap(),
        8,
        "{result}"
    );
    assert!(result["none_has_no_calls"].as_bool().unwrap(), "{result}");
    assert!(result["second_turn_finish"].is_string(), "{result}");
}
