//! The gateway's Prometheus metrics: their names, their buckets, and installing the recorder.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Generation requests received, by `endpoint`.
pub const REQUESTS_TOTAL: &str = "fission_gateway_requests_total";
/// Errors sent to clients, by `error_type` (`proto::ErrorCode::as_str`).
pub const ERRORS_TOTAL: &str = "fission_gateway_errors_total";
/// Requests whose client went away before the last token.
pub const CANCELLED_TOTAL: &str = "fission_gateway_requests_cancelled_total";
/// Requests holding an admission permit.
pub const IN_FLIGHT: &str = "fission_gateway_requests_in_flight";
pub const TIME_TO_FIRST_TOKEN: &str = "fission_gateway_time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN: &str = "fission_gateway_time_per_output_token_seconds";
/// From arrival to the last token, for requests that finished.
pub const REQUEST_DURATION: &str = "fission_gateway_request_duration_seconds";
pub const INPUT_TOKENS: &str = "fission_gateway_input_tokens";
pub const GENERATED_TOKENS: &str = "fission_gateway_generated_tokens";

/// TTFT and end-to-end latency: milliseconds to ten minutes.
const LATENCY_SECONDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];
/// Inter-token latency: a millisecond to a few seconds.
const TOKEN_SECONDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
];
/// Token counts: powers of two up to 128k.
const TOKEN_COUNTS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
    16384.0, 32768.0, 65536.0, 131072.0,
];

/// A builder with the gateway's histogram buckets (without them histograms render as summaries).
pub fn prometheus_builder() -> PrometheusBuilder {
    let buckets = [
        (TIME_TO_FIRST_TOKEN, LATENCY_SECONDS),
        (REQUEST_DURATION, LATENCY_SECONDS),
        (TIME_PER_OUTPUT_TOKEN, TOKEN_SECONDS),
        (INPUT_TOKENS, TOKEN_COUNTS),
        (GENERATED_TOKENS, TOKEN_COUNTS),
    ];
    buckets
        .into_iter()
        .fold(PrometheusBuilder::new(), |builder, (name, values)| {
            builder
                .set_buckets_for_metric(Matcher::Full(name.to_string()), values)
                .expect("bucket lists are constant and non-empty")
        })
}

/// Installs the process-wide recorder once and returns its handle; later calls (a second
/// gateway in one test process) share it. When another recorder was installed first, the
/// gateway's `/metrics` renders a detached, empty registry and a warning is logged.
pub fn install_recorder() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| match prometheus_builder().install_recorder() {
            Ok(handle) => {
                describe();
                handle
            }
            Err(error) => {
                tracing::warn!(%error, "a metrics recorder is already installed; /metrics stays empty");
                prometheus_builder().build_recorder().handle()
            }
        })
        .clone()
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        "fission_gateway_route_total",
        "Routing decisions, by mode (disaggregated or colocated) and reason."
    );
    describe_counter!(
        "fission_gateway_prefill_retries_total",
        "Prefill attempts retried on another node after a node failed."
    );
    describe_counter!(
        "fission_gateway_no_capacity_total",
        "Requests refused because every decode node was out of KV blocks."
    );
    describe_counter!(
        "fission_gateway_client_cancelled_total",
        "Streams cancelled upstream because the client left."
    );
    describe_counter!(
        "fission_gateway_nodes_refused_total",
        "Nodes refused by routing (other model or KV layout), by role."
    );
    describe_counter!(
        "fission_gateway_cache_event_resyncs_total",
        "Prefix-cache event streams resynced from a snapshot after a gap."
    );
    describe_gauge!(
        "fission_gateway_cluster_nodes",
        "Nodes in etcd by role and state (serving, draining, refused)."
    );
    describe_counter!(REQUESTS_TOTAL, "Generation requests received, by endpoint.");
    describe_counter!(ERRORS_TOTAL, "Errors sent to clients, by error_type.");
    describe_counter!(
        CANCELLED_TOTAL,
        "Requests whose client left before the last token."
    );
    describe_gauge!(IN_FLIGHT, "Requests holding an admission permit.");
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "From arrival to the first token."
    );
    describe_histogram!(
        TIME_PER_OUTPUT_TOKEN,
        Unit::Seconds,
        "Mean time between output tokens."
    );
    describe_histogram!(
        REQUEST_DURATION,
        Unit::Seconds,
        "From arrival to the last token."
    );
    describe_histogram!(INPUT_TOKENS, Unit::Count, "Prompt tokens per request.");
    describe_histogram!(
        GENERATED_TOKENS,
        Unit::Count,
        "Generated tokens per finished request."
    );
}
