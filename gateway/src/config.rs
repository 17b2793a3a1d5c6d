//! The gateway's settings: the model's files and the limits every request is validated against.

use std::path::PathBuf;

use crate::auth::AuthConfig;
use crate::error::GatewayError;

/// Everything the gateway needs to know before it serves. The binary fills it from flags, whose
/// defaults are [`GatewayConfig::default`]'s; tests start from [`GatewayConfig::new`] and
/// override fields.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The model's name, reported by `/info` and `/v1/models` and echoed in OpenAI responses.
    pub model_id: String,
    /// Other names clients may give as OpenAI's `model` (`--served-model-name`); `model_id` is
    /// always accepted. Any other name gets 404 `model_not_found`.
    pub served_model_names: Vec<String>,
    /// `tokenizer.json` of the model.
    pub tokenizer_path: PathBuf,
    /// `tokenizer_config.json`: the chat template and the `bos_token`/`eos_token` it renders.
    /// Without it (or without a `chat_template` in it) chat requests are rejected with 422.
    pub tokenizer_config_path: Option<PathBuf>,
    /// The most prompt tokens a request may have (special tokens included).
    pub max_input_tokens: usize,
    /// The most prompt + generated tokens a request may reach.
    pub max_total_tokens: usize,
    /// `max_new_tokens` when a request gives none, capped by `max_total_tokens - input tokens`.
    pub max_new_tokens_default: usize,
    /// Requests placed on the nodes at once; more wait in the admission queue.
    pub max_concurrent_requests: usize,
    /// Requests waiting in the admission queue at once; one more gets 429 at once.
    pub max_waiting_requests: usize,
    /// Prompt tokens the waiting requests may hold together; a request over it gets 429.
    pub max_queued_tokens: u64,
    /// The longest a request waits in the queue before it gets 429.
    pub max_queue_wait_ms: u64,
    /// The most stop strings a request may give.
    pub max_stop_sequences: usize,
    /// The most alternatives per token a request may ask for (`top_n_tokens`, `logprobs`).
    pub max_top_n_tokens: usize,
    /// The whole generation, from the request's arrival to its last token, must fit in this.
    pub request_timeout_ms: u64,
    /// How long shutdown waits for in-flight requests before dropping them.
    pub shutdown_grace_ms: u64,
    /// Tokens that end a sequence (the model's EOS ids), passed to the backend as stop tokens.
    pub eos_token_ids: Vec<u32>,
    /// The largest request body accepted; a larger one gets 413.
    pub max_body_bytes: usize,
    /// Who may call the API: open by default.
    pub auth: AuthConfig,
}

impl Default for GatewayConfig {
    /// The limits the gateway serves with unless told otherwise: the one source of its flags'
    /// defaults (`crate::cli`), which a test there holds to. The input and total limits are
    /// TGI's (`--max-input-tokens 4095`, `--max-total-tokens 4096`).
    fn default() -> Self {
        Self {
            model_id: "model".into(),
            served_model_names: Vec::new(),
            tokenizer_path: "tokenizer.json".into(),
            tokenizer_config_path: None,
            max_input_tokens: 4095,
            max_total_tokens: 4096,
            max_new_tokens_default: 256,
            max_concurrent_requests: 128,
            max_waiting_requests: 1024,
            max_queued_tokens: 4 << 20,
            max_queue_wait_ms: 60_000,
            max_stop_sequences: 8,
            max_top_n_tokens: 20,
            request_timeout_ms: 300_000,
            shutdown_grace_ms: 30_000,
            eos_token_ids: Vec::new(),
            // 2 MiB: a prompt of hundreds of thousands of tokens, in JSON.
            max_body_bytes: 2 << 20,
            auth: AuthConfig::default(),
        }
    }
}

impl GatewayConfig {
    /// A config for this model with the default limits.
    pub fn new(model_id: impl Into<String>, tokenizer_path: impl Into<PathBuf>) -> Self {
        Self {
            model_id: model_id.into(),
            tokenizer_path: tokenizer_path.into(),
            ..Self::default()
        }
    }

    /// The names OpenAI's `model` may take: the id first, then the aliases.
    pub fn model_names(&self) -> Vec<&str> {
        let mut names = vec![self.model_id.as_str()];
        for name in &self.served_model_names {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
        names
    }

    /// Checks that the limits agree with each other. Errors name the setting and its value.
    pub fn validate(&self) -> Result<(), GatewayError> {
        let invalid = |field: &'static str, reason: String, given: usize| GatewayError::Config {
            message: format!("{field} {reason}, given {given}"),
        };
        if self.max_input_tokens == 0 {
            return Err(invalid("max_input_tokens", "must be >= 1".into(), 0));
        }
        if self.max_total_tokens <= self.max_input_tokens {
            return Err(invalid(
                "max_total_tokens",
                format!("must be > max_input_tokens ({})", self.max_input_tokens),
                self.max_total_tokens,
            ));
        }
        if self.max_new_tokens_default == 0 {
            return Err(invalid("max_new_tokens_default", "must be >= 1".into(), 0));
        }
        if self.max_concurrent_requests == 0 {
            return Err(invalid("max_concurrent_requests", "must be >= 1".into(), 0));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be >= 1".into(), 0));
        }
        if self.request_timeout_ms == 0 {
            return Err(invalid("request_timeout_ms", "must be >= 1".into(), 0));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        GatewayConfig::new("m", "tokenizer.json")
            .validate()
            .unwrap();
    }

    #[test]
    fn total_must_exceed_input() {
        let mut config = GatewayConfig::new("m", "tokenizer.json");
        config.max_total_tokens = config.max_input_tokens;
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains("max_total_tokens"), "{message}");
        let given = config.max_input_tokens.to_string();
        assert!(message.contains(&given), "{message}");
    }
}
