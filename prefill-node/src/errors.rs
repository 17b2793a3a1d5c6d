//! Where a failure on this node is counted and marked on its span, in one place: Prefill RPCs
//! answered with an error and KV pushes that failed, each once, by the error table's code.

use node_common::NodeError;
use proto::ErrorCode;
use tracing::Span;

/// Counted under `fission_prefill_errors_total{error_type}`.
pub const ERRORS_TOTAL: &str = "fission_prefill_errors_total";

/// A failed RPC: its code in the error table and the message the caller gets.
#[derive(Debug)]
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

    /// Counts the failure, marks `span` failed, and gives the gRPC status.
    pub fn report(self, span: &Span) -> tonic::Status {
        failed(span, self.code);
        self.code.status(self.message)
    }
}

impl From<NodeError> for Failure {
    fn from(e: NodeError) -> Self {
        Failure::new(e.code(), e.to_string())
    }
}

/// Counts one failure of `code` and marks `span` failed: `error_type` for people, and
/// `otel.status_code`, which tracing-opentelemetry turns into the span's error status.
pub fn failed(span: &Span, code: ErrorCode) {
    metrics::counter!(ERRORS_TOTAL, "error_type" => code.as_str()).increment(1);
    span.record("error_type", code.as_str());
    span.record("otel.status_code", "ERROR");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::span_capture::{Captured, Value};

    #[test]
    fn a_reported_failure_is_counted_and_marks_its_span() {
        let capture = Captured::default();
        let _subscriber = tracing::subscriber::set_default(capture.subscriber());
        let recorder = telemetry::prometheus_builder()
            .expect("buckets")
            .build_recorder();
        let metrics = recorder.handle();
        let status = metrics::with_local_recorder(&recorder, || {
            let span = tracing::info_span!(
                "rpc",
                error_type = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            Failure::new(
                ErrorCode::InputTooLong,
                "prompt has 9 tokens, the limit is 8",
            )
            .report(&span)
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
            .contains("fission_prefill_errors_total{error_type=\"input_too_long\"} 1"));
    }
}
