//! Arbitrary bytes through the gateway's tokenizer call path: `/tokenize` (the same
//! `encode_char_offsets` that validation runs on every prompt), then decoding the ids back, as
//! the gateway does for top tokens.
//!
//! Input: the text, as bytes; invalid UTF-8 becomes U+FFFD, as a JSON client would have to send it.

use std::sync::LazyLock;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::gateway_fixture::request;
use crate::gateway_fixture::{stories_tokenizer, TestGateway};

static GATEWAY: LazyLock<TestGateway> = LazyLock::new(|| {
    TestGateway::new(|config| {
        // Escaped control characters make the JSON up to six times the text.
        config.max_body_bytes = 1 << 20;
        // /tokenize holds prompts to the input limit: one far above what libFuzzer's inputs
        // make keeps the offsets checked on every input, not only the short ones.
        config.max_input_tokens = 1 << 16;
        config.max_total_tokens = (1 << 16) + 1;
    })
});

static TOKENIZER: LazyLock<Tokenizer> = LazyLock::new(|| {
    let path = stories_tokenizer();
    Tokenizer::from_file(&path)
        .unwrap_or_else(|e| panic!("the tokenizer {} loads: {e}", path.display()))
});

pub fn tokenizer(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let chars = text.chars().count();
    let body = json!({ "inputs": text }).to_string();
    let exchange = GATEWAY.send(request("/tokenize", 0, body.into_bytes()));
    if exchange.status == StatusCode::UNPROCESSABLE_ENTITY {
        // Only the input limit may refuse text, and then it says so.
        assert!(
            exchange.body_text().contains("must have at most"),
            "/tokenize refused text for another reason: {}",
            exchange.body_text()
        );
        return;
    }
    assert_eq!(
        exchange.status,
        StatusCode::OK,
        "/tokenize refused text: {}",
        exchange.body_text()
    );
    let tokens: Vec<Value> = serde_json::from_slice(&exchange.body)
        .unwrap_or_else(|e| panic!("/tokenize answered no token list ({e})"));
    let vocab = TOKENIZER.get_vocab_size(true);
    let mut ids = Vec::with_capacity(tokens.len());
    for token in &tokens {
        let field = |name: &str| {
            token[name]
                .as_u64()
                .unwrap_or_else(|| panic!("/tokenize: a token without {name}: {token}"))
                as usize
        };
        let (id, start, stop) = (field("id"), field("start"), field("stop"));
        assert!(id < vocab, "/tokenize: id {id} outside the vocabulary");
        assert!(
            start <= stop && stop <= chars,
            "/tokenize: offsets {start}..{stop} outside the {chars}-character input"
        );
        ids.push(u32::try_from(id).expect("checked below the vocabulary size"));
    }
    assert_eq!(
        ids.first(),
        Some(&1),
        "/tokenize adds BOS first, as validation does"
    );
    TOKENIZER
        .decode(&ids, false)
        .unwrap_or_else(|e| panic!("ids the tokenizer made do not decode: {e}"));
}
