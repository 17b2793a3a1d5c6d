//! OpenAI's API: `POST /v1/completions` and `POST /v1/chat/completions`, streaming (SSE chunks,
//! then `data: [DONE]`) and not. What both share lives here.

pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod family;
mod reasoning;
mod stream;
mod tool_stream;
mod tool_syntax;
pub(crate) mod tools;

use serde::{Deserialize, Serialize};

use crate::error::GatewayError;
use crate::sequences::Sequences;
use crate::state::AppState;
use crate::structured::ResponseFormat;
pub(crate) use crate::validation::invalid;
use crate::validation::{FieldNames, GenerateParameters, Prompt};

/// `stop`: one string or a list.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
enum StopSequences {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// OpenAI's largest `n` (and `best_of` on completions).
pub(crate) const MAX_N: u32 = 128;

/// The fields both endpoints take. `top_k`, `repetition_penalty` and `ignore_eos` are vLLM's
/// extensions. Unknown fields are ignored.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub(crate) struct CommonFields {
    /// Checked against the served id and its aliases ([`AppState::check_model`]).
    model: Option<String>,
    #[schema(minimum = 0.0, maximum = 2.0)]
    temperature: Option<f64>,
    /// In (0, 1]. Floats are read as 64-bit, so the bounds hold exactly as written.
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    /// -1 (vLLM's "off") or more.
    #[schema(minimum = -1)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    top_k: Option<i64>,
    /// Above 0.
    #[schema(exclusive_minimum = 0.0)]
    repetition_penalty: Option<f64>,
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    seed: Option<u64>,
    #[schema(value_type = Option<crate::structured::StopSchema>)]
    stop: Option<StopSequences>,
    #[schema(minimum = 1, maximum = 128)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    n: Option<u32>,
    /// Only 0 (no penalty) is supported.
    #[schema(minimum = 0.0, maximum = 0.0)]
    frequency_penalty: Option<f64>,
    /// Only 0 (no penalty) is supported.
    #[schema(minimum = 0.0, maximum = 0.0)]
    presence_penalty: Option<f64>,
    ignore_eos: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    response_format: Option<ResponseFormat>,
}

impl CommonFields {
    pub(crate) fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    pub(crate) fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Choices per prompt; checked by [`Self::parameters`].
    pub(crate) fn n(&self) -> usize {
        self.n.unwrap_or(1) as usize
    }

    /// Whether the stream ends with `data: [DONE]`. Not for `model: "tgi"`: TGI's own Python
    /// client (`text_generation`, which always sends that placeholder) parses every `data:`
    /// line as JSON and fails on `[DONE]`; the stream's end still closes it.
    pub(crate) fn sends_done(&self) -> bool {
        self.model.as_deref() != Some("tgi")
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// Checks OpenAI's ranges, which are narrower than TGI's, and resolves the parameters.
    /// OpenAI requests always sample; `temperature: 0` makes them greedy.
    pub(crate) fn parameters(
        &self,
        max_tokens: Option<u32>,
        top_n_tokens: Option<u32>,
    ) -> Result<GenerateParameters, GatewayError> {
        if let Some(t) = self.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return Err(invalid("temperature", "must be between 0 and 2", t));
        }
        if let Some(p) = self.top_p.filter(|&p| !(p > 0.0 && p <= 1.0)) {
            return Err(invalid("top_p", "must be in (0, 1]", p));
        }
        if let Some(n) = self.n.filter(|n| !(1..=MAX_N).contains(n)) {
            return Err(invalid("n", format!("must be between 1 and {MAX_N}"), n));
        }
        if let Some(k) = self.top_k.filter(|&k| k < -1) {
            return Err(invalid("top_k", "must be -1 (off) or >= 0", k));
        }
        let penalties = [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ];
        for (field, value) in penalties {
            match value {
                Some(v) if !(-2.0..=2.0).contains(&v) => {
                    return Err(invalid(field, "must be between -2 and 2", v));
                }
                Some(v) if v != 0.0 => {
                    return Err(GatewayError::Unsupported {
                        field,
                        reason: format!("only 0 is accepted, given {v}"),
                    });
                }
                _ => {}
            }
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopSequences::One(s)) => vec![s.clone()],
            Some(StopSequences::Many(v)) => v.clone(),
        };
        Ok(GenerateParameters {
            max_new_tokens: max_tokens,
            temperature: self.temperature,
            do_sample: true,
            // vLLM's -1 is "off", as 0 is here.
            top_k: self.top_k.map(|k| k.max(0)),
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop,
            top_n_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            grammar: match &self.response_format {
                Some(format) => format.grammar()?,
                None => None,
            },
            prompt_logprobs: false,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub(crate) struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub(crate) fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// Starts `count` sequences of each prompt; the response's choice `i * count + j` is prompt
/// `i`'s sequence `j`. All prompts are validated before any starts.
pub(crate) async fn start_all(
    state: &AppState,
    endpoint: &'static str,
    prompts: Vec<Prompt>,
    parameters: GenerateParameters,
    fields: FieldNames,
    count: usize,
) -> Result<Vec<Sequences>, GatewayError> {
    let mut requests = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        requests.push(
            state
                .validate_request(endpoint, prompt, parameters.clone(), fields)
                .await?,
        );
    }
    // The first prompt starts now, so that a request that cannot start at all fails with its
    // status; the others start as their tokens are read (see `Sequences::when_polled`).
    let mut requests = requests.into_iter();
    let Some(first) = requests.next() else {
        return Ok(Vec::new());
    };
    let mut all = vec![Sequences::start(state, first, count).await?];
    all.extend(requests.map(|request| Sequences::when_polled(state, request, count)));
    Ok(all)
}
