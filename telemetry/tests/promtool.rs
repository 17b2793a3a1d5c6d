//! The exposition `prometheus_builder` renders, with the metric names the Grafana dashboard
//! (deploy/observability) reads, passes `promtool check metrics` (syntax and naming lint).
//!
//! Needs promtool (Debian's `prometheus` package): `./deploy/install-test-tools.sh`. Without it
//! the test prints why and passes, unless `FISSION_REQUIRE_TEST_TOOLS=1`.

#[test]
fn dashboard_metric_names_pass_promtool() -> anyhow::Result<()> {
    let recorder = telemetry::prometheus_builder()?.build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        for (name, v) in [
            ("fission_gateway_time_to_first_token_seconds", 0.12),
            ("fission_gateway_time_per_output_token_seconds", 0.02),
            ("fission_gateway_request_duration_seconds", 1.5),
            ("fission_prefill_queue_time_seconds", 0.003),
            ("fission_decode_queue_time_seconds", 0.001),
            ("fission_prefill_kv_transfer_duration_seconds", 0.05),
            ("fission_decode_batch_size", 8.0),
        ] {
            metrics::describe_histogram!(name, "test");
            metrics::histogram!(name, "pool" => "default").record(v);
        }
        metrics::describe_counter!("fission_prefill_kv_transfer_bytes_total", "test");
        metrics::counter!("fission_prefill_kv_transfer_bytes_total").increment(4096);
        metrics::describe_counter!("fission_gateway_errors_total", "test");
        metrics::counter!("fission_gateway_errors_total", "error_type" => "validation")
            .increment(1);
        for name in [
            "fission_decode_kv_blocks_used",
            // Not `_kv_blocks_total`: promtool rejects `_total` on a gauge (exit 3).
            "fission_decode_kv_blocks_capacity",
            "fission_prefill_queued_prefill_tokens",
            "fission_decode_running_sequences",
        ] {
            metrics::describe_gauge!(name, "test");
            metrics::gauge!(name).set(3.0);
        }
    });
    let text = handle.render();
    if let Some(report) = testkit::promtool::check(&text)? {
        eprintln!("promtool: clean {report}");
    }
    Ok(())
}
