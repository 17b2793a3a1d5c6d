//! `POST /v1/completions`.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::stream::{stream_choices, ChunkHeader};
use super::{invalid, start_all, CommonFields, Usage, MAX_N};
use crate::error::{GatewayError, OpenAiError};
use crate::json::OpenAiJson;
use crate::request::GeneratedToken;
use crate::sequences::best_first;
use crate::state::AppState;
use crate::validation::{FieldNames, Prompt, Validator};

/// `prompt`: a string, a list of strings, a list of token ids, or a list of such lists. Each
/// prompt of a list gets its own choices.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
enum PromptInput {
    One(String),
    Many(Vec<String>),
    Ids(#[serde(deserialize_with = "crate::json::int::vec")] Vec<u32>),
    ManyIds(#[serde(deserialize_with = "crate::json::int::vec_vec")] Vec<Vec<u32>>),
}

impl PromptInput {
    fn into_prompts(self) -> Result<Vec<Prompt>, GatewayError> {
        let prompts: Vec<Prompt> = match self {
            Self::One(text) => vec![Prompt::Text(text)],
            Self::Many(texts) => texts.into_iter().map(Prompt::Text).collect(),
            Self::Ids(ids) => vec![Prompt::Ids(ids)],
            Self::ManyIds(lists) => lists.into_iter().map(Prompt::Ids).collect(),
        };
        if prompts.is_empty() {
            return Err(GatewayError::EmptyInput { field: "prompt" });
        }
        if prompts.len() > MAX_PROMPTS {
            return Err(invalid(
                "prompt",
                format!("must hold at most {MAX_PROMPTS} prompts"),
                prompts.len(),
            ));
        }
        Ok(prompts)
    }
}

/// [`PromptInput`] as the OpenAPI document shows it: never empty, at most [`MAX_PROMPTS`]
/// prompts. The validator's rules, which derived schemas of untagged variants cannot carry.
struct PromptSchema;

impl utoipa::PartialSchema for PromptSchema {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let text = serde_json::json!({"type": "string", "minLength": 1});
        let ids = serde_json::json!({"type": "array", "minItems": 1,
            "items": {"type": "integer", "format": "int32", "minimum": 0}});
        let many = |items: &serde_json::Value| {
            serde_json::json!({"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                "items": items})
        };
        let schema = serde_json::json!({
            "description": "A string, a list of strings, a list of token ids, or a list of such lists; never empty.",
            "oneOf": [text, many(&text), ids, many(&ids)],
        });
        crate::structured::schema_literal(schema)
    }
}

impl utoipa::ToSchema for PromptSchema {}

/// The most prompts one request may carry.
const MAX_PROMPTS: usize = 64;
/// OpenAI's largest `logprobs` on completions.
const MAX_LOGPROBS: u32 = 5;
/// OpenAI's largest `best_of`.
const MAX_BEST_OF: u32 = 20;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct CompletionRequest {
    #[schema(value_type = PromptSchema)]
    prompt: PromptInput,
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    max_tokens: Option<u32>,
    /// How many alternatives to report per token; any value (0 too) turns logprobs on.
    #[schema(maximum = 5)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    logprobs: Option<u32>,
    echo: Option<bool>,
    /// Sequences generated per prompt, of which the `n` with the highest logprob per token
    /// are returned; at least `n`.
    #[schema(minimum = 1, maximum = 20)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    best_of: Option<u32>,
    #[serde(flatten)]
    common: CommonFields,
}

impl CompletionRequest {
    /// Sequences to run per prompt, checked against `n`.
    fn best_of(&self) -> Result<usize, GatewayError> {
        let n = self.common.n();
        let Some(best_of) = self.best_of else {
            return Ok(n);
        };
        if !(1..=MAX_BEST_OF).contains(&best_of) {
            return Err(invalid(
                "best_of",
                format!("must be between 1 and {MAX_BEST_OF}"),
                best_of,
            ));
        }
        if (best_of as usize) < n {
            return Err(invalid(
                "best_of",
                format!("must be at least n ({n})"),
                best_of,
            ));
        }
        if best_of as usize > n && self.common.stream() {
            return Err(invalid("best_of", "must equal n when streaming", best_of));
        }
        Ok(best_of as usize)
    }
}

/// The response; each streamed chunk has its shape too (see [`ChunkHeader`]).
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Completion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

/// Named apart from chat's `Choice` in the OpenAPI document, where one name is one schema.
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = CompletionChoice)]
struct Choice {
    index: u32,
    text: String,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize, utoipa::ToSchema)]
#[schema(as = CompletionLogprobs)]
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

#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "OpenAI",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion; server-sent chunks with `stream: true`", body = Completion),
        (status = 400, description = "Invalid request", body = crate::error::OpenAiErrorBody),
        (status = 404, description = "Unknown model", body = crate::error::OpenAiErrorBody),
        (status = 413, description = "Body over --max-body-bytes", body = crate::error::OpenAiErrorBody),
        (status = 429, description = "Overloaded", body = crate::error::OpenAiErrorBody),
    )
)]
pub(crate) async fn completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<CompletionRequest>,
) -> Result<Response, OpenAiError> {
    state.check_model(request.common.model())?;
    if request.echo.unwrap_or(false) {
        return Err(GatewayError::Unsupported {
            field: "echo",
            reason: "only false is accepted".into(),
        }
        .into());
    }
    if let Some(logprobs) = request.logprobs.filter(|&n| n > MAX_LOGPROBS) {
        return Err(invalid(
            "logprobs",
            format!("must be between 0 and {MAX_LOGPROBS}"),
            logprobs,
        )
        .into());
    }
    let best_of = request.best_of()?;
    let n = request.common.n();
    let parameters = request
        .common
        .parameters(request.max_tokens, request.logprobs)?;
    let prompts = request.prompt.into_prompts()?;
    // One request may not ask for more sequences than `n` alone may.
    if prompts.len() * best_of > MAX_N as usize {
        return Err(invalid(
            "n",
            format!("times `best_of` times the prompts must be at most {MAX_N}"),
            format!("{} prompts x {best_of}", prompts.len()),
        )
        .into());
    }
    let groups = start_all(
        &state,
        "completions",
        prompts,
        parameters,
        FieldNames::COMPLETIONS,
        best_of,
    )
    .await?;

    let header = ChunkHeader::new(
        &state,
        format!("cmpl-{}", groups[0].request_id),
        "text_completion",
    );
    let with_logprobs = request.logprobs.is_some();
    let validator = Arc::clone(state.validator());

    if request.common.stream() {
        // Each choice's text so far, for `text_offset`.
        let mut offsets = vec![0; groups.iter().map(|g| g.streams.len()).sum()];
        let sse = stream_choices(groups, header, &request.common, move |choice, token| {
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                logprobs.push(&validator, token, offsets[choice]);
                logprobs
            });
            offsets[choice] += token.text.len();
            Choice {
                index: choice as u32,
                text: token.text.clone(),
                logprobs,
                finish_reason: token.finish_reason.map(|r| r.as_openai_str()),
            }
        });
        return Ok(sse.into_response());
    }

    let mut choices = Vec::new();
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for group in groups {
        prompt_tokens += group.prompt_ids.len();
        let completed = group.collect().await?;
        completion_tokens += completed.iter().map(|c| c.tokens.len()).sum::<usize>();
        let mut order = best_first(&completed);
        if best_of == n {
            // Without `best_of` the choices keep their order.
            order.sort_unstable();
        }
        for &i in order.iter().take(n) {
            let completed = &completed[i];
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                let mut offset = 0;
                for token in &completed.tokens {
                    logprobs.push(&validator, token, offset);
                    offset += token.text.len();
                }
                logprobs
            });
            choices.push(Choice {
                index: choices.len() as u32,
                text: completed.text.clone(),
                logprobs,
                finish_reason: Some(completed.finish_reason.as_openai_str()),
            });
        }
    }
    Ok(axum::Json(Completion {
        id: header.id,
        object: header.object,
        created: header.created,
        model: header.model,
        system_fingerprint: header.system_fingerprint,
        choices,
        usage: Some(Usage::new(prompt_tokens, completion_tokens)),
    })
    .into_response())
}
