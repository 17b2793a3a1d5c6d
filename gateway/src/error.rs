//! The gateway's one error type, and the only two places it becomes something a client sees: an
//! HTTP response ([`IntoResponse`]) and an SSE error event ([`GatewayError::to_sse_event`]).
//! Statuses and `error_type`s come from [`proto::ErrorCode`], never from here.

use std::path::PathBuf;

use axum::http::StatusCode;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use proto::ErrorCode;
use serde::Serialize;

use crate::request::RequestId;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    #[error("`{field}` must not be empty")]
    EmptyInput { field: &'static str },

    #[error("`{field}` must have at most {max_input_tokens} tokens, given {input_tokens}")]
    InputTooLong {
        field: &'static str,
        input_tokens: usize,
        max_input_tokens: usize,
    },

    #[error(
        "input tokens + `{field}` must be at most {max_total_tokens}, given {input_tokens} input \
         tokens and {max_new_tokens} `{field}`"
    )]
    TotalTooLong {
        field: &'static str,
        input_tokens: usize,
        max_new_tokens: usize,
        max_total_tokens: usize,
    },

    #[error("`{field}` {reason}, given {given}")]
    InvalidParameter {
        field: &'static str,
        reason: String,
        given: String,
    },

    #[error("`{field}` is not supported: {reason}")]
    Unsupported { field: &'static str, reason: String },

    #[error("model `{model_id}` has no chat template; use /v1/completions or /generate")]
    NoChatTemplate { model_id: String },

    #[error("chat template: {message}")]
    Template { message: String },

    #[error("tokenization failed: {message}")]
    Tokenizer { message: String },

    /// The body is not JSON at all.
    #[error("malformed JSON body: {message}")]
    MalformedJson { message: String },

    /// The body is JSON but not the request's shape (a missing field, a wrong type).
    #[error("invalid request body: {message}")]
    InvalidBody { message: String },

    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },

    #[error("model is overloaded: {max_concurrent_requests} requests are in flight")]
    Overloaded { max_concurrent_requests: usize },

    #[error("model is overloaded: the admission queue is full: {why}")]
    QueueFull { why: String },

    #[error("model is overloaded: waited {waited_ms} ms in the admission queue (the limit, --max-queue-wait-ms, is {max_queue_wait_ms} ms)")]
    QueueTimeout {
        waited_ms: u64,
        max_queue_wait_ms: u64,
    },

    #[error("backend unavailable: {reason}")]
    Unavailable { reason: String },

    #[error("request {request_id} timed out after {timeout_ms} ms")]
    Timeout {
        request_id: RequestId,
        timeout_ms: u64,
    },

    #[error(
        "request {request_id}: the token stream ended early, after {generated_tokens} tokens and \
         no finish reason"
    )]
    StreamEndedEarly {
        request_id: RequestId,
        generated_tokens: usize,
    },

    /// An error from upstream, keeping its kind (for gRPC: `ErrorCode::from_grpc`).
    #[error("{message}")]
    Backend { code: ErrorCode, message: String },

    #[error("internal error: {message}")]
    Internal { message: String },

    #[error("invalid gateway config: {message}")]
    Config { message: String },

    #[error("loading {path}: {message}")]
    Load { path: PathBuf, message: String },

    #[error("serving HTTP: {0}")]
    Serve(#[source] std::io::Error),
}

impl GatewayError {
    pub fn backend(code: ErrorCode, message: impl Into<String>) -> Self {
        Self::Backend {
            code,
            message: message.into(),
        }
    }

    /// No node has room for the request now: it waits in the queue and tries again.
    pub fn is_no_room(&self) -> bool {
        matches!(
            self,
            Self::Backend {
                code: ErrorCode::Overloaded,
                ..
            }
        )
    }

    pub fn code(&self) -> ErrorCode {
        match self {
            Self::EmptyInput { .. }
            | Self::InvalidParameter { .. }
            | Self::Unsupported { .. }
            | Self::NoChatTemplate { .. }
            | Self::Template { .. }
            | Self::Tokenizer { .. }
            | Self::InvalidBody { .. } => ErrorCode::Validation,
            Self::InputTooLong { .. } | Self::TotalTooLong { .. } => ErrorCode::InputTooLong,
            Self::MalformedJson { .. } => ErrorCode::BadRequest,
            Self::NotFound { .. } => ErrorCode::NotFound,
            Self::Overloaded { .. } | Self::QueueFull { .. } | Self::QueueTimeout { .. } => {
                ErrorCode::Overloaded
            }
            Self::Unavailable { .. } => ErrorCode::Unavailable,
            Self::Timeout { .. } => ErrorCode::Timeout,
            Self::Backend { code, .. } => *code,
            Self::StreamEndedEarly { .. }
            | Self::Internal { .. }
            | Self::Config { .. }
            | Self::Load { .. }
            | Self::Serve(_) => ErrorCode::Internal,
        }
    }

    /// The data of the SSE event that ends a failed stream: `data: {"error": ..., "error_type":
    /// ...}`, as TGI sends it. OpenAI-shaped streams end with the same event (and no `[DONE]`).
    pub fn to_sse_event(&self) -> Event {
        let body = self.reported();
        Event::default()
            .json_data(&body)
            .unwrap_or_else(|_| Event::default().data(body.error))
    }

    /// Logs and counts the error as sent to a client, and returns its body.
    fn reported(&self) -> ErrorBody {
        let code = self.code();
        metrics::counter!(crate::metrics::ERRORS_TOTAL, "error_type" => code.as_str()).increment(1);
        if code.http_status() >= 500 {
            tracing::warn!(error_type = code.as_str(), error = %self, "request failed");
        } else {
            tracing::debug!(error_type = code.as_str(), error = %self, "request rejected");
        }
        ErrorBody {
            error: self.to_string(),
            error_type: code.error_type(),
        }
    }
}

/// The body of every error response and SSE error event.
#[derive(Debug, Serialize)]
struct ErrorBody {
    error: String,
    error_type: &'static str,
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let code = self.code();
        let status =
            StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(self.reported())).into_response();
        // For the request span (see `server::http_request_span`): the code travels with the
        // response, so nothing has to read the body back.
        response.extensions_mut().insert(code);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_come_from_the_code_table() {
        let cases = [
            (GatewayError::EmptyInput { field: "inputs" }, 422),
            (
                GatewayError::InputTooLong {
                    field: "inputs",
                    input_tokens: 9,
                    max_input_tokens: 8,
                },
                422,
            ),
            (
                GatewayError::MalformedJson {
                    message: "x".into(),
                },
                400,
            ),
            (
                GatewayError::Overloaded {
                    max_concurrent_requests: 1,
                },
                429,
            ),
            (GatewayError::Unavailable { reason: "x".into() }, 503),
            (GatewayError::backend(ErrorCode::KvTransfer, "x"), 500),
        ];
        for (error, status) in cases {
            assert_eq!(error.into_response().status().as_u16(), status);
        }
    }

    #[test]
    fn messages_name_the_limit_and_the_value() {
        let message = GatewayError::InputTooLong {
            field: "inputs",
            input_tokens: 1500,
            max_input_tokens: 1024,
        }
        .to_string();
        assert!(
            message.contains("1024") && message.contains("1500"),
            "{message}"
        );
    }
}
