//! TGI's generation API: `POST /generate` and `POST /generate_stream`, and `POST /`, which
//! serves either by the request's `stream` field (a non-streamed answer there is a list of
//! one, as TGI sends it), in TGI's shapes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;
use crate::generation::Completed;
use crate::json::Json;
use crate::request::{FinishReason, GeneratedToken};
use crate::sequences::{best_first, Sequences};
use crate::sse::json_event;
use crate::state::AppState;
use crate::structured::TgiGrammar;
use crate::validation::{FieldNames, GenerateParameters, Prompt, Validator};

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct GenerateRequest {
    #[schema(min_length = 1)]
    inputs: String,
    #[serde(default)]
    parameters: Option<TgiParameters>,
}

/// `POST /`'s body: a generate request and whether to stream it.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct CompatGenerateRequest {
    #[schema(min_length = 1)]
    inputs: String,
    #[serde(default)]
    parameters: Option<TgiParameters>,
    #[serde(default)]
    stream: bool,
}

/// TGI's `--max-best-of` default is 2; a few more cost little here, as the sequences share
/// the prompt's blocks.
const MAX_BEST_OF: usize = 8;

/// Every field may be absent or `null`, as TGI's clients send them. The bounds in the OpenAPI
/// document are the validator's (`crate::validation`), with the default configuration's
/// limits (`GatewayConfig::max_stop_sequences`, `max_top_n_tokens`).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
struct TgiParameters {
    /// At most `max_total_tokens` with the prompt's tokens.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    max_new_tokens: Option<u32>,
    /// Floats are read as 64-bit, so the bounds hold exactly as written.
    #[schema(minimum = 0.0)]
    temperature: Option<f64>,
    /// Signed, so that a negative one is refused naming the field (the OpenAPI document's
    /// maximum is `i64::MAX`, `crate::openapi::tgi_rules`).
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    top_k: Option<i64>,
    /// In (0, 1].
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    top_p: Option<f64>,
    /// Above 0.
    #[schema(exclusive_minimum = 0.0)]
    repetition_penalty: Option<f64>,
    do_sample: Option<bool>,
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    seed: Option<u64>,
    #[schema(value_type = Option<crate::structured::StopListSchema>)]
    stop: Option<Vec<String>>,
    details: Option<bool>,
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    top_n_tokens: Option<u32>,
    return_full_text: Option<bool>,
    /// Sequences to sample; the one with the highest logprob per token is the answer and the
    /// others come in `details.best_of_sequences`. Above 1 only when sampling, without a
    /// seed, not streaming.
    #[schema(minimum = 1, maximum = 8)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    best_of: Option<usize>,
    decoder_input_details: Option<bool>,
    grammar: Option<TgiGrammar>,
}

impl TgiParameters {
    /// TGI's rules for `best_of`: positive, at most [`MAX_BEST_OF`], and above 1 only when
    /// sampling without a seed and without streaming. Gives the sequences to run.
    fn best_of(&self, stream: bool) -> Result<usize, GatewayError> {
        let Some(best_of) = self.best_of else {
            return Ok(1);
        };
        let invalid = |reason: &str| GatewayError::InvalidParameter {
            field: "best_of",
            reason: reason.into(),
            given: best_of.to_string(),
        };
        if best_of == 0 {
            return Err(invalid("must be strictly positive"));
        }
        if best_of > MAX_BEST_OF {
            return Err(invalid(&format!("must be at most {MAX_BEST_OF}")));
        }
        if best_of > 1 {
            if stream {
                return Err(invalid("must be 1 when streaming tokens"));
            }
            if self.seed.is_some() {
                return Err(invalid("must be 1 when `seed` is set"));
            }
            let samples = self.do_sample.unwrap_or(false)
                || self.temperature.is_some_and(|t| t != 1.0 && t > 0.0)
                || self.top_k.is_some_and(|k| k > 0)
                || self.top_p.is_some_and(|p| p < 1.0);
            if !samples {
                return Err(invalid("must be 1 for greedy decoding (set `do_sample`)"));
            }
        }
        Ok(best_of)
    }

    fn generate_parameters(&self) -> Result<GenerateParameters, GatewayError> {
        Ok(GenerateParameters {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            do_sample: self.do_sample.unwrap_or(false),
            top_k: self.top_k,
            top_p: self.top_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            stop: self.stop.clone().unwrap_or_default(),
            top_n_tokens: self.top_n_tokens,
            ignore_eos: false,
            grammar: self.grammar.clone().map(TgiGrammar::grammar).transpose()?,
            prompt_logprobs: self.decoder_input_details.unwrap_or(false),
        })
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct GenerateResponse {
    generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Details {
    finish_reason: &'static str,
    generated_tokens: usize,
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    seed: Option<u64>,
    prefill: Vec<PrefillToken>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    best_of_sequences: Option<Vec<BestOfSequence>>,
}

/// One of `best_of`'s sequences other than the answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct BestOfSequence {
    generated_text: String,
    finish_reason: &'static str,
    generated_tokens: usize,
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    seed: Option<u64>,
    prefill: Vec<PrefillToken>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
}

/// A prompt token in `details.prefill` (`decoder_input_details`). The first has no logprob:
/// nothing comes before it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
struct PrefillToken {
    id: u32,
    text: String,
    logprob: Option<f32>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Token {
    id: u32,
    text: String,
    logprob: f32,
    special: bool,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct StreamResponse {
    /// 1 for the first token, as in TGI.
    index: usize,
    token: Token,
    top_tokens: Vec<Token>,
    generated_text: Option<String>,
    details: Option<StreamDetails>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct StreamDetails {
    finish_reason: &'static str,
    generated_tokens: usize,
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    seed: Option<u64>,
}

#[utoipa::path(
    post,
    path = "/generate",
    tag = "TGI",
    request_body = GenerateRequest,
    responses(
        (status = 200, description = "The generated text", body = GenerateResponse),
        (status = 400, description = "Malformed JSON", body = crate::error::ErrorBody),
        (status = 413, description = "Body over --max-body-bytes", body = crate::error::ErrorBody),
        (status = 422, description = "Invalid parameters or input too long", body = crate::error::ErrorBody),
        (status = 429, description = "Overloaded", body = crate::error::ErrorBody),
    )
)]
pub(crate) async fn generate(
    State(state): State<AppState>,
    Json(request): Json<GenerateRequest>,
) -> Result<Response, GatewayError> {
    let parameters = request.parameters.unwrap_or_default();
    let response = generate_once(&state, "generate", request.inputs, parameters).await?;
    Ok(axum::Json(response).into_response())
}

#[utoipa::path(
    post,
    path = "/generate_stream",
    tag = "TGI",
    request_body = GenerateRequest,
    responses(
        (status = 200, description = "Server-sent events, one per token", body = StreamResponse, content_type = "text/event-stream"),
        (status = 400, description = "Malformed JSON", body = crate::error::ErrorBody),
        (status = 413, description = "Body over --max-body-bytes", body = crate::error::ErrorBody),
        (status = 422, description = "Invalid parameters or input too long", body = crate::error::ErrorBody),
        (status = 429, description = "Overloaded", body = crate::error::ErrorBody),
    )
)]
pub(crate) async fn generate_stream(
    State(state): State<AppState>,
    Json(request): Json<GenerateRequest>,
) -> Result<Response, GatewayError> {
    let parameters = request.parameters.unwrap_or_default();
    stream(&state, "generate_stream", request.inputs, parameters).await
}

/// `POST /`: TGI's compat route. Streams as `/generate_stream` with `stream: true`; otherwise
/// answers as `/generate`, but with a list of one response, which TGI's clients index.
#[utoipa::path(
    post,
    path = "/",
    tag = "TGI",
    request_body = CompatGenerateRequest,
    responses(
        (status = 200, description = "A list of one response; server-sent events with `stream: true`", content(
            (Vec<GenerateResponse> = "application/json"),
            (StreamResponse = "text/event-stream"),
        )),
        (status = 400, description = "Malformed JSON", body = crate::error::ErrorBody),
        (status = 413, description = "Body over --max-body-bytes", body = crate::error::ErrorBody),
        (status = 422, description = "Invalid parameters or input too long", body = crate::error::ErrorBody),
        (status = 429, description = "Overloaded", body = crate::error::ErrorBody),
    )
)]
pub(crate) async fn compat_generate(
    State(state): State<AppState>,
    Json(request): Json<CompatGenerateRequest>,
) -> Result<Response, GatewayError> {
    let parameters = request.parameters.unwrap_or_default();
    if request.stream {
        return stream(&state, "generate_stream", request.inputs, parameters).await;
    }
    let response = generate_once(&state, "generate", request.inputs, parameters).await?;
    Ok(axum::Json(vec![response]).into_response())
}

async fn generate_once(
    state: &AppState,
    endpoint: &'static str,
    prompt: String,
    parameters: TgiParameters,
) -> Result<GenerateResponse, GatewayError> {
    let best_of = parameters.best_of(false)?;
    let request = state
        .validate_request(
            endpoint,
            Prompt::Text(prompt.clone()),
            parameters.generate_parameters()?,
            FieldNames::TGI,
        )
        .await?;
    let sequences = Sequences::start(state, request, best_of).await?;
    let seeds = sequences.seeds.clone();
    let prompt_ids = sequences.prompt_ids.clone();
    let completed = sequences.collect().await?;
    let validator = state.validator();
    let with_top_tokens = parameters.top_n_tokens.unwrap_or(0) > 0;
    let prefix = if parameters.return_full_text.unwrap_or(false) {
        prompt
    } else {
        String::new()
    };
    // The first sequence computed the prompt's logprobs; the prompt is the same for all.
    let prefill = if parameters.decoder_input_details.unwrap_or(false) {
        let logprobs = completed
            .first()
            .and_then(|c| c.tokens.first())
            .map_or(&[][..], |t| t.prompt_logprobs.as_slice());
        prefill_tokens(validator, &prompt_ids, logprobs)
    } else {
        Vec::new()
    };
    let order = best_first(&completed);
    let best = order[0];
    let details = parameters.details.unwrap_or(false).then(|| {
        let others = order[1..]
            .iter()
            .map(|&i| BestOfSequence {
                generated_text: format!("{prefix}{}", tgi_text(validator, &completed[i])),
                finish_reason: completed[i].finish_reason.as_tgi_str(),
                generated_tokens: completed[i].tokens.len(),
                seed: seeds[i],
                prefill: prefill.clone(),
                tokens: tokens(validator, &completed[i]),
                top_tokens: all_top_tokens(validator, &completed[i], with_top_tokens),
            })
            .collect();
        Details {
            finish_reason: completed[best].finish_reason.as_tgi_str(),
            generated_tokens: completed[best].tokens.len(),
            seed: seeds[best],
            prefill: prefill.clone(),
            tokens: tokens(validator, &completed[best]),
            top_tokens: all_top_tokens(validator, &completed[best], with_top_tokens),
            best_of_sequences: (best_of > 1).then_some(others),
        }
    });
    Ok(GenerateResponse {
        generated_text: format!("{prefix}{}", tgi_text(validator, &completed[best])),
        details,
    })
}

/// The generated text as TGI reports it: a stop sequence stays in it (the nodes cut the text
/// before it, so it is decoded again from the token ids).
fn tgi_text(validator: &Validator, completed: &Completed) -> String {
    if completed.finish_reason != FinishReason::Stop {
        return completed.text.clone();
    }
    let full = validator.decode(&completed.ids());
    // Decoding the ids gives back at least what was streamed; anything else means the ids are
    // not this tokenizer's (a test's fake tokens), and the streamed text is all there is.
    if full.starts_with(&completed.text) {
        full
    } else {
        completed.text.clone()
    }
}

fn tokens(validator: &Validator, completed: &Completed) -> Vec<Token> {
    completed
        .tokens
        .iter()
        .map(|t| token(validator, t))
        .collect()
}

fn all_top_tokens(validator: &Validator, completed: &Completed, wanted: bool) -> Vec<Vec<Token>> {
    if !wanted {
        return Vec::new();
    }
    completed
        .tokens
        .iter()
        .map(|t| top_tokens(validator, t))
        .collect()
}

async fn stream(
    state: &AppState,
    endpoint: &'static str,
    prompt: String,
    parameters: TgiParameters,
) -> Result<Response, GatewayError> {
    parameters.best_of(true)?;
    if parameters.decoder_input_details.unwrap_or(false) {
        return Err(GatewayError::InvalidParameter {
            field: "decoder_input_details",
            reason: "must be false when streaming tokens".into(),
            given: "true".into(),
        });
    }
    let mut text = if parameters.return_full_text.unwrap_or(false) {
        prompt.clone()
    } else {
        String::new()
    };
    let generation = state
        .generate(
            endpoint,
            Prompt::Text(prompt),
            parameters.generate_parameters()?,
            FieldNames::TGI,
        )
        .await?;
    let seed = generation.seed;
    let validator = Arc::clone(state.validator());
    let mut count = 0;
    let mut ids = Vec::new();
    let mut streamed = String::new();
    let events = generation.tokens.map(move |item| {
        let event = match item {
            Ok(mut generated) => {
                count += 1;
                ids.push(generated.id);
                if generated.finish_reason == Some(FinishReason::Stop) {
                    // TGI keeps the stop sequence: the last token's whole text.
                    let full = validator.decode(&ids);
                    if let Some(rest) = full.strip_prefix(streamed.as_str()) {
                        generated.text = rest.to_string();
                    }
                }
                streamed.push_str(&generated.text);
                text.push_str(&generated.text);
                let response = StreamResponse {
                    index: count,
                    token: token(&validator, &generated),
                    top_tokens: top_tokens(&validator, &generated),
                    generated_text: generated.finish_reason.map(|_| std::mem::take(&mut text)),
                    details: generated.finish_reason.map(|reason| StreamDetails {
                        finish_reason: reason.as_tgi_str(),
                        generated_tokens: count,
                        seed,
                    }),
                };
                json_event(&response)
            }
            Err(error) => error.to_sse_event(),
        };
        Ok::<_, Infallible>(event)
    });
    Ok(Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The prompt's tokens with `logprobs[i]` as token `i + 1`'s. Fewer logprobs than that
/// (a node that did not compute them) leave the rest `null` rather than inventing figures.
fn prefill_tokens(
    validator: &Validator,
    prompt_ids: &[u32],
    logprobs: &[f32],
) -> Vec<PrefillToken> {
    prompt_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| PrefillToken {
            id,
            text: validator.token_text(id),
            logprob: i
                .checked_sub(1)
                .and_then(|j| logprobs.get(j))
                .copied()
                .filter(|l| l.is_finite()),
        })
        .collect()
}

fn token(validator: &Validator, generated: &GeneratedToken) -> Token {
    Token {
        id: generated.id,
        text: generated.text.clone(),
        logprob: generated.logprob,
        special: validator.is_special(generated.id),
    }
}

fn top_tokens(validator: &Validator, generated: &GeneratedToken) -> Vec<Token> {
    generated
        .top_logprobs
        .iter()
        .map(|&(id, logprob)| Token {
            id,
            text: validator.token_text(id),
            logprob,
            special: validator.is_special(id),
        })
        .collect()
}
