//! fuzz-harness: one function per fuzz target, each taking arbitrary bytes to the code that
//! reads them from an untrusted peer. The libFuzzer targets in `fuzz/fuzz_targets/` are
//! one-line calls into it, and `tests/replay.rs` runs every committed corpus file through the
//! same functions, so CI replays the corpora on stable without a fuzzer.
//!
//! A target panics when, and only when, the code under test broke: it panicked itself, or it
//! answered in a way that breaks an invariant checked here (an HTTP status outside the set the
//! gateway may send for that input, an error body that is not the documented JSON, a request
//! that reached the backend unvalidated, a KV frame that does not survive re-encoding). Every
//! input that the code refuses must come back as an error, never as a panic.
//!
//! The targets drive the real code through its public API: the gateway's axum [`gateway::app`]
//! over its [`gateway::fake::FakeBackend`], with the shared stories260K tokenizer and real
//! models' chat templates (`fixtures/`), `kvtransfer`'s frame decoder, and the `gguf` crate's
//! model file reader. It must not reach
//! into a crate's internals: a target that needs more than the public API asks for a small
//! public entry point in that crate.

mod chat_template;
mod gateway_fixture;
mod gguf_file;
mod http;
mod kv_frame;
mod response;
mod tokenizer;

pub use chat_template::chat_template;
pub use gguf_file::gguf;
pub use http::{chat_request, completions_request, generate_request};
pub use kv_frame::kv_frame;
pub use tokenizer::tokenizer;

/// A fuzz target: arbitrary bytes in, a panic when the code under test misbehaved.
pub type Target = fn(&[u8]);

/// Every target, by the name of its libFuzzer binary and of its corpus directories
/// (`fuzz/corpus/NAME`, `fuzz/regressions/NAME`).
pub const TARGETS: &[(&str, Target)] = &[
    ("http_generate", generate_request),
    ("http_completions", completions_request),
    ("http_chat", chat_request),
    ("chat_template", chat_template),
    ("tokenizer", tokenizer),
    ("kv_frame", kv_frame),
    ("gguf", gguf),
];
