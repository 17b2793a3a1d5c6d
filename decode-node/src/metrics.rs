//! The decode node's metrics and what they mean (the help text `/metrics` serves). Names follow
//! `fission_decode_<what>_<unit>`; an autoscaler for the decode pool reads KV usage here and
//! TPOT at the gateway.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use node_common::failure::ErrorCounter;

/// Failures, counted once each under `fission_decode_errors_total{error_type}`.
pub const ERRORS: ErrorCounter = ErrorCounter::new("fission_decode_errors_total");

pub fn describe() {
    describe_counter!(
        "fission_decode_cancelled_total",
        "Requests whose client left (the gateway closed the Generate stream) before their last token, once each."
    );
    describe_counter!(
        ERRORS.name(),
        "Failures by error_type: RPCs answered with an error, token streams ended by one, and received KV frames that failed (refused, or their import)."
    );
    describe_counter!(
        "fission_decode_prefix_cache_hit_blocks_total",
        Unit::Count,
        "Prompt blocks found in the prefix cache; over the queried rate, the hit rate."
    );
    describe_counter!(
        "fission_decode_prefix_cache_queried_blocks_total",
        Unit::Count,
        "Prompt blocks looked up in the prefix cache."
    );
    describe_counter!(
        "fission_decode_generated_tokens_total",
        Unit::Count,
        "Tokens generated; its rate is the node's tokens/s."
    );
    describe_counter!(
        "fission_decode_kv_linked_blocks_total",
        Unit::Count,
        "Prompt blocks of remote prefills linked from this node's prefix cache instead of pushed (--kv-delta)."
    );
    describe_counter!(
        "fission_decode_kv_late_imports_total",
        "KV layers that arrived after their reservation ended, dropped."
    );
    describe_counter!(
        "fission_decode_kv_received_bytes_total",
        Unit::Bytes,
        "KV bytes imported from prefill nodes."
    );
    describe_counter!(
        "fission_decode_kv_transfers_completed_total",
        "KV transfers that completed with matching checksums."
    );
    describe_counter!(
        "fission_decode_lease_expired_total",
        "Reservations freed because their KV did not arrive within the lease."
    );
    describe_counter!(
        "fission_decode_local_prefill_total",
        "Prompts prefilled on this node (colocated mode)."
    );
    describe_counter!(
        "fission_decode_reserve_busy_total",
        "Reserve calls refused for lack of KV blocks."
    );
    describe_counter!(
        "fission_decode_preemptions_total",
        "Sequences preempted (blocks taken back, recomputed later)."
    );
    describe_gauge!(
        "fission_decode_kv_blocks_capacity",
        Unit::Count,
        "KV blocks this node has."
    );
    describe_gauge!(
        "fission_decode_kv_blocks_reserved",
        Unit::Count,
        "KV blocks reserved for transfers in flight."
    );
    describe_gauge!(
        "fission_decode_kv_blocks_used",
        Unit::Count,
        "KV blocks held by running sequences."
    );
    describe_gauge!(
        "fission_decode_kv_bytes_in_use",
        Unit::Bytes,
        "KV bytes held now, running sequences and reservations, over every layer and layer group (sliding windows included)."
    );
    describe_gauge!(
        "fission_decode_kv_usage_ratio",
        "Share of KV blocks in use or reserved."
    );
    describe_gauge!(
        "fission_decode_prefix_cache_hit_ratio",
        "Prompt blocks found in the prefix cache, over blocks looked up."
    );
    describe_gauge!(
        "fission_decode_reservations_outstanding",
        Unit::Count,
        "Reservations whose KV has not arrived yet."
    );
    describe_gauge!(
        "fission_decode_running_sequences",
        Unit::Count,
        "Sequences in the running batch."
    );
    describe_gauge!(
        "fission_decode_waiting_sequences",
        Unit::Count,
        "Sequences waiting for admission."
    );
    describe_histogram!(
        "fission_decode_batch_size",
        Unit::Count,
        "Sequences per decode step."
    );
    describe_histogram!(
        "fission_decode_kv_import_seconds",
        Unit::Seconds,
        "Time to import one received KV layer into the cache."
    );
    describe_histogram!(
        "fission_decode_kv_transfer_bytes",
        Unit::Bytes,
        "KV bytes per completed transfer."
    );
    describe_histogram!(
        "fission_decode_queue_time_seconds",
        Unit::Seconds,
        "From admission to the first step that includes the sequence."
    );
    describe_histogram!(
        "fission_decode_time_per_output_token_seconds",
        Unit::Seconds,
        "Per sequence, the time from one output token to the next on this node (from activation for the first decoded token)."
    );
    describe_histogram!(
        "fission_decode_step_seconds",
        Unit::Seconds,
        "Duration of one engine step (time per output token of the batch)."
    );
}
