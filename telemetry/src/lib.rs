//! Telemetry shared by every Fission service: the `tracing` subscriber (stderr logs, and
//! OpenTelemetry export over OTLP/gRPC when an endpoint is configured), W3C trace-context
//! propagation across HTTP headers, gRPC metadata and the KV-transfer frame header, and the
//! Prometheus histogram buckets that fit LLM latencies. A service's process set-up (runtime,
//! logger, export, shutdown signals) is [`run_service`], so every binary does it the same way.
//!
//! This crate knows nothing of requests, models or nodes: it must not depend on any other
//! Fission crate, define spans or metrics of its own, or touch prompt text. Services decide what
//! to trace; this crate decides how it leaves the process.
//!
//! With no endpoint, [`init`] installs only the logger: no span is exported, and the
//! propagation helpers only forward a client's `traceparent` (one extension lookup per call),
//! so traced nodes behind an untraced gateway still join the client's trace. With an endpoint, spans go to a bounded queue
//! drained by a background thread; a dead collector makes that thread drop batches (dialling it
//! again after a doubling pause, with one warning per outage), never the caller wait.

mod buckets;
mod error;
mod export_guard;
mod init;
mod process;
mod propagation;
mod sampler;

pub use buckets::{
    install_prometheus_recorder, latency_buckets_seconds, prometheus_builder, size_buckets,
};
pub use error::TelemetryError;
pub use init::{
    build, build_with_exporter, init, TelemetryArgs, TelemetryGuard, TelemetrySettings,
    SHUTDOWN_BOUND,
};
pub use process::{run_service, spawn_signal_handler, ProcessError};
pub use propagation::{
    add_link, context_from_traceparent, current_traceparent, extract_grpc, extract_http,
    inject_grpc, inject_http, set_parent, span_traceparent, with_trace,
};
pub use sampler::{parse_sampler, sampler_from_env};

/// Re-exported so services need no direct `opentelemetry` dependency to hold a context.
pub use opentelemetry::Context;
/// Re-exported for `span.context()`, `span.add_link(..)` and friends.
pub use tracing_opentelemetry::OpenTelemetrySpanExt;
