//! `POST /v1/completions`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::{sse_response, CommonFields, Usage};
use crate::error::GatewayError;
use crate::json::Json;
use crate::request::GeneratedToken;
use crate::sse::json_event;
use crate::state::{unix_now, AppState};
use crate::validation::{FieldNames, Prompt, Validator};

/// `prompt`: a string, or a list holding exactly one.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    prompt: PromptInput,
    max_tokens: Option<u32>,
    /// How many alternatives to report per token; any value (0 too) turns logprobs on.
    logprobs: Option<u32>,
    echo: Option<bool>,
    #[serde(flatten)]
    common: CommonFields,
}

/// Both the response and each streamed chunk.
#[derive(Debug, Serialize)]
struct Completion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
struct Choice {
    index: u32,
    text: String,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
struct Logprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<BTreeMap<String, f32>>,
    text_offset: Vec<usize>,
}

impl Logprobs {
    /// Adds `token`, whose text starts at byte `offset` of the output.
    fn push(&mut self, validator: &Validator, token: &GeneratedToken, offset: usize) {
        self.tokens.push(token.text.clone());
        self.token_logprobs.push(token.logprob);
        self.top_logprobs.push(
            token
                .top_logprobs
                .iter()
                .map(|&(id, logprob)| (validator.token_text(id), logprob))
                .collect(),
        );
        self.text_offset.push(offset);
    }
}

pub(crate) async fn completions(
    State(state): State<AppState>,
    Json(request): Json<CompletionRequest>,
) -> Result<Response, GatewayError> {
    let prompt = match request.prompt {
        PromptInput::One(prompt) => prompt,
        PromptInput::Many(mut prompts) if prompts.len() == 1 => prompts.remove(0),
        PromptInput::Many(prompts) => {
            return Err(GatewayError::InvalidParameter {
                field: "prompt",
                reason: "must be a string or a list of exactly one string".into(),
                given: format!("a list of {}", prompts.len()),
            })
        }
    };
    if request.echo.unwrap_or(false) {
        return Err(GatewayError::Unsupported {
            field: "echo",
            reason: "only false is accepted".into(),
        });
    }
    let parameters = request
        .common
        .parameters(request.max_tokens, request.logprobs)?;
    let generation = state
        .generate(
            "completions",
            Prompt::Text(prompt),
            parameters,
            FieldNames::COMPLETIONS,
        )
        .await?;

    let id = format!("cmpl-{}", generation.request_id);
    let model = state.config().model_id.clone();
    let created = unix_now();
    let with_logprobs = request.logprobs.is_some();
    let validator = Arc::clone(state.validator());

    if request.common.stream() {
        let usage_chunk = {
            let (id, model) = (id.clone(), model.clone());
            move |usage| {
                json_event(&Completion {
                    id: id.clone(),
                    object: "text_completion",
                    created,
                    model: model.clone(),
                    choices: Vec::new(),
                    usage: Some(usage),
                })
            }
        };
        let mut offset = 0;
        let chunk = move |token: &GeneratedToken| {
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                logprobs.push(&validator, token, offset);
                logprobs
            });
            offset += token.text.len();
            json_event(&Completion {
                id: id.clone(),
                object: "text_completion",
                created,
                model: model.clone(),
                choices: vec![Choice {
                    index: 0,
                    text: token.text.clone(),
                    logprobs,
                    finish_reason: token.finish_reason.map(|r| r.as_openai_str()),
                }],
                usage: None,
            })
        };
        return Ok(sse_response(generation, &request.common, chunk, usage_chunk).into_response());
    }

    let prompt_tokens = generation.prompt_tokens;
    let completed = generation.collect().await?;
    let logprobs = with_logprobs.then(|| {
        let mut logprobs = Logprobs::default();
        let mut offset = 0;
        for token in &completed.tokens {
            logprobs.push(&validator, token, offset);
            offset += token.text.len();
        }
        logprobs
    });
    Ok(axum::Json(Completion {
        id,
        object: "text_completion",
        created,
        model,
        choices: vec![Choice {
            index: 0,
            text: completed.text,
            logprobs,
            finish_reason: Some(completed.finish_reason.as_openai_str()),
        }],
        usage: Some(Usage::new(prompt_tokens, completed.tokens.len())),
    })
    .into_response())
}
