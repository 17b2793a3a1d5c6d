//! OpenAI's API: `POST /v1/completions` and `POST /v1/chat/completions`, streaming (SSE chunks,
//! then `data: [DONE]`) and not. What both share lives here.

pub(crate) mod chat;
pub(crate) mod completions;
mod tool_stream;
pub(crate) mod tools;

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;
use crate::generation::Generation;
use crate::request::GeneratedToken;
use crate::structured::ResponseFormat;
use crate::validation::GenerateParameters;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopSequences {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The fields both endpoints take. `top_k`, `repetition_penalty` and `ignore_eos` are vLLM's
/// extensions. `model` and other unknown fields are ignored: the gateway serves one model.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct CommonFields {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    repetition_penalty: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopSequences>,
    n: Option<u32>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    ignore_eos: Option<bool>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    response_format: Option<ResponseFormat>,
}

impl CommonFields {
    pub(crate) fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub(crate) fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// Checks what only OpenAI requests can get wrong and resolves the rest. OpenAI requests
    /// always sample; `temperature: 0` makes them greedy.
    pub(crate) fn parameters(
        &self,
        max_tokens: Option<u32>,
        top_n_tokens: Option<u32>,
    ) -> Result<GenerateParameters, GatewayError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(GatewayError::InvalidParameter {
                field: "n",
                reason: "must be 1".into(),
                given: n.to_string(),
            });
        }
        let penalties = [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ];
        for (field, value) in penalties {
            if let Some(value) = value.filter(|&v| v != 0.0) {
                return Err(GatewayError::Unsupported {
                    field,
                    reason: format!("only 0 is accepted, given {value}"),
                });
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
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop,
            top_n_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            grammar: self
                .response_format
                .as_ref()
                .and_then(ResponseFormat::grammar),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// The SSE response of a streaming request: `chunk` gives each token's event (with
/// `finish_reason` on the last); after the last, `usage_chunk` gives a final chunk with `choices:
/// []` and the usage when `include_usage`, then `data: [DONE]`. A failed stream ends with the
/// error event instead, and no `[DONE]`.
pub(crate) fn sse_response<C, U>(
    generation: Generation,
    common: &CommonFields,
    mut chunk: C,
    usage_chunk: U,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    C: FnMut(&GeneratedToken) -> Event + Send + 'static,
    U: Fn(Usage) -> Event + Send + 'static,
{
    let include_usage = common.include_usage();
    let prompt_tokens = generation.prompt_tokens;
    let mut completion_tokens = 0;
    let events = generation
        .tokens
        .map(move |item| match item {
            Ok(token) => {
                completion_tokens += 1;
                let mut events = vec![chunk(&token)];
                if token.finish_reason.is_some() {
                    if include_usage {
                        events.push(usage_chunk(Usage::new(prompt_tokens, completion_tokens)));
                    }
                    events.push(Event::default().data("[DONE]"));
                }
                events
            }
            Err(error) => vec![error.to_sse_event()],
        })
        .flat_map(|events| futures::stream::iter(events.into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}
