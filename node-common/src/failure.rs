//! Where a failure on a node is counted and marked on its span, in one place. Each node counts
//! its failures once each, by the error table's code, under its own
//! `fission_<role>_errors_total{error_type}`.

use proto::ErrorCode;
use tracing::Span;

use crate::error::NodeError;

/// A failed RPC or token stream: its code in the error table and the message the caller gets.
#[derive(Debug, Clone)]
pub struct Failure {
    pub code: ErrorCode,
    pub message: String,
}

impl Failure {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Failure {
            code,
            message: message.into(),
        }
    }
}

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Self {
        Failure::new(e.code(), e.to_string())
    }
}

/// A node's failure counter: the nodes differ only in its name.
#[derive(Debug, Clone, Copy)]
pub struct ErrorCounter {
    name: &'static str,
}

impl ErrorCounter {
    pub const fn new(name: &'static str) -> Self {
        ErrorCounter { name }
    }

    /// The metric's name, for its description.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    pub fn count(&self, code: ErrorCode) {
        metrics::counter!(self.name, "error_type" => code.as_str()).increment(1);
    }

    /// Counts one failure of `code` and marks `span` failed.
    pub fn failed(&self, span: &Span, code: ErrorCode) {
        self.count(code);
        mark_failed(span, code);
    }

    /// Counts `failure`, marks `span` failed, and gives the gRPC status.
    pub fn report(&self, failure: Failure, span: &Span) -> tonic::Status {
        self.failed(span, failure.code);
        failure.code.status(failure.message)
    }
}

/// `error_type` for people, and `otel.status_code`, which tracing-opentelemetry turns into the
/// span's error status. Declare both fields (`Empty`) on the span.
pub fn mark_failed(span: &Span, code: ErrorCode) {
    span.record("error_type", code.as_str());
    span.record("otel.status_code", "ERROR");
}

#[cfg(test)]
mod tests {
    use testkit::span_capture::{Captured, Value};

    use super::*;
    use crate::test_util::local_recorder;

    #[test]
    fn a_reported_failure_is_counted_and_marks_its_span() {
        const ERRORS: ErrorCounter = ErrorCounter::new("fission_test_errors_total");
        let capture = Captured::default();
        let _subscriber = capture.install();
        let (recorder, metrics) = local_recorder();
        let status = metrics::with_local_recorder(&recorder, || {
            let span = tracing::info_span!(
                "rpc",
                error_type = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            ERRORS.report(
                Failure::new(
                    ErrorCode::InputTooLong,
                    "prompt has 9 tokens, the limit is 8",
                ),
                &span,
            )
        });
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "prompt has 9 tokens, the limit is 8");
        let (_, span) = capture.named("rpc").remove(0);
        assert_eq!(
            span.field("error_type"),
            Some(&Value::Str("input_too_long".into()))
        );
        assert_eq!(
            span.field("otel.status_code"),
            Some(&Value::Str("ERROR".into()))
        );
        assert!(metrics
            .render()
            .contains("fission_test_errors_total{error_type=\"input_too_long\"} 1"));
    }
}
