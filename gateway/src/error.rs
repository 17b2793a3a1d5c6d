//! The gateway's one error type, and the only two places it becomes something a client sees: an
//! HTTP response ([`IntoResponse`]; at the HTTP edge in the shape of the path's API, see
//! [`ApiShape`]) and an SSE error event ([`GatewayError::to_sse_event`]). Statuses and
//! `error_type`s come from [`proto::ErrorCode`], never from here.

use std::path::PathBuf;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use proto::ErrorCode;
use serde::Serialize;

use crate::request_id::RequestId;

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
        "`{inputs_field}` ({input_tokens} tokens) + `{field}` ({max_new_tokens}) exceeds \
         max_total_tokens {max_total_tokens}"
    )]
    TotalTooLong {
        /// The prompt's field (`inputs`, `prompt`, `messages`).
        inputs_field: &'static str,
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

    /// OpenAI's `model` names something this gateway does not serve.
    #[error("the model `{given}` does not exist; this server serves {served}")]
    ModelNotFound { given: String, served: String },

    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },

    #[error("method {method} is not allowed on {path} (see the Allow header)")]
    MethodNotAllowed { method: String, path: String },

    #[error(
        "the request body must be at most {limit_bytes} bytes (--max-body-bytes), given {}",
        given_size(*.given_bytes)
    )]
    BodyTooLarge {
        limit_bytes: usize,
        /// Its `Content-Length`; `None` for a chunked body, cut off at the limit.
        given_bytes: Option<u64>,
    },

    #[error("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")]
    MissingApiKey,

    /// Never says which key was close, or how long the keys are.
    #[error("invalid API key")]
    InvalidApiKey,

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
            Self::NotFound { .. } | Self::ModelNotFound { .. } => ErrorCode::NotFound,
            Self::MethodNotAllowed { .. } => ErrorCode::MethodNotAllowed,
            Self::BodyTooLarge { .. } => ErrorCode::PayloadTooLarge,
            Self::MissingApiKey | Self::InvalidApiKey => ErrorCode::Unauthorized,
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
    /// ...}`, as TGI sends it.
    pub fn to_sse_event(&self) -> Event {
        let body = self.reported();
        Event::default()
            .json_data(&body)
            .unwrap_or_else(|_| Event::default().data(body.error))
    }

    /// The SSE event that ends a failed OpenAI stream: `data: {"error": {"message", "type",
    /// "param", "code"}}`, the chunk OpenAI's SDKs raise an `APIError` from (vLLM sends the
    /// same). No `[DONE]` follows: the stream did not complete.
    pub(crate) fn to_openai_sse_event(&self) -> Event {
        let body = self.openai_body(self.reported());
        Event::default()
            .json_data(&body)
            .unwrap_or_else(|_| Event::default().data(body.error.message))
    }

    fn openai_body(&self, body: ErrorBody) -> OpenAiErrorBody {
        OpenAiErrorBody {
            error: OpenAiErrorFields {
                message: body.error,
                error_type: body.error_type,
                param: self.param(),
                code: self.openai_code(),
            },
        }
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
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorBody {
    error: String,
    error_type: &'static str,
}

/// OpenAI's error body, which its SDKs parse: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct OpenAiErrorBody {
    error: OpenAiErrorFields,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct OpenAiErrorFields {
    message: String,
    #[serde(rename = "type")]
    error_type: &'static str,
    param: Option<&'static str>,
    code: &'static str,
}

/// Whose error shape a response takes. Errors raised at the HTTP edge, before a request
/// reaches its API (a missing key, a body over the limit, a wrong method, an unknown path),
/// take the shape of the API the path belongs to: OpenAI's under `/v1/`, TGI's elsewhere.
/// The APIs' own errors keep TGI's shape on every route (see [`IntoResponse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ApiShape {
    Tgi,
    OpenAi,
}

impl ApiShape {
    pub(crate) fn of(path: &str) -> Self {
        if path == "/v1" || path.starts_with("/v1/") {
            Self::OpenAi
        } else {
            Self::Tgi
        }
    }
}

impl GatewayError {
    /// The error as a response in `shape`: the status from the code table (OpenAI's variant of
    /// it on OpenAI's routes), a JSON body, and `WWW-Authenticate: Bearer` when the client must
    /// present an API key.
    pub(crate) fn into_shaped_response(self, shape: ApiShape) -> Response {
        let code = self.code();
        let status = match shape {
            ApiShape::Tgi => code.http_status(),
            ApiShape::OpenAi => code.openai_http_status(),
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = self.reported();
        let mut response = match shape {
            ApiShape::Tgi => (status, axum::Json(body)).into_response(),
            ApiShape::OpenAi => (status, axum::Json(self.openai_body(body))).into_response(),
        };
        if matches!(self, Self::MissingApiKey | Self::InvalidApiKey) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // For the request span (see `server::http_request_span`): the code travels with the
        // response, so nothing has to read the body back.
        response.extensions_mut().insert(code);
        response
    }

    /// OpenAI's `code`: its own names for a missing or wrong key and an unknown model, the code
    /// table's otherwise.
    fn openai_code(&self) -> &'static str {
        match self {
            Self::MissingApiKey => "missing_api_key",
            Self::InvalidApiKey => "invalid_api_key",
            Self::ModelNotFound { .. } => "model_not_found",
            other => other.code().as_str(),
        }
    }

    /// OpenAI's `param`: the request field the error is about, when there is one.
    fn param(&self) -> Option<&'static str> {
        match self {
            Self::EmptyInput { field }
            | Self::InputTooLong { field, .. }
            | Self::TotalTooLong { field, .. }
            | Self::InvalidParameter { field, .. }
            | Self::Unsupported { field, .. } => Some(field),
            Self::NoChatTemplate { .. } | Self::Template { .. } => Some("messages"),
            Self::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }
}

/// A [`GatewayError`] answered in OpenAI's shape: what the `/v1/*` handlers return, so `?`
/// turns every error they meet into OpenAI's body and status.
#[derive(Debug)]
pub(crate) struct OpenAiError(pub GatewayError);

impl From<GatewayError> for OpenAiError {
    fn from(error: GatewayError) -> Self {
        Self(error)
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        self.0.into_shaped_response(ApiShape::OpenAi)
    }
}

fn given_size(given_bytes: Option<u64>) -> String {
    given_bytes.map_or_else(|| "more (chunked)".into(), |n| format!("{n} bytes"))
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        self.into_shaped_response(ApiShape::Tgi)
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

    #[tokio::test]
    async fn edge_errors_take_the_shape_of_their_api() {
        use http_body_util::BodyExt;
        let body = |response: Response| async move {
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice::<serde_json::Value>(&bytes).unwrap()
        };
        let response = GatewayError::InvalidApiKey.into_shaped_response(ApiShape::of("/v1/models"));
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(
            body(response).await,
            serde_json::json!({"error": {
                "message": "invalid API key",
                "type": "authentication",
                "param": null,
                "code": "invalid_api_key",
            }})
        );
        let response = GatewayError::MissingApiKey.into_shaped_response(ApiShape::of("/generate"));
        assert_eq!(response.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let tgi = body(response).await;
        assert_eq!(tgi["error_type"], "authentication");
        assert!(tgi["error"].as_str().unwrap().contains("Bearer"), "{tgi}");
        let too_large = GatewayError::BodyTooLarge {
            limit_bytes: 10,
            given_bytes: Some(11),
        };
        let response = too_large.into_shaped_response(ApiShape::of("/v1/completions"));
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert!(response.headers().get(header::WWW_AUTHENTICATE).is_none());
        let openai = body(response).await;
        assert_eq!(openai["error"]["code"], "payload_too_large");
        let message = openai["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("10") && message.contains("11"),
            "{message}"
        );
        assert_eq!(ApiShape::of("/v1"), ApiShape::OpenAi);
        assert_eq!(ApiShape::of("/v1x"), ApiShape::Tgi);
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
