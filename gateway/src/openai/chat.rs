//! `POST /v1/chat/completions`: messages rendered with the model's chat template.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::tool_stream::{tool_calls_json, tool_sse_response, ChunkIds};
use super::tools::{template_tool_calls, ToolChoice, ToolMode, ToolPlan};
use super::{sse_response, CommonFields, Usage};
use crate::chat_template::ChatMessage;
use crate::error::GatewayError;
use crate::json::Json;
use crate::request::GeneratedToken;
use crate::sse::json_event;
use crate::state::{unix_now, AppState};
use crate::validation::{FieldNames, Prompt, Validator};

#[derive(Debug, Deserialize)]
pub(crate) struct ChatRequest {
    messages: Vec<RequestMessage>,
    max_tokens: Option<u32>,
    /// The newer name of `max_tokens`; wins when both are given.
    max_completion_tokens: Option<u32>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    tools: Option<Vec<serde_json::Value>>,
    tool_choice: Option<ToolChoice>,
    parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    common: CommonFields,
}

#[derive(Debug, Deserialize)]
struct RequestMessage {
    role: String,
    #[serde(default)]
    content: Option<MessageContent>,
    name: Option<String>,
    tool_calls: Option<serde_json::Value>,
    tool_call_id: Option<String>,
}

/// A string, or a list of parts of which only `text` parts are supported.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
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
        })
    }
}

#[derive(Debug, Serialize)]
struct ChatCompletion {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<Choice>,
    usage: Usage,
}

#[derive(Debug, Serialize)]
struct Choice {
    index: u32,
    message: OutputMessage,
    logprobs: Option<Logprobs>,
    finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
struct OutputMessage {
    role: &'static str,
    /// `null` when the answer is tool calls alone.
    content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<serde_json::Value>,
}

#[derive(Debug, Serialize)]
struct ChatChunk {
    id: String,
    object: &'static str,
    created: u64,
    model: String,
    choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

#[derive(Debug, Serialize)]
struct ChunkChoice {
    index: u32,
    delta: Delta,
    logprobs: Option<Logprobs>,
    finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
struct Delta {
    /// On the first chunk only.
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: String,
}

#[derive(Debug, Default, Serialize)]
struct Logprobs {
    content: Vec<TokenLogprob>,
}

#[derive(Debug, Serialize)]
struct TokenLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize)]
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

pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    Json(request): Json<ChatRequest>,
) -> Result<Response, GatewayError> {
    let with_logprobs = request.logprobs.unwrap_or(false);
    if let (Some(top), false) = (request.top_logprobs.filter(|&n| n > 0), with_logprobs) {
        return Err(GatewayError::InvalidParameter {
            field: "top_logprobs",
            reason: "needs `logprobs: true`".into(),
            given: top.to_string(),
        });
    }
    let mut parameters = request.common.parameters(
        request.max_completion_tokens.or(request.max_tokens),
        request.top_logprobs.filter(|_| with_logprobs),
    )?;
    let plan = ToolPlan::resolve(
        request.tools,
        request.tool_choice,
        request.parallel_tool_calls,
    )?;
    let forced = match &plan.mode {
        ToolMode::Forced(grammar) => {
            if parameters.grammar.is_some() {
                return Err(GatewayError::InvalidParameter {
                    field: "tool_choice",
                    reason: "a forced tool call cannot be combined with `response_format`".into(),
                    given: "required or a named function".into(),
                });
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
    let prompt = if plan.tools.is_empty() {
        Prompt::Chat(messages)
    } else {
        Prompt::ChatWithTools(messages, plan.tools.clone())
    };
    let generation = state
        .generate("chat_completions", prompt, parameters, FieldNames::CHAT)
        .await?;

    let id = format!("chatcmpl-{}", generation.request_id);
    let model = state.config().model_id.clone();
    let created = unix_now();
    let validator = Arc::clone(state.validator());

    if request.common.stream() && plan.parses_calls() {
        let ids = ChunkIds {
            id,
            model,
            created,
            include_usage: request.common.include_usage(),
        };
        return Ok(tool_sse_response(generation, plan, forced, ids).into_response());
    }
    if request.common.stream() {
        let usage_chunk = {
            let (id, model) = (id.clone(), model.clone());
            move |usage| {
                json_event(&ChatChunk {
                    id: id.clone(),
                    object: "chat.completion.chunk",
                    created,
                    model: model.clone(),
                    choices: Vec::new(),
                    usage: Some(usage),
                })
            }
        };
        let mut first = true;
        let chunk = move |token: &GeneratedToken| {
            let role = std::mem::take(&mut first).then_some("assistant");
            let logprobs = with_logprobs.then(|| {
                let mut logprobs = Logprobs::default();
                logprobs.push(&validator, token);
                logprobs
            });
            json_event(&ChatChunk {
                id: id.clone(),
                object: "chat.completion.chunk",
                created,
                model: model.clone(),
                choices: vec![ChunkChoice {
                    index: 0,
                    delta: Delta {
                        role,
                        content: token.text.clone(),
                    },
                    logprobs,
                    finish_reason: token.finish_reason.map(|r| r.as_openai_str()),
                }],
                usage: None,
            })
        };
        return Ok(sse_response(generation, &request.common, chunk, usage_chunk).into_response());
    }

    let prompt_tokens = generation.prompt_tokens;
    let request_id = generation.request_id.to_string();
    let completed = generation.collect().await?;
    let calls = plan
        .parses_calls()
        .then(|| plan.parse(&completed.text))
        .flatten();
    let (content, tool_calls, finish_reason) = match calls {
        Some((content, calls)) => (
            content,
            Some(tool_calls_json(&request_id, &calls, false)),
            "tool_calls",
        ),
        None => (
            Some(completed.text),
            None,
            completed.finish_reason.as_openai_str(),
        ),
    };
    let logprobs = with_logprobs.then(|| {
        let mut logprobs = Logprobs::default();
        for token in &completed.tokens {
            logprobs.push(&validator, token);
        }
        logprobs
    });
    Ok(axum::Json(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices: vec![Choice {
            index: 0,
            message: OutputMessage {
                role: "assistant",
                content,
                tool_calls,
            },
            logprobs,
            finish_reason,
        }],
        usage: Usage::new(prompt_tokens, completed.tokens.len()),
    })
    .into_response())
}
