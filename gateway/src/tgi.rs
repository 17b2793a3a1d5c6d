//! TGI's generation API: `POST /generate` and `POST /generate_stream`, in TGI's shapes.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;
use crate::json::Json;
use crate::request::GeneratedToken;
use crate::sse::json_event;
use crate::state::AppState;
use crate::structured::TgiGrammar;
use crate::validation::{FieldNames, GenerateParameters, Prompt, Validator};

#[derive(Debug, Deserialize)]
pub(crate) struct GenerateRequest {
    inputs: String,
    #[serde(default)]
    parameters: Option<TgiParameters>,
}

/// Every field may be absent or `null`, as TGI's clients send them.
#[derive(Debug, Default, Deserialize)]
struct TgiParameters {
    max_new_tokens: Option<u32>,
    temperature: Option<f32>,
    top_k: Option<i64>,
    top_p: Option<f32>,
    repetition_penalty: Option<f32>,
    do_sample: Option<bool>,
    seed: Option<u64>,
    stop: Option<Vec<String>>,
    details: Option<bool>,
    top_n_tokens: Option<u32>,
    return_full_text: Option<bool>,
    grammar: Option<TgiGrammar>,
}

impl TgiParameters {
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
        })
    }
}

#[derive(Debug, Serialize)]
struct GenerateResponse {
    generated_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details>,
}

#[derive(Debug, Serialize)]
struct Details {
    finish_reason: &'static str,
    generated_tokens: usize,
    seed: Option<u64>,
    prefill: Vec<Token>,
    tokens: Vec<Token>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    top_tokens: Vec<Vec<Token>>,
}

#[derive(Debug, Serialize)]
struct Token {
    id: u32,
    text: String,
    logprob: f32,
    special: bool,
}

#[derive(Debug, Serialize)]
struct StreamResponse {
    /// 1 for the first token, as in TGI.
    index: usize,
    token: Token,
    top_tokens: Vec<Token>,
    generated_text: Option<String>,
    details: Option<StreamDetails>,
}

#[derive(Debug, Serialize)]
struct StreamDetails {
    finish_reason: &'static str,
    generated_tokens: usize,
    seed: Option<u64>,
}

pub(crate) async fn generate(
    State(state): State<AppState>,
    Json(request): Json<GenerateRequest>,
) -> Result<Response, GatewayError> {
    let parameters = request.parameters.unwrap_or_default();
    let prompt = request.inputs;
    let generation = state
        .generate(
            "generate",
            Prompt::Text(prompt.clone()),
            parameters.generate_parameters()?,
            FieldNames::TGI,
        )
        .await?;
    let seed = generation.seed;
    let completed = generation.collect().await?;
    let validator = state.validator();
    let details = parameters.details.unwrap_or(false).then(|| Details {
        finish_reason: completed.finish_reason.as_tgi_str(),
        generated_tokens: completed.tokens.len(),
        seed,
        prefill: Vec::new(),
        tokens: completed
            .tokens
            .iter()
            .map(|t| token(validator, t))
            .collect(),
        top_tokens: if parameters.top_n_tokens.unwrap_or(0) > 0 {
            completed
                .tokens
                .iter()
                .map(|t| top_tokens(validator, t))
                .collect()
        } else {
            Vec::new()
        },
    });
    let generated_text = if parameters.return_full_text.unwrap_or(false) {
        prompt + &completed.text
    } else {
        completed.text
    };
    Ok(axum::Json(GenerateResponse {
        generated_text,
        details,
    })
    .into_response())
}

pub(crate) async fn generate_stream(
    State(state): State<AppState>,
    Json(request): Json<GenerateRequest>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, GatewayError> {
    let parameters = request.parameters.unwrap_or_default();
    let mut text = if parameters.return_full_text.unwrap_or(false) {
        request.inputs.clone()
    } else {
        String::new()
    };
    let generation = state
        .generate(
            "generate_stream",
            Prompt::Text(request.inputs),
            parameters.generate_parameters()?,
            FieldNames::TGI,
        )
        .await?;
    let seed = generation.seed;
    let validator = Arc::clone(state.validator());
    let mut count = 0;
    let events = generation.tokens.map(move |item| {
        let event = match item {
            Ok(generated) => {
                count += 1;
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
        Ok(event)
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
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
