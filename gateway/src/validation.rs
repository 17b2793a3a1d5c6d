//! Turning an API request into a [`ValidRequest`]: tokenizing the prompt (rendering chat messages
//! first) and checking every parameter against the limits, with TGI's rules. Nothing downstream
//! sees an unvalidated request.

use std::collections::HashSet;
use std::time::Instant;

use tokenizers::{Encoding, Tokenizer};

use crate::chat_template::{ChatMessage, ChatTemplate, TemplateKwargs};
use crate::config::GatewayConfig;
use crate::error::GatewayError;
use crate::request::{RequestId, SamplingParams, StoppingParams, ValidRequest};
use crate::structured::RequestGrammar;

/// The prompt of a request, before tokenization.
#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    /// Tokenized with the tokenizer's special tokens (BOS), as TGI does.
    Text(String),
    /// Rendered with the chat template, which writes its own special tokens, then tokenized
    /// without adding any.
    Chat(Vec<ChatMessage>),
    /// Token ids as the client gave them (OpenAI's `prompt` as a list of ids): taken as they
    /// are, no special tokens added, each checked against the vocabulary.
    Ids(Vec<u32>),
    /// A chat whose template also renders these tools (OpenAI's `tools` list) and gets the
    /// request's own variables (`chat_template_kwargs`).
    ChatWith(Vec<ChatMessage>, Vec<serde_json::Value>, TemplateKwargs),
}

/// The length limits a request is checked against: the configured ones, lowered to what the
/// cluster's nodes can hold ([`crate::AppState::limits`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub max_input_tokens: usize,
    pub max_total_tokens: usize,
}

impl Limits {
    /// `configured`, lowered so that no request exceeds `max_context` tokens in all (the
    /// smallest context among the nodes, when known). Input keeps room for one new token.
    pub(crate) fn new(configured: &GatewayConfig, max_context: Option<usize>) -> Self {
        let max_total_tokens = max_context
            .filter(|&c| c >= 2)
            .map_or(configured.max_total_tokens, |c| {
                c.min(configured.max_total_tokens)
            });
        Self {
            max_total_tokens,
            max_input_tokens: configured
                .max_input_tokens
                .min(max_total_tokens.saturating_sub(1))
                .max(1),
        }
    }
}

/// What each API calls the fields whose errors the validator reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FieldNames {
    pub inputs: &'static str,
    pub max_new_tokens: &'static str,
    pub top_n_tokens: &'static str,
}

impl FieldNames {
    pub const TGI: Self = Self {
        inputs: "inputs",
        max_new_tokens: "max_new_tokens",
        top_n_tokens: "top_n_tokens",
    };
    pub const COMPLETIONS: Self = Self {
        inputs: "prompt",
        max_new_tokens: "max_tokens",
        top_n_tokens: "logprobs",
    };
    pub const CHAT: Self = Self {
        inputs: "messages",
        max_new_tokens: "max_tokens",
        top_n_tokens: "top_logprobs",
    };
}

/// Generation parameters as the client gave them, common to every API.
#[derive(Debug, Clone, Default)]
pub(crate) struct GenerateParameters {
    pub max_new_tokens: Option<u32>,
    /// Floats are read as 64-bit and checked before they become the sampler's 32-bit ones,
    /// so the ranges the OpenAPI document states hold exactly (`2.0000001` is above 2).
    pub temperature: Option<f64>,
    /// TGI's `do_sample`; OpenAI requests always sample (temperature 0 makes it greedy).
    pub do_sample: bool,
    pub top_k: Option<i64>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub top_n_tokens: Option<u32>,
    pub ignore_eos: bool,
    /// Structured output: what the output must match, and the field that asked for it.
    pub grammar: Option<RequestGrammar>,
    /// TGI's `decoder_input_details`: the prompt tokens' logprobs.
    pub prompt_logprobs: bool,
}

/// The tokenizer, the chat template and the limits.
pub(crate) struct Validator {
    tokenizer: Tokenizer,
    special_ids: HashSet<u32>,
    chat_template: Option<ChatTemplate>,
    config: GatewayConfig,
}

impl Validator {
    pub(crate) fn load(config: &GatewayConfig) -> Result<Self, GatewayError> {
        let tokenizer =
            Tokenizer::from_file(&config.tokenizer_path).map_err(|e| GatewayError::Load {
                path: config.tokenizer_path.clone(),
                message: e.to_string(),
            })?;
        let chat_template = match &config.tokenizer_config_path {
            Some(path) => ChatTemplate::load(path)?,
            None => None,
        };
        Ok(Self::new(tokenizer, chat_template, config.clone()))
    }

    pub(crate) fn new(
        tokenizer: Tokenizer,
        chat_template: Option<ChatTemplate>,
        config: GatewayConfig,
    ) -> Self {
        let special_ids = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Self {
            tokenizer,
            special_ids,
            chat_template,
            config,
        }
    }

    pub(crate) fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The model's output family, from its chat template (the default without one).
    pub(crate) fn output_family(&self) -> crate::openai::family::OutputFamily {
        self.chat_template
            .as_ref()
            .map(ChatTemplate::family)
            .unwrap_or_default()
    }

    /// The id of the token whose text is `text`, when the vocabulary has one.
    pub(crate) fn token_id(&self, text: &str) -> Option<u32> {
        self.tokenizer.token_to_id(text)
    }

    /// Why the chat template is a stand-in (see [`ChatTemplate::stand_in`]).
    pub(crate) fn chat_template_stand_in(&self) -> Option<&str> {
        self.chat_template.as_ref().and_then(ChatTemplate::stand_in)
    }

    /// Checks `parameters`, tokenizes `prompt` and checks its length. CPU-bound (tokenization):
    /// call it off the async runtime.
    pub(crate) fn validate(
        &self,
        prompt: Prompt,
        parameters: GenerateParameters,
        fields: FieldNames,
        limits: Limits,
        received_at: Instant,
    ) -> Result<ValidRequest, GatewayError> {
        let sampling = self.sampling(&parameters, fields)?;
        let stop_strings = self.stop_strings(parameters.stop)?;
        if let Some(grammar) = &parameters.grammar {
            crate::structured::check(grammar)?;
        }
        let prompt_ids = self.prompt_ids(prompt, fields)?;

        let input_tokens = prompt_ids.len();
        if input_tokens > limits.max_input_tokens {
            return Err(GatewayError::InputTooLong {
                field: fields.inputs,
                input_tokens,
                max_input_tokens: limits.max_input_tokens,
            });
        }
        let room = limits.max_total_tokens.saturating_sub(input_tokens);
        let max_new_tokens = match parameters.max_new_tokens {
            Some(0) => {
                return Err(invalid(fields.max_new_tokens, "must be at least 1", 0));
            }
            Some(n) if n as usize > room => {
                return Err(GatewayError::TotalTooLong {
                    inputs_field: fields.inputs,
                    field: fields.max_new_tokens,
                    input_tokens,
                    max_new_tokens: n as usize,
                    max_total_tokens: limits.max_total_tokens,
                });
            }
            Some(n) => n as usize,
            None => self.config.max_new_tokens_default.min(room),
        };

        Ok(ValidRequest {
            request_id: RequestId::new_random(),
            prompt_ids,
            sampling,
            stopping: StoppingParams {
                max_new_tokens,
                stop_token_ids: self.config.eos_token_ids.clone(),
                stop_strings,
                ignore_eos: parameters.ignore_eos,
            },
            grammar: parameters.grammar.map(|g| g.spec),
            prompt_logprobs: parameters.prompt_logprobs,
            received_at,
        })
    }

    /// TGI's rule: sampling happens when `do_sample` is set or any warper departs from its
    /// neutral value; otherwise decoding is greedy (temperature 0).
    fn sampling(
        &self,
        p: &GenerateParameters,
        fields: FieldNames,
    ) -> Result<SamplingParams, GatewayError> {
        if let Some(t) = p.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(invalid("temperature", "must be a finite number >= 0", t));
            }
        }
        if let Some(top_p) = p.top_p {
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(invalid("top_p", "must be in (0, 1]", top_p));
            }
        }
        if let Some(top_k) = p.top_k {
            if top_k < 0 {
                return Err(invalid("top_k", "must be >= 0", top_k));
            }
        }
        if let Some(penalty) = p.repetition_penalty {
            if !(penalty.is_finite() && penalty > 0.0) {
                return Err(invalid(
                    "repetition_penalty",
                    "must be a finite number > 0",
                    penalty,
                ));
            }
        }
        let top_n = p.top_n_tokens.unwrap_or(0) as usize;
        if top_n > self.config.max_top_n_tokens {
            return Err(invalid(
                fields.top_n_tokens,
                format!("must be at most {}", self.config.max_top_n_tokens),
                top_n,
            ));
        }
        let sample = p.do_sample
            || p.temperature.is_some_and(|t| t != 1.0)
            || p.top_k.is_some_and(|k| k > 0)
            || p.top_p.is_some_and(|top_p| top_p < 1.0);
        // Into the sampler's 32-bit floats: a value past their range is clamped to it (a
        // temperature of 1e300 is as flat as f32::MAX, a top_p of 1e-300 keeps one token).
        #[allow(clippy::cast_possible_truncation)]
        let f32_in = |v: f64, least: f32| (v as f32).clamp(least, f32::MAX);
        Ok(SamplingParams {
            temperature: if sample {
                f32_in(p.temperature.unwrap_or(1.0), 0.0)
            } else {
                0.0
            },
            top_k: p.top_k.unwrap_or(0).max(0) as usize,
            top_p: f32_in(p.top_p.unwrap_or(1.0), f32::MIN_POSITIVE).min(1.0),
            repetition_penalty: f32_in(p.repetition_penalty.unwrap_or(1.0), f32::MIN_POSITIVE),
            seed: p.seed.unwrap_or_else(rand::random),
            top_n_logprobs: top_n,
        })
    }

    fn stop_strings(&self, stop: Vec<String>) -> Result<Vec<String>, GatewayError> {
        if stop.len() > self.config.max_stop_sequences {
            return Err(invalid(
                "stop",
                format!(
                    "must have at most {} sequences",
                    self.config.max_stop_sequences
                ),
                stop.len(),
            ));
        }
        if let Some(i) = stop.iter().position(String::is_empty) {
            return Err(invalid(
                "stop",
                "must not contain empty strings",
                format!("\"\" at {i}"),
            ));
        }
        Ok(stop)
    }

    fn prompt_ids(&self, prompt: Prompt, fields: FieldNames) -> Result<Vec<u32>, GatewayError> {
        let (text, add_special_tokens) = match prompt {
            Prompt::Text(text) => (text, true),
            Prompt::Chat(messages) => {
                self.render_chat(messages, &[], &TemplateKwargs::default(), fields)?
            }
            Prompt::ChatWith(messages, tools, kwargs) => {
                self.render_chat(messages, &tools, &kwargs, fields)?
            }
            Prompt::Ids(ids) => {
                if ids.is_empty() {
                    return Err(GatewayError::EmptyInput {
                        field: fields.inputs,
                    });
                }
                let vocab = self.tokenizer.get_vocab_size(true);
                if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(invalid(
                        fields.inputs,
                        format!("token ids must be below the vocabulary size {vocab}"),
                        id,
                    ));
                }
                return Ok(ids);
            }
        };
        self.tokenize_prompt(text, add_special_tokens, fields)
    }

    /// The chat template's prompt for `messages`, `tools` and `kwargs`; it writes its own special
    /// tokens, so none are added when it is tokenized.
    fn render_chat(
        &self,
        messages: Vec<ChatMessage>,
        tools: &[serde_json::Value],
        kwargs: &TemplateKwargs,
        fields: FieldNames,
    ) -> Result<(String, bool), GatewayError> {
        if messages.is_empty() {
            return Err(GatewayError::EmptyInput {
                field: fields.inputs,
            });
        }
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| GatewayError::NoChatTemplate {
                model_id: self.config.model_id.clone(),
            })?;
        Ok((template.apply_with(&messages, tools, kwargs)?, false))
    }

    fn tokenize_prompt(
        &self,
        text: String,
        add_special_tokens: bool,
        fields: FieldNames,
    ) -> Result<Vec<u32>, GatewayError> {
        if text.is_empty() {
            return Err(GatewayError::EmptyInput {
                field: fields.inputs,
            });
        }
        Ok(self.encode(&text, add_special_tokens)?.get_ids().to_vec())
    }

    /// `/tokenize`'s tokens for `inputs`, which may have at most [`max_tokenize_chars`]
    /// characters (422 past it; the body limit gives 413 before that).
    pub(crate) fn tokenize_input(
        &self,
        inputs: &str,
        limits: Limits,
    ) -> Result<Encoding, GatewayError> {
        let max_chars = max_tokenize_chars(limits);
        let chars = inputs.chars().count();
        if chars > max_chars {
            return Err(invalid(
                "inputs",
                format!(
                    "must have at most {max_chars} characters (4 per token of \
                     max_input_tokens, {})",
                    limits.max_input_tokens
                ),
                chars,
            ));
        }
        self.encode(inputs, true)
    }

    /// Token ids below this are the model's.
    pub(crate) fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Tokenizes `text`; offsets count characters, as `/tokenize` reports them.
    pub(crate) fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Encoding, GatewayError> {
        self.tokenizer
            .encode_char_offsets(text, add_special_tokens)
            .map_err(|e| GatewayError::Tokenizer {
                message: e.to_string(),
            })
    }

    /// The text of `ids`, special tokens left out: what TGI reports as `generated_text`.
    pub(crate) fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// The text of one token on its own (for `top_tokens`), special tokens included.
    pub(crate) fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    pub(crate) fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }
}

/// The longest text `/tokenize` takes, in characters: a limit on its work that the OpenAPI
/// document can state exactly (a token limit cannot be: a character is 1 to 4 tokens, so
/// any character bound either refuses texts the limit allows or allows texts it refuses).
/// Four characters a token is about what a `max_input_tokens` prompt holds in English.
pub(crate) fn max_tokenize_chars(limits: Limits) -> usize {
    limits.max_input_tokens.saturating_mul(4)
}

/// A parameter out of range: the error every API reports with the field's name.
pub(crate) fn invalid(
    field: &'static str,
    reason: impl Into<String>,
    given: impl ToString,
) -> GatewayError {
    GatewayError::InvalidParameter {
        field,
        reason: reason.into(),
        given: given.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STORIES_TOKENIZER: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/models/stories260K/tokenizer.json"
    );

    fn validator(config: impl FnOnce(&mut GatewayConfig)) -> Validator {
        let mut cfg = GatewayConfig::new("stories260K", STORIES_TOKENIZER);
        cfg.max_input_tokens = 16;
        cfg.max_total_tokens = 32;
        cfg.max_new_tokens_default = 20;
        cfg.eos_token_ids = vec![2];
        config(&mut cfg);
        Validator::load(&cfg).unwrap()
    }

    fn validate(
        v: &Validator,
        text: &str,
        p: GenerateParameters,
    ) -> Result<ValidRequest, GatewayError> {
        v.validate(
            Prompt::Text(text.into()),
            p,
            FieldNames::TGI,
            Limits::new(&v.config, None),
            Instant::now(),
        )
    }

    fn field_of(result: Result<ValidRequest, GatewayError>) -> &'static str {
        match result {
            Err(GatewayError::InvalidParameter { field, .. }) => field,
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
    }

    #[test]
    fn tokenizes_with_bos_and_fills_defaults() {
        let v = validator(|_| {});
        let request = validate(&v, "Once upon a time", GenerateParameters::default()).unwrap();
        assert_eq!(
            request.prompt_ids[0], 1,
            "BOS first: {:?}",
            request.prompt_ids
        );
        let room = 32 - request.prompt_ids.len();
        assert_eq!(request.stopping.max_new_tokens, room.min(20));
        assert_eq!(request.stopping.stop_token_ids, vec![2]);
        assert_eq!(
            request.sampling.temperature, 0.0,
            "greedy without do_sample"
        );
        assert_eq!(request.sampling.top_p, 1.0);
    }

    #[test]
    fn sampling_follows_tgi_rules() {
        let v = validator(|_| {});
        let p = GenerateParameters {
            do_sample: true,
            seed: Some(7),
            ..Default::default()
        };
        let request = validate(&v, "hi", p).unwrap();
        assert_eq!(request.sampling.temperature, 1.0);
        assert_eq!(request.sampling.seed, 7);
        let p = GenerateParameters {
            temperature: Some(0.5),
            ..Default::default()
        };
        assert_eq!(validate(&v, "hi", p).unwrap().sampling.temperature, 0.5);
        let p = GenerateParameters {
            temperature: Some(0.0),
            do_sample: true,
            ..Default::default()
        };
        assert_eq!(validate(&v, "hi", p).unwrap().sampling.temperature, 0.0);
    }

    #[test]
    fn out_of_range_parameters_name_their_field() {
        let v = validator(|_| {});
        let cases: [(GenerateParameters, &str); 6] = [
            (
                GenerateParameters {
                    temperature: Some(-0.1),
                    ..Default::default()
                },
                "temperature",
            ),
            (
                GenerateParameters {
                    top_p: Some(0.0),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                GenerateParameters {
                    top_p: Some(1.5),
                    ..Default::default()
                },
                "top_p",
            ),
            (
                GenerateParameters {
                    top_k: Some(-1),
                    ..Default::default()
                },
                "top_k",
            ),
            (
                GenerateParameters {
                    repetition_penalty: Some(0.0),
                    ..Default::default()
                },
                "repetition_penalty",
            ),
            (
                GenerateParameters {
                    top_n_tokens: Some(21),
                    ..Default::default()
                },
                "top_n_tokens",
            ),
        ];
        for (p, field) in cases {
            assert_eq!(field_of(validate(&v, "hi", p)), field);
        }
        let p = GenerateParameters {
            stop: vec!["a".into(); 9],
            ..Default::default()
        };
        assert_eq!(field_of(validate(&v, "hi", p)), "stop");
        let p = GenerateParameters {
            max_new_tokens: Some(0),
            ..Default::default()
        };
        assert_eq!(field_of(validate(&v, "hi", p)), "max_new_tokens");
    }

    #[test]
    fn length_limits_name_limit_and_value() {
        let v = validator(|_| {});
        let long = "Once upon a time there was a little girl who liked to play in the park";
        match validate(&v, long, GenerateParameters::default()) {
            Err(GatewayError::InputTooLong {
                input_tokens,
                max_input_tokens,
                ..
            }) => {
                assert!(input_tokens > 16);
                assert_eq!(max_input_tokens, 16);
            }
            other => panic!("expected InputTooLong, got {other:?}"),
        }
        let p = GenerateParameters {
            max_new_tokens: Some(31),
            ..Default::default()
        };
        assert!(matches!(
            validate(&v, "Once upon", p),
            Err(GatewayError::TotalTooLong {
                max_total_tokens: 32,
                ..
            })
        ));
        assert!(matches!(
            validate(&v, "", GenerateParameters::default()),
            Err(GatewayError::EmptyInput { field: "inputs" })
        ));
    }

    #[test]
    fn chat_without_template_is_rejected() {
        let v = validator(|_| {});
        let messages = vec![ChatMessage {
            role: "user".into(),
            content: "hi".into(),
            name: None,
            ..Default::default()
        }];
        let result = v.validate(
            Prompt::Chat(messages),
            GenerateParameters::default(),
            FieldNames::CHAT,
            Limits::new(&v.config, None),
            Instant::now(),
        );
        assert!(matches!(result, Err(GatewayError::NoChatTemplate { .. })));
    }

    #[test]
    fn special_tokens_are_known() {
        let v = validator(|_| {});
        assert!(v.is_special(1) && v.is_special(2));
        assert!(!v.is_special(300));
        assert_eq!(v.token_text(1), "<s>");
    }
}
