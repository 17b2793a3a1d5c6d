//! The gateway's Prometheus metrics: their names and help texts, and installing the recorder
//! (shared with every component, buckets included: see [`telemetry::prometheus_builder`]).

use std::sync::Once;

use metrics_exporter_prometheus::PrometheusHandle;

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
/// Requests waiting in the admission queue.
pub const QUEUE_WAITING: &str = "fission_gateway_queue_waiting_requests";
/// Prompt tokens of the requests waiting in the admission queue.
pub const QUEUE_TOKENS: &str = "fission_gateway_queue_waiting_tokens";
/// From entering the queue to being placed on the nodes (or refused).
pub const QUEUE_WAIT: &str = "fission_gateway_queue_wait_seconds";
/// The gateway's own time before a request leaves for a node.
pub const OVERHEAD: &str = "fission_gateway_overhead_seconds";
/// Requests the queue refused, by reason (`full`, `timeout`).
pub const QUEUE_REJECTED: &str = "fission_gateway_queue_rejected_total";
pub const GENERATED_TOKENS: &str = "fission_gateway_generated_tokens";
/// Requests refused for their API key, by reason (`missing`, `invalid`).
pub const AUTH_FAILURES_TOTAL: &str = "fission_gateway_auth_failures_total";

/// Installs the process-wide recorder once and returns its handle; later calls (a second
/// gateway in one test process) share it. It is the recorder every Fission component uses
/// ([`telemetry::install_prometheus_recorder`]): histograms get its buckets by name suffix
/// (`*_seconds` from 1 ms to 10 minutes, token counts from 1 to 2^20), and its upkeep runs in
/// the background, so samples do not pile up between scrapes. When another recorder was
/// installed first, `/metrics` renders a detached, empty registry and a warning is logged.
pub fn install_recorder() -> PrometheusHandle {
    static DESCRIBED: Once = Once::new();
    let handle = telemetry::install_prometheus_recorder();
    DESCRIBED.call_once(describe);
    handle
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        QUEUE_WAITING,
        Unit::Count,
        "Requests waiting in the admission queue for a slot and for room on the nodes."
    );
    describe_gauge!(
        QUEUE_TOKENS,
        Unit::Count,
        "Prompt tokens of the requests waiting in the admission queue."
    );
    describe_histogram!(
        QUEUE_WAIT,
        Unit::Seconds,
        "Time from entering the admission queue to being placed on the nodes (or refused)."
    );
    describe_histogram!(
        OVERHEAD,
        Unit::Seconds,
        "The gateway's own time before a request leaves for a node: from its arrival (HTTP, auth, validation, tokenization, templating, admission, routing) to the placement call on the chosen decode node. Includes queue waits when the queue waited (see fission_gateway_queue_wait_seconds)."
    );
    describe_counter!(
        QUEUE_REJECTED,
        "Requests the admission queue refused with 429, by reason: full, or waited too long."
    );
    describe_counter!(
        "fission_gateway_migrations_total",
        "Requests moved to another decode node mid-stream, by reason (failed, stalled)."
    );
    describe_counter!(
        "fission_gateway_suspect_nodes_total",
        "Nodes marked suspect (stalled or failed a request), by role; they take no new work until a health check passes."
    );
    describe_counter!(
        "fission_gateway_route_total",
        "Routing decisions, by mode (disaggregated or colocated) and reason."
    );
    describe_counter!(
        "fission_gateway_prefill_retries_total",
        "Prefill attempts retried on another node after a node failed."
    );
    describe_counter!(
        "fission_gateway_pair_failures_total",
        "Failed prefill attempts (push failed, call failed, stalled, unanswered), by prefill_node and decode_node pair."
    );
    describe_gauge!(
        "fission_gateway_bad_pairs",
        Unit::Count,
        "Prefill-to-decode pairs marked bad after consecutive failures: routed around (another prefill node, or prefill on the decode node) until their cool-off ends."
    );
    describe_counter!(
        "fission_gateway_placement_timeouts_total",
        "Placements a decode node did not answer within --max-stall-ms: the node is marked suspect and the next one is tried."
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
    describe_counter!(
        AUTH_FAILURES_TOTAL,
        "Requests refused with 401 for their API key, by reason: missing or invalid."
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The gateway's histograms render with the shared buckets: milliseconds to ten minutes
    /// for every latency (TPOT included), and token counts past 128k.
    #[test]
    fn histograms_use_the_shared_buckets() {
        let recorder = telemetry::prometheus_builder()
            .expect("static buckets")
            .build_recorder();
        let handle = recorder.handle();
        ::metrics::with_local_recorder(&recorder, || {
            for name in [TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, REQUEST_DURATION] {
                ::metrics::histogram!(name).record(4.0);
            }
            ::metrics::histogram!(INPUT_TOKENS).record(200_000.0);
            ::metrics::histogram!(GENERATED_TOKENS).record(3.0);
        });
        let text = handle.render();
        for name in [TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, REQUEST_DURATION] {
            for bucket in [
                r#"le="0.001"} 0"#,
                r#"le="2.5"} 0"#,
                r#"le="5"} 1"#,
                r#"le="600"} 1"#,
            ] {
                assert!(
                    text.contains(&format!("{name}_bucket{{{bucket}")),
                    "{name} {bucket}:\n{text}"
                );
            }
        }
        assert!(
            text.contains(&format!(r#"{INPUT_TOKENS}_bucket{{le="262144"}} 1"#)),
            "{text}"
        );
        assert!(
            text.contains(&format!(r#"{GENERATED_TOKENS}_bucket{{le="4"}} 1"#)),
            "{text}"
        );
        assert!(!text.contains("quantile"), "histograms, not summaries");
    }
}
