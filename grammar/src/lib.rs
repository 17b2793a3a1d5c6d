//! Structured output: what a request's output must match ([`GrammarSpec`]), compiled with
//! llguidance against a model's vocabulary ([`Vocabulary`]) into a per-sequence
//! [`Constraint`] that masks the logits before each draw and advances with each sampled token.
//!
//! The engine applies constraints while sampling; the gateway only checks that a grammar
//! compiles ([`Vocabulary::bytes_only`]), so it needs no model. This crate must not depend on
//! `engine`, `proto` or any networking: it is synchronous and knows only token ids and bytes.

mod constraint;
mod spec;
mod vocab;

pub use constraint::Constraint;
pub use spec::GrammarSpec;
pub use vocab::Vocabulary;

/// Why a grammar could not be compiled or followed.
#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    /// The schema, regex or grammar is not valid (or uses what llguidance does not support).
    #[error("invalid {kind}: {message}")]
    Invalid { kind: &'static str, message: String },
    /// The grammar compiles but matches no text at all (a regex like `[^\s\S]`): nothing
    /// could ever be generated under it.
    #[error("the {kind} matches no text, so no output can follow it")]
    Empty { kind: &'static str },
    /// The tokenizer's vocabulary could not be turned into bytes per token.
    #[error("unsupported tokenizer: {0}")]
    Tokenizer(String),
    /// The matcher failed while computing a mask or consuming a token (a token outside the
    /// mask was forced on it, or a parser limit was hit).
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
}

pub type Result<T> = std::result::Result<T, GrammarError>;
