//! `POST /v1/chat/completions`: messages rendered with the model's chat template; the output
//! read back in the model's family's format ([`super::family`]): a thinking model's `<think>`
//! block as `reasoning_content`, its calls as `tool_calls`.

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::reasoning::ThinkSplitter;
use super::stream::{stream_choices, ChunkHeader};
use super::tool_stream::{tool_calls_json, tool_sse_response, ChunkIds, OutputReading};
use super::tools::{template_tool_calls, ToolChoice, ToolMode, ToolPlan};
use super::{invalid, start_all, CommonFields, Usage};
use crate::chat_template::{ChatMessage, TemplateKwargs};
use crate::error::{GatewayError, OpenAiError};
use crate::json::OpenAiJson;
use crate::request::GeneratedToken;
use crate::state::AppState;
use crate::validation::{FieldNames, Prompt, Validator};

/// OpenAI's largest `top_logprobs`.
const MAX_TOP_LOGPROBS: u32 = 20;

#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub(crate) struct ChatRequest {
    #[schema(min_items = 1)]
    messages: Vec<RequestMessage>,
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    max_tokens: Option<u32>,
    /// The newer name of `max_tokens`; wins when both are given.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    max_completion_tokens: Option<u32>,
    logprobs: Option<bool>,
    /// Needs `logprobs: true` when above 0.
    #[schema(maximum = 20)]
    #[serde(default, deserialize_with = "crate::json::int::opt")]
    top_logprobs: Option<u32>,
    tools: Option<Vec<serde_json::Value>>,
    tool_choice: Option<ToolChoice>,
    parallel_tool_calls: Option<bool>,
    /// Extra variables for the chat template (vLLM's and SGLang's field), such as Qwen3's
    /// `{"enable_thinking": false}`. Not the names the gateway passes itself: `messages`,
    /// `tools`, `documents`, `add_generation_prompt`, `continue_final_message`, `bos_token`,
    /// `eos_token`, `raise_exception`, `strftime_now`.
    #[schema(value_type = Option<Object>)]
    chat_template_kwargs: Option<serde_json::Value>,
    /// Qwen's top-level spelling of `chat_template_kwargs.enable_thinking`; the object's own
    /// value wins when both are given.
    enable_thinking: Option<bool>,
    #[serde(flatten)]
    common: CommonFields,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct RequestMessage {
    role: String,
    #[serde(default)]
    content: Option<MessageContent>,
    name: Option<String>,
    tool_calls: Option<serde_json::Value>,
    tool_call_id: Option<String>,
    /// An earlier answer's reasoning, which thinking models' templates read back.
    reasoning_content: Option<String>,
}

/// A string, or a list of parts of which only `text` parts are supported.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl RequestMessage {
    fn into_chat_message(self) -> Result<ChatMessage, GatewayError> {
        let content = match self.content {
            None => String::new(),
            Some(MessageContent::Text(text)) => text,
            Some(MessageContent::Parts(parts)) => {
                let mut content = String::new();
                for part in parts {
                    match (part.kind.as_str(), part.text) {
                        ("text", Some(text)) => content.push_str(&text),
                        (kind, _) => {
                            return Err(GatewayError::Unsupported {
                                field: "messages.content",
                                reason: format!("only text parts are accepted, given `{kind}`"),
                            })
                        }
                    }
                }
                content
            }
        };
        Ok(ChatMessage {
            role: self.role,
            content,
            name: self.name,
            tool_calls: self.tool_calls.map(template_tool_calls),
            tool_call_id: self.tool_call_id,
            reasoning_content: self.reasoning_content,
            ..ChatMessage::default()
        })
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct ChatCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    system_fingerprint: String,
    choices: Vec<Choice>,
    usage: Usage,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Choice {
    index: u32,
    message: OutputMessage,
    logprobs: Option<Logprobs>,
    finish_reason: &'static str,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct OutputMessage {
    role: &'static str,
    /// `null` when the answer is tool calls alone.
    content: Option<String>,
    /// A thinking model's `<think>` block (vLLM's and DeepSeek's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<serde_json::Value>,
}

/// A streamed chunk's choice (the chunk around it: [`ChunkHeader`]).
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct ChunkChoice {
    index: u32,
    delta: Delta,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

/// `role` and `tool_calls` are on every chunk: OpenAI sends the role on the first only, but
/// TGI's clients (`text_generation`'s `ChoiceDelta`) require both on each.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Delta {
    role: &'static str,
    content: String,
    /// What a thinking model's `<think>` block adds with this token.
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    tool_calls: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Default, Serialize, utoipa::ToSchema)]
struct Logprobs {
    content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct TokenLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct TopLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

impl Logprobs {
    fn push(&mut self, validator: &Validator, token: &GeneratedToken) {
        self.content.push(TokenLogprob {
            token: token.text.clone(),
            logprob: token.logprob,
            bytes: token.text.as_bytes().to_vec(),
            top_logprobs: token
                .top_logprobs
                .iter()
                .map(|&(id, logprob)| {
                    let token = validator.token_text(id);
                    TopLogprob {
                        bytes: token.as_bytes().to_vec(),
                        token,
                        logprob,
                    }
                })
                .collect(),
        });
    }
}

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "OpenAI",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "The chat completion; server-sent chunks with `stream: true`", body = ChatCompletion),
        (status = 400, description = "Invalid request", body = crate::error::OpenAiErrorBody),
        (status = 404, description = "Unknown model", body = crate::error::OpenAiErrorBody),
        (status = 413, description = "Body over --max-body-bytes", body = crate::error::OpenAiErrorBody),
        (status = 429, description = "Overloaded", body = crate::error::OpenAiErrorBody),
    )
)]
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(request): OpenAiJson<ChatRequest>,
) -> Result<Response, OpenAiError> {
    state.check_model(request.common.model())?;
    let with_logprobs = request.logprobs.unwrap_or(false);
    if let Some(top) = request.top_logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
        return Err(invalid(
            "top_logprobs",
            format!("must be between 0 and {MAX_TOP_LOGPROBS}"),
            top,
        )
        .into());
    }
    if let (Some(top), false) = (request.top_logprobs.filter(|&n| n > 0), with_logprobs) {
        return Err(invalid("top_logprobs", "needs `logprobs: true`", top).into());
    }
    // Either spelling is checked, not only the one that wins, against the bounds the OpenAPI
    // document states for both (a prompt is at least one token, so the winner's own check,
    // against the room the prompt leaves, is tighter).
    let ceiling = state.limits().max_total_tokens.saturating_sub(1);
    for (field, value) in [
        ("max_tokens", request.max_tokens),
        ("max_completion_tokens", request.max_completion_tokens),
    ] {
        if value == Some(0) {
            return Err(invalid(field, "must be at least 1", 0).into());
        }
        if let Some(value) = value.filter(|&v| v as usize > ceiling) {
            return Err(invalid(
                field,
                format!("must be below max_total_tokens ({})", ceiling + 1),
                value,
            )
            .into());
        }
    }
    let mut kwargs = TemplateKwargs::from_request(request.chat_template_kwargs)?;
    if let Some(enable) = request.enable_thinking {
        kwargs.set_default("enable_thinking", enable.into());
    }
    let n = request.common.n();
    let mut parameters = request.common.parameters(
        request.max_completion_tokens.or(request.max_tokens),
        request.top_logprobs.filter(|_| with_logprobs),
    )?;
    // Checking the tools compiles each one's parameters: CPU work, off the runtime.
    let (tools, choice, parallel) = (
        request.tools,
        request.tool_choice,
        request.parallel_tool_calls,
    );
    let mut plan = tokio::task::spawn_blocking(move || ToolPlan::resolve(tools, choice, parallel))
        .await
        .map_err(|e| GatewayError::Internal {
            message: format!("tool check task: {e}"),
        })??;
    // The model's family, from its template: how it writes calls and whether it thinks aloud.
    let family = state.validator().output_family();
    plan.syntax = family.tools;
    let markers = family.markers(|text| state.validator().token_id(text));
    let forced = match &plan.mode {
        ToolMode::Forced(grammar) => {
            if parameters.grammar.is_some() {
                return Err(invalid(
                    "tool_choice",
                    "a forced tool call cannot be combined with `response_format`",
                    "required or a named function",
                )
                .into());
            }
            parameters.grammar = Some(grammar.clone());
            true
        }
        ToolMode::Off | ToolMode::Auto => false,
    };
    let messages = request
        .messages
        .into_iter()
        .map(RequestMessage::into_chat_message)
        .collect::<Result<Vec<_>, _>>()?;
    let prompt = if plan.tools.is_empty() && kwargs.is_empty() {
        Prompt::Chat(messages)
    } else {
        Prompt::ChatWith(messages, plan.tools.clone(), kwargs)
    };
    if n > 1 && request.common.stream() && plan.parses_calls() {
        // Tool calls are held back and parsed per stream; one stream is what that supports.
        return Err(invalid("n", "must be 1 when streaming with `tools`", n).into());
    }
    let groups = start_all(
        &state,
        "chat_completions",
        vec![prompt],
        parameters,
        FieldNames::CHAT,
        n,
    )
    .await?;

    let header = ChunkHeader::new(
        &state,
        format!("chatcmpl-{}", groups[0].request_id),
        "chat.completion.chunk",
    );
    let validator = Arc::clone(state.validator());

    if request.common.stream() && plan.parses_calls() {
        let group = groups.into_iter().next().expect("one prompt was started");
        let prompt_tokens = group.prompt_ids.len();
        let request_id = group.request_id.to_string();
        let tokens = group.streams.into_iter().next().expect("n is 1");
        let ids = ChunkIds {
            header,
            include_usage: request.common.include_usage(),
            sends_done: request.common.sends_done(),
        };
        let reading = OutputReading {
            markers,
            think: family.reasoning,
        };
        let sse = tool_sse_response(
            request_id,
            tokens,
            prompt_tokens,
            plan,
            forced,
            ids,
            reading,
        );
        return Ok(sse.into_response());
    }
    if request.common.stream() {
        // Each choice's reasoning is split off by its own splitter.
        let mut splitters: HashMap<usize, ThinkSplitter> = HashMap::new();
        let sse = stream_choices(groups, header, &request.common, move |choice, token| {
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                logprobs.push(&validator, token);
                logprobs
            });
            let (reasoning_content, content) = match family.reasoning {
                Some(start) => {
                    let split = splitters
                        .entry(choice)
                        .or_insert_with(|| ThinkSplitter::new(start))
                        .push(markers.text(token), token.finish_reason.is_some());
                    let reasoning = Some(split.reasoning).filter(|r| !r.is_empty());
                    (reasoning, split.content)
                }
                None => (None, token.text.clone()),
            };
            ChunkChoice {
                index: choice as u32,
                delta: Delta {
                    role: "assistant",
                    content,
                    reasoning_content,
                    tool_calls: None,
                },
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
        let request_id = group.request_id.to_string();
        for completed in group.collect().await? {
            completion_tokens += completed.tokens.len();
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                for token in &completed.tokens {
                    logprobs.push(&validator, token);
                }
                logprobs
            });
            let index = choices.len() as u32;
            // The text as the parsers read it (marker tokens included), without its reasoning.
            let output = if markers.is_empty() {
                completed.text
            } else {
                markers.output(&completed.tokens)
            };
            let (reasoning_content, answer) = match family.reasoning {
                Some(start) => {
                    let split = ThinkSplitter::split_all(start, &output);
                    (
                        Some(split.reasoning).filter(|r| !r.is_empty()),
                        split.content,
                    )
                }
                None => (None, output),
            };
            let calls = plan
                .parses_calls()
                .then(|| plan.calls(&answer, true))
                .flatten();
            let (content, tool_calls, finish_reason) = match calls {
                // A call cut off (by max_tokens) is dropped: the finish reason says why.
                Some(found) => (
                    found.content,
                    Some(tool_calls_json(
                        plan.syntax,
                        &request_id,
                        index as usize,
                        &found.calls,
                        0,
                        false,
                    )),
                    if found.clean {
                        "tool_calls"
                    } else {
                        completed.finish_reason.as_openai_str()
                    },
                ),
                None => (Some(answer), None, completed.finish_reason.as_openai_str()),
            };
            choices.push(Choice {
                index,
                message: OutputMessage {
                    role: "assistant",
                    content,
                    reasoning_content,
                    tool_calls,
                },
                logprobs,
                finish_reason,
            });
        }
    }
    Ok(axum::Json(ChatCompletion {
        id: header.id,
        object: "chat.completion",
        created: header.created,
        model: header.model,
        system_fingerprint: header.system_fingerprint,
        choices,
        usage: Usage::new(prompt_tokens, completion_tokens),
    })
    .into_response())
}
