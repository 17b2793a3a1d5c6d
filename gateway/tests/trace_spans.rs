//! The gateway's spans for one request, exported in-process: `http_request` under the client's
//! `traceparent`, then `validate` and `generate` beneath it, all in the client's trace.

mod common;

use common::{config, TestServer};
use gateway::fake::FakeScript;
use opentelemetry_sdk::trace::InMemorySpanExporter;
use serde_json::json;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";

#[test]
fn request_spans_join_the_client_trace() {
    let exporter = InMemorySpanExporter::default();
    let (dispatch, guard) = telemetry::build_with_exporter(
        &telemetry::TelemetrySettings {
            service_name: "fission-gateway".into(),
            otlp_endpoint: None,
            default_filter: "warn".into(),
        },
        exporter.clone(),
    )
    .expect("telemetry builds");
    // Global: the server runs on runtime worker threads. One test per binary, so this is safe.
    tracing::dispatcher::set_global_default(dispatch).expect("no other subscriber");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let server = TestServer::start(config(), FakeScript::default()).await;
        let resp = server
            .client
            .post(format!("http://{}/generate", server.addr))
            .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"))
            .json(&json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 3}}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        server.stop().await;
    });
    drop(rt);
    guard.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().unwrap();
    let names: Vec<(String, String, String)> = spans
        .iter()
        .map(|s| {
            (
                s.name.to_string(),
                s.span_context.trace_id().to_string(),
                s.parent_span_id.to_string(),
            )
        })
        .collect();
    let find = |n: &str| {
        spans
            .iter()
            .find(|s| s.name == n)
            .unwrap_or_else(|| panic!("no {n} span in {names:?}"))
    };
    let root = find("http_request");
    assert_eq!(root.span_context.trace_id().to_string(), TRACE_ID);
    assert_eq!(root.parent_span_id.to_string(), CLIENT_SPAN_ID);
    for child in ["validate", "generate"] {
        let s = find(child);
        assert_eq!(s.span_context.trace_id().to_string(), TRACE_ID, "{child}");
        assert_eq!(
            s.parent_span_id,
            root.span_context.span_id(),
            "{child} is a child of http_request"
        );
    }
}
