//! The crate's one error type.

/// Why telemetry could not be set up or shut down.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    #[error("OTEL_TRACES_SAMPLER={given:?} is not one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio")]
    UnknownSampler { given: String },
    #[error("OTEL_TRACES_SAMPLER_ARG={given:?} is not a ratio in [0, 1] for sampler {sampler}")]
    InvalidSamplerArg { sampler: String, given: String },
    #[error("log filter {filter:?} is invalid: {source}")]
    InvalidFilter {
        filter: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("OTLP endpoint {endpoint:?} is invalid: {reason}")]
    InvalidEndpoint { endpoint: String, reason: String },
    #[error("cannot build the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("cannot start the OTLP export runtime: {source}")]
    Runtime {
        #[source]
        source: std::io::Error,
    },
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
    #[error(
        "flushing spans to {endpoint} did not finish within {bound_ms} ms; the rest are dropped"
    )]
    ShutdownTimeout { endpoint: String, bound_ms: u64 },
    #[error("flushing spans to {endpoint} failed: {reason}")]
    Shutdown { endpoint: String, reason: String },
}
