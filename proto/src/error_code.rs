//! The one table from error kinds to HTTP statuses, gRPC codes and `error_type` strings.
//! Every service error maps to a code here; nowhere else decides a status.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// A parameter is out of range or malformed.
    Validation,
    /// The prompt (or prompt + max_new_tokens) exceeds the limits.
    InputTooLong,
    /// The request body is not valid JSON or misses fields.
    BadRequest,
    /// No API key, or one the service does not hold.
    Unauthorized,
    NotFound,
    /// The route exists but not for this method.
    MethodNotAllowed,
    /// The request body is over the size limit.
    PayloadTooLarge,
    /// Too many concurrent requests, or no node has room.
    Overloaded,
    /// No node can serve the request right now.
    Unavailable,
    /// A deadline passed (KV lease, request timeout).
    Timeout,
    /// The client went away or asked to stop.
    Cancelled,
    /// KV transfer between nodes failed.
    KvTransfer,
    Internal,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 13] = [
        ErrorCode::Validation,
        ErrorCode::InputTooLong,
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::PayloadTooLarge,
        ErrorCode::Overloaded,
        ErrorCode::Unavailable,
        ErrorCode::Timeout,
        ErrorCode::Cancelled,
        ErrorCode::KvTransfer,
        ErrorCode::Internal,
    ];

    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::Validation | ErrorCode::InputTooLong => 422,
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::Overloaded => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::Timeout => 504,
            // 499 is nginx's "client closed request"; the client rarely sees it.
            ErrorCode::Cancelled => 499,
            ErrorCode::KvTransfer | ErrorCode::Internal => 500,
        }
    }

    /// The status on OpenAI-compatible routes: OpenAI answers every rejected parameter, a
    /// prompt over the context included, with 400 where TGI uses 422.
    pub fn openai_http_status(self) -> u16 {
        match self {
            ErrorCode::Validation | ErrorCode::InputTooLong => 400,
            other => other.http_status(),
        }
    }

    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorCode::Validation | ErrorCode::InputTooLong | ErrorCode::BadRequest => {
                tonic::Code::InvalidArgument
            }
            ErrorCode::Unauthorized => tonic::Code::Unauthenticated,
            ErrorCode::NotFound => tonic::Code::NotFound,
            ErrorCode::MethodNotAllowed => tonic::Code::Unimplemented,
            // What gRPC itself answers to a message over the size limit.
            ErrorCode::PayloadTooLarge => tonic::Code::ResourceExhausted,
            ErrorCode::Overloaded => tonic::Code::ResourceExhausted,
            ErrorCode::Unavailable => tonic::Code::Unavailable,
            ErrorCode::Timeout => tonic::Code::DeadlineExceeded,
            ErrorCode::Cancelled => tonic::Code::Cancelled,
            ErrorCode::KvTransfer => tonic::Code::DataLoss,
            ErrorCode::Internal => tonic::Code::Internal,
        }
    }

    /// The `error_type` field of JSON error bodies and SSE error events (TGI's names where
    /// TGI has one).
    pub fn error_type(self) -> &'static str {
        match self {
            // TGI reports a prompt over the limit as a validation error.
            ErrorCode::InputTooLong => "validation",
            // OpenAI's name for it (`AuthenticationError`, type `authentication`).
            ErrorCode::Unauthorized => "authentication",
            other => other.as_str(),
        }
    }

    /// A metric label: unique per code, unlike `error_type`.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Validation => "validation",
            ErrorCode::InputTooLong => "input_too_long",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Cancelled => "cancelled",
            ErrorCode::KvTransfer => "kv_transfer",
            ErrorCode::Internal => "internal",
        }
    }

    /// The code a remote gRPC status stands for, so errors keep their kind across hops.
    pub fn from_grpc(code: tonic::Code) -> ErrorCode {
        match code {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => ErrorCode::Validation,
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => ErrorCode::Unauthorized,
            tonic::Code::NotFound => ErrorCode::NotFound,
            tonic::Code::ResourceExhausted => ErrorCode::Overloaded,
            tonic::Code::Unavailable => ErrorCode::Unavailable,
            tonic::Code::DeadlineExceeded => ErrorCode::Timeout,
            tonic::Code::Cancelled => ErrorCode::Cancelled,
            tonic::Code::DataLoss => ErrorCode::KvTransfer,
            _ => ErrorCode::Internal,
        }
    }

    pub fn status(self, message: impl Into<String>) -> tonic::Status {
        tonic::Status::new(self.grpc_code(), message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_mapping_round_trips_except_merged_kinds() {
        for c in ErrorCode::ALL {
            let back = ErrorCode::from_grpc(c.grpc_code());
            // InputTooLong and BadRequest share InvalidArgument with Validation; a body over
            // the limit shares ResourceExhausted with Overloaded; an HTTP method is no gRPC
            // kind (Unimplemented is read back as Internal).
            let merged = matches!(
                c,
                ErrorCode::BadRequest | ErrorCode::PayloadTooLarge | ErrorCode::MethodNotAllowed
            );
            let same_status = back.http_status() == c.http_status() || merged;
            assert!(same_status, "{c:?} -> {:?} -> {back:?}", c.grpc_code());
        }
    }

    #[test]
    fn statuses_are_the_documented_ones() {
        assert_eq!(ErrorCode::InputTooLong.http_status(), 422);
        assert_eq!(ErrorCode::Overloaded.http_status(), 429);
        assert_eq!(ErrorCode::Unavailable.http_status(), 503);
        assert_eq!(ErrorCode::Unauthorized.http_status(), 401);
        assert_eq!(ErrorCode::Unauthorized.error_type(), "authentication");
        assert_eq!(ErrorCode::MethodNotAllowed.http_status(), 405);
        assert_eq!(ErrorCode::PayloadTooLarge.http_status(), 413);
        assert_eq!(ErrorCode::Validation.openai_http_status(), 400);
        assert_eq!(ErrorCode::InputTooLong.openai_http_status(), 400);
        assert_eq!(ErrorCode::Overloaded.openai_http_status(), 429);
        let labels: std::collections::HashSet<_> =
            ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(labels.len(), ErrorCode::ALL.len());
    }
}
