//! The prefill node's metrics and what they mean (the help text `/metrics` serves). Names
//! follow `fission_prefill_<what>_<unit>`; an autoscaler for the prefill pool reads queued
//! prefill tokens here and TTFT at the gateway.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use node_common::failure::ErrorCounter;

/// Failures, counted once each under `fission_prefill_errors_total{error_type}`.
pub const ERRORS: ErrorCounter = ErrorCounter::new("fission_prefill_errors_total");

pub fn describe() {
    describe_counter!(
        "fission_prefill_cancelled_total",
        "Prompts cancelled before their first token."
    );
    describe_counter!(
        "fission_prefill_kv_transfer_bytes_total",
        Unit::Bytes,
        "KV bytes pushed to decode nodes."
    );
    describe_counter!(
        "fission_prefill_kv_transfer_failures_total",
        "KV pushes that failed (the decode reservation is cancelled)."
    );
    describe_counter!("fission_prefill_kv_transfers_total", "KV pushes completed.");
    describe_counter!(
        "fission_prefill_kv_pushes_total",
        "KV pushes started, by the transport picked: shm for a decode node on this host, the network transport otherwise."
    );
    describe_counter!(
        ERRORS.name(),
        "Failures by error_type: Prefill RPCs answered with an error, and KV pushes that failed."
    );
    describe_counter!(
        "fission_prefill_prefix_cache_hit_blocks_total",
        Unit::Count,
        "Prompt blocks found in the prefix cache; over the queried rate, the hit rate."
    );
    describe_counter!(
        "fission_prefill_prefix_cache_queried_blocks_total",
        Unit::Count,
        "Prompt blocks looked up in the prefix cache."
    );
    describe_counter!("fission_prefill_prompts_total", "Prompts prefilled.");
    describe_counter!(
        "fission_prefill_tokens_total",
        Unit::Count,
        "Prompt tokens prefilled; its rate is the node's tokens/s."
    );
    describe_gauge!(
        "fission_prefill_kv_blocks_capacity",
        Unit::Count,
        "KV blocks this node has."
    );
    describe_gauge!(
        "fission_prefill_kv_blocks_used",
        Unit::Count,
        "KV blocks in use."
    );
    describe_gauge!(
        "fission_prefill_kv_bytes_in_use",
        Unit::Bytes,
        "KV bytes the prompts hold now, over every layer and layer group (sliding windows included)."
    );
    describe_gauge!(
        "fission_prefill_kv_usage_ratio",
        "Share of KV blocks in use."
    );
    describe_gauge!(
        "fission_prefill_prefix_cache_hit_ratio",
        "Prefix-cache hits over lookups since start."
    );
    describe_gauge!(
        "fission_prefill_queued_prefill_tokens",
        Unit::Count,
        "Tokens of admitted prompts not yet answered: the prefill pool's scaling signal."
    );
    describe_gauge!(
        "fission_prefill_queued_sequences",
        Unit::Count,
        "Prompts admitted and not yet answered."
    );
    describe_histogram!(
        "fission_prefill_batch_size",
        Unit::Count,
        "Prompts computed (in whole or in part) per engine step."
    );
    describe_histogram!(
        "fission_prefill_kv_transfer_duration_seconds",
        Unit::Seconds,
        "From the push's start to the decode node's Done, per transfer."
    );
    describe_histogram!(
        "fission_prefill_kv_transfer_bytes_per_second",
        "KV bytes per transfer over its duration (a lower bound: the transfer overlaps compute)."
    );
    describe_histogram!(
        "fission_prefill_kv_transfer_layer_seconds",
        Unit::Seconds,
        "Time to send one layer and get the receiver's verdict."
    );
    describe_histogram!(
        "fission_prefill_kv_transfer_tail_seconds",
        Unit::Seconds,
        "From the last layer's compute to its acknowledgement: what the transfer adds to TTFT."
    );
    describe_histogram!(
        "fission_prefill_queue_time_seconds",
        Unit::Seconds,
        "From the Prefill RPC's arrival to the first step that computes part of the prompt."
    );
    describe_histogram!(
        "fission_prefill_step_seconds",
        Unit::Seconds,
        "Duration of one engine step."
    );
    describe_histogram!(
        "fission_prefill_time_to_first_token_seconds",
        Unit::Seconds,
        "From the Prefill RPC's arrival to the prompt's first token on this node."
    );
}
