//! The generation endpoints with arbitrary bodies: `/generate` (and `/generate_stream`),
//! `/v1/completions` and `/v1/chat/completions`, each through the whole router (the body
//! limit, JSON parsing, the API's request shape, validation and tokenization, admission, the
//! response).
//!
//! Input: one mode byte, then the request body as sent. The mode's low bits pick how the body
//! arrives, so the corpus files stay readable with an ASCII digit in front (`'0'` = 0x30):
//! - bit 0: chunked (no `Content-Length`, no size hint), instead of a declared length;
//! - bit 1: no `Content-Type`, as `curl -d` clients send form-encoded JSON;
//! - bit 2: `/generate_stream` instead of `/generate` (OpenAI requests stream with `"stream"`).

use std::sync::LazyLock;

use crate::chat_template;
use crate::gateway_fixture::{request, TestGateway, MAX_BODY_BYTES};
use crate::response::{self, CONTENT_STATUSES};

// One gateway per target, so that targets replayed on parallel test threads do not see each
// other's generations in the fake backend's counts.
static GENERATE: LazyLock<TestGateway> = LazyLock::new(|| TestGateway::new(|_| {}));
static COMPLETIONS: LazyLock<TestGateway> = LazyLock::new(|| TestGateway::new(|_| {}));
static CHAT: LazyLock<TestGateway> = LazyLock::new(|| {
    TestGateway::new(|config| {
        chat_template::chat_config(config, "smollm2");
        config.max_body_bytes = MAX_BODY_BYTES;
    })
});

/// TGI's `/generate`, or `/generate_stream` with mode bit 2.
pub fn generate_request(data: &[u8]) {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let path = if mode & 4 == 0 {
        "/generate"
    } else {
        "/generate_stream"
    };
    post(&GENERATE, path, mode, body);
}

/// OpenAI's `/v1/completions`.
pub fn completions_request(data: &[u8]) {
    if let Some((&mode, body)) = data.split_first() {
        post(&COMPLETIONS, "/v1/completions", mode, body);
    }
}

/// OpenAI's `/v1/chat/completions`, with SmolLM2's chat template.
pub fn chat_request(data: &[u8]) {
    if let Some((&mode, body)) = data.split_first() {
        post(&CHAT, "/v1/chat/completions", mode, body);
    }
}

fn post(gateway: &TestGateway, path: &str, mode: u8, body: &[u8]) {
    let exchange = gateway.send(request(path, mode, body.to_vec()));
    let answer = response::check(path, &exchange, CONTENT_STATUSES);
    if let Some(generated) = &exchange.generated {
        response::check_generation(path, &answer, generated, exchange.sequences, gateway);
    }
}
