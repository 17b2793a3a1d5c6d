//! Untrusted chat messages through real models' chat templates (`fixtures/*.json`, each the
//! `chat_template`, `bos_token` and `eos_token` of that model's `tokenizer_config.json`), via
//! `/v1/chat/completions`: the messages are always well-formed JSON, so every input reaches the
//! template and the tokenizer.
//!
//! Input: one mode byte, then messages separated by 0x1E (record separator), each `role:content`
//! (no `:` makes it a user message). Mode bits 0-2 pick the template (modulo their number); bit
//! 3 sends each content as a list of two text parts instead of a string.

use std::path::PathBuf;
use std::sync::LazyLock;

use gateway::GatewayConfig;
use serde_json::{json, Value};

use crate::gateway_fixture::{request, TestGateway};
use crate::response::{self, Body};

const PATH: &str = "/v1/chat/completions";

/// `(fixture, raises)`: whether the template calls `raise_exception` on some conversations.
const TEMPLATES: [(&str, bool); 5] = [
    ("smollm2", false),
    ("llama2", true),
    ("mistral", true),
    ("gemma", true),
    ("qwen2.5", false),
];

/// More messages add nothing a fuzzer can find and slow each run down.
const MAX_MESSAGES: usize = 32;

static GATEWAYS: LazyLock<Vec<TestGateway>> = LazyLock::new(|| {
    TEMPLATES
        .iter()
        .map(|(name, _)| TestGateway::new(|config| chat_config(config, name)))
        .collect()
});

/// The template `name`, with room for its own text: SmolLM2's default system prompt alone is
/// over 100 stories260K tokens.
pub(crate) fn chat_config(config: &mut GatewayConfig, name: &str) {
    config.tokenizer_config_path = Some(fixture(name));
    config.max_input_tokens = 512;
    config.max_total_tokens = 576;
    config.max_body_bytes = 1 << 20;
}

/// The `tokenizer_config.json` of the fixture `name`.
pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures")).join(format!("{name}.json"))
}

pub fn chat_template(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let index = usize::from(mode & 7) % TEMPLATES.len();
    let (name, raises) = TEMPLATES[index];
    let as_parts = mode & 8 != 0;
    let messages: Vec<Value> = rest
        .split(|&b| b == 0x1E)
        .take(MAX_MESSAGES)
        .map(|record| message(record, as_parts))
        .collect();
    let body = json!({"messages": messages, "max_tokens": 1}).to_string();
    let gateway = &GATEWAYS[index];
    let exchange = gateway.send(request(PATH, 0, body.into_bytes()));
    // The body is valid JSON of the right shape: only validation can refuse it.
    // (OpenAI's routes answer it with 400.)
    let answer = response::check(PATH, &exchange, &[200, 400]);
    if let Some(generated) = &exchange.generated {
        response::check_generation(PATH, &answer, generated, exchange.sequences, gateway);
    }
    if let (false, Body::Json(body)) = (raises, &answer) {
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.starts_with("chat template"),
            "{name}'s template never raises, yet untrusted messages broke it: {message}"
        );
    }
}

/// One message from `role:content`.
fn message(record: &[u8], as_parts: bool) -> Value {
    let record = String::from_utf8_lossy(record);
    let (role, content) = record.split_once(':').unwrap_or(("user", &record));
    let content = if as_parts {
        let middle = (0..=content.len() / 2)
            .rev()
            .find(|&i| content.is_char_boundary(i))
            .unwrap_or(0);
        let (first, second) = content.split_at(middle);
        json!([{"type": "text", "text": first}, {"type": "text", "text": second}])
    } else {
        json!(content)
    };
    json!({"role": role, "content": content})
}
