//! Spans exported over OTLP/gRPC reach a real backend (Arize Phoenix) in one trace, under the
//! client's `traceparent`, with the parent links a request's spans have across services.
//!
//! Needs Phoenix: `./deploy/install-test-tools.sh`. Without it the test prints why and passes,
//! unless `FISSION_REQUIRE_TEST_TOOLS=1`.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use telemetry::{OpenTelemetrySpanExt, TelemetrySettings};
use testkit::phoenix::{Phoenix, PhoenixSpan};

const CLIENT_TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CLIENT_SPAN_ID: &str = "b7ad6b7169203331";
const NUM_LAYERS: u32 = 3;

/// tracing-opentelemetry 0.34 exports `u64` fields as strings (it has no `record_u64`) and
/// `i64` ones as integers; accept both.
fn as_u64(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| v.as_str()?.parse().ok())
}

fn by_name<'a>(spans: &'a [PhoenixSpan], name: &str) -> &'a PhoenixSpan {
    spans
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no {name} span in {spans:#?}"))
}

#[test]
fn spans_reach_phoenix_in_one_trace_with_parent_links() -> anyhow::Result<()> {
    let Some(phoenix) = Phoenix::start()? else {
        return Ok(());
    };
    // A project of its own: Phoenix files spans by `openinference.project.name`, which
    // telemetry sets to the service name.
    let service = format!("fission-telemetry-test-{}", std::process::id());
    let (dispatch, mut guard) = telemetry::build(&TelemetrySettings {
        service_name: service.clone(),
        otlp_endpoint: Some(phoenix.otlp_grpc_endpoint()),
        default_filter: "warn".into(),
    })?;
    assert!(guard.is_exporting());

    let client_traceparent = format!("00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01");
    tracing::dispatcher::with_default(&dispatch, || {
        // The gateway: the client's traceparent becomes the root span's parent.
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", client_traceparent.parse().expect("ascii"));
        let request = tracing::info_span!("http_request", request_id = 7, model = "test");
        assert!(telemetry::set_parent(
            &request,
            telemetry::extract_http(&headers)
        ));
        let request_cx = request.context();

        // The prefill node: kv_transfer under the request, an event per layer, and the
        // traceparent the frame header would carry.
        let frame_traceparent = request.in_scope(|| {
            let transfer = tracing::info_span!(
                "kv_transfer",
                request_id = 7,
                kv_bytes = tracing::field::Empty
            );
            let _entered = transfer.enter();
            for layer in 0..NUM_LAYERS {
                tracing::info!(
                    layer,
                    kv_bytes = 4096u64,
                    duration_us = 120u64,
                    "layer sent"
                );
            }
            transfer.record("kv_bytes", 4096u64 * u64::from(NUM_LAYERS));
            telemetry::current_traceparent().expect("an exported span has a traceparent")
        });

        // The decode node: kv_receive joins the trace through the frame header.
        let receive = tracing::info_span!("kv_receive", request_id = 7);
        assert!(telemetry::set_parent(
            &receive,
            telemetry::context_from_traceparent(&frame_traceparent)
        ));
        receive.in_scope(|| tracing::info!(layers = NUM_LAYERS, "kv received"));
        drop(receive);

        // A batch span serving the request links to it rather than being its child.
        let batch = tracing::info_span!(parent: None, "decode_step", batch_size = 1);
        telemetry::add_link(&batch, &request_cx);
        drop(batch);
        drop(request);
    });

    let started = Instant::now();
    guard.shutdown()?;
    let shutdown = started.elapsed();
    eprintln!("shutdown with a live collector took {shutdown:?}");
    assert!(shutdown <= telemetry::SHUTDOWN_BOUND);

    let want = ["http_request", "kv_transfer", "kv_receive", "decode_step"];
    let spans = phoenix.wait_for_spans(&service, Duration::from_secs(60), |spans| {
        want.iter().all(|w| spans.iter().any(|s| s.name == *w))
    })?;

    let request = by_name(&spans, "http_request");
    let transfer = by_name(&spans, "kv_transfer");
    let receive = by_name(&spans, "kv_receive");
    let batch = by_name(&spans, "decode_step");
    for s in [request, transfer, receive] {
        assert_eq!(
            s.trace_id, CLIENT_TRACE_ID,
            "{} is in the client's trace",
            s.name
        );
    }
    assert_eq!(request.parent_id.as_deref(), Some(CLIENT_SPAN_ID));
    assert_eq!(
        transfer.parent_id.as_deref(),
        Some(request.span_id.as_str())
    );
    assert_eq!(
        receive.parent_id.as_deref(),
        Some(transfer.span_id.as_str())
    );
    assert_ne!(
        batch.trace_id, CLIENT_TRACE_ID,
        "a batch span starts its own trace"
    );
    assert_eq!(batch.parent_id, None);

    // Per-layer events with their fields, and the value recorded at the end.
    let layer_events: Vec<_> = transfer
        .events
        .iter()
        .filter(|e| as_u64(&e["attributes"]["layer"]).is_some())
        .collect();
    assert_eq!(
        layer_events.len(),
        NUM_LAYERS as usize,
        "{:#?}",
        transfer.events
    );
    assert_eq!(
        as_u64(&layer_events[0]["attributes"]["kv_bytes"]),
        Some(4096)
    );
    assert_eq!(
        as_u64(&transfer.attributes["kv_bytes"]),
        Some(4096 * u64::from(NUM_LAYERS)),
        "{}",
        transfer.attributes
    );
    assert_eq!(
        request.attributes["request_id"], 7,
        "{}",
        request.attributes
    );
    Ok(())
}
