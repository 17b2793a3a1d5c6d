//! What the gateway hands a [`crate::Backend`] and what it gets back. Plain data: no HTTP, no
//! engine types, so a backend can live anywhere.

use std::pin::Pin;
use std::time::Instant;

use futures::Stream;

use crate::error::GatewayError;

pub use crate::request_id::RequestId;

/// How the next token is chosen. Validated: every field is in range.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// `>= 0`; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// In `(0, 1]`; 1 turns it off.
    pub top_p: f32,
    /// `> 0`; 1 turns it off.
    pub repetition_penalty: f32,
    /// Always set: the gateway picks a random seed when the request gives none, so a retry of the
    /// same `ValidRequest` on another node draws the same tokens.
    pub seed: u64,
    /// Alternatives to report per token (`GeneratedToken::top_logprobs`); 0 for none.
    pub top_n_logprobs: usize,
}

/// When generation ends. Validated: `max_new_tokens >= 1` and fits in the model's context.
#[derive(Debug, Clone, PartialEq)]
pub struct StoppingParams {
    pub max_new_tokens: usize,
    /// The model's EOS ids.
    pub stop_token_ids: Vec<u32>,
    /// None empty. The backend matches them on the decoded text, and the text of the tokens it
    /// returns stops right before the match: the stop string itself is not returned.
    pub stop_strings: Vec<String>,
    /// Generate through stop tokens up to `max_new_tokens` (benchmarks).
    pub ignore_eos: bool,
}

/// A request that passed validation: tokenized, with every parameter resolved and in range.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub request_id: RequestId,
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub stopping: StoppingParams,
    /// What the output must match (structured output, forced tool calls); checked to compile.
    pub grammar: Option<grammar::GrammarSpec>,
    /// Report the prompt tokens' logprobs with the first token (TGI's
    /// `decoder_input_details`); the node that prefills computes them.
    pub prompt_logprobs: bool,
    /// When the HTTP request arrived; latency metrics and the request timeout count from here.
    pub received_at: Instant,
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` were generated.
    Length,
    /// A stop token (the model's EOS) was generated.
    Eos,
    /// A stop string appeared in the output.
    Stop,
}

impl FinishReason {
    /// TGI's name: `length`, `eos_token`, `stop_sequence`.
    pub fn as_tgi_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Eos => "eos_token",
            Self::Stop => "stop_sequence",
        }
    }

    /// OpenAI's name: `length` or `stop`.
    pub fn as_openai_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Eos | Self::Stop => "stop",
        }
    }
}

/// One generated token, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedToken {
    pub id: u32,
    /// The text this token adds to the output (incrementally detokenized; may be empty while a
    /// character is incomplete, and is empty for special tokens). The concatenation of every
    /// token's `text` is the generated text.
    pub text: String,
    pub logprob: f32,
    /// The `top_n_logprobs` most likely `(token_id, logprob)`, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// 0 for the first generated token.
    pub index: usize,
    /// Set on the last token, and only there. A stream that ends without one failed.
    pub finish_reason: Option<FinishReason>,
    /// On the first token when the request asked for them: the logprob of prompt token
    /// `i + 1` given the ones before it, for each `i`.
    pub prompt_logprobs: Vec<f32>,
}

/// The tokens of one request, as the backend produces them. It ends after the token that carries
/// a `finish_reason`, or after an `Err`. Dropping it cancels the request upstream.
pub type TokenStream = Pin<Box<dyn Stream<Item = Result<GeneratedToken, GatewayError>> + Send>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_use_each_api_names() {
        assert_eq!(FinishReason::Eos.as_tgi_str(), "eos_token");
        assert_eq!(FinishReason::Stop.as_tgi_str(), "stop_sequence");
        assert_eq!(FinishReason::Eos.as_openai_str(), "stop");
        assert_eq!(FinishReason::Length.as_openai_str(), "length");
    }
}
