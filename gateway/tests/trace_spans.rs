//! The gateway's spans, exported in-process: `http_request` under the client's `traceparent`,
//! then `validate` and `generate` beneath it, all in the client's trace; the request's id and
//! model on `http_request`; failures marked on the span that saw them; and no spans at all for
//! probes and scrapes.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{config, TestServer};
use gateway::fake::FakeScript;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use proto::ErrorCode;
use serde_json::json;

const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";
/// One trace id per scenario, so each finds its own spans.
const TRACE_OK: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACE_PROBES: &str = "4bf92f3577b34da6a3ce929d0e0e4737";
const TRACE_INVALID: &str = "4bf92f3577b34da6a3ce929d0e0e4738";
const TRACE_REFUSED: &str = "4bf92f3577b34da6a3ce929d0e0e4739";
const TRACE_STREAM_FAILS: &str = "4bf92f3577b34da6a3ce929d0e0e473a";

fn traceparent(trace_id: &str) -> String {
    format!("00-{trace_id}-{CLIENT_SPAN_ID}-01")
}

/// Sends `body` to `path` as part of the client trace `trace_id`; returns the status and body.
async fn post(
    server: &TestServer,
    path: &str,
    trace_id: &str,
    body: serde_json::Value,
) -> (u16, String) {
    let response = server
        .client
        .post(server.url(path))
        .header("traceparent", traceparent(trace_id))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The spans of one trace, by name (each name occurs once per trace here).
struct Trace(HashMap<String, SpanData>);

impl Trace {
    fn of(spans: &[SpanData], trace_id: &str) -> Self {
        let mut by_name = HashMap::new();
        for s in spans
            .iter()
            .filter(|s| s.span_context.trace_id().to_string() == trace_id)
        {
            let previous = by_name.insert(s.name.to_string(), s.clone());
            assert!(previous.is_none(), "two {} spans in {trace_id}", s.name);
        }
        Self(by_name)
    }

    fn span(&self, name: &str) -> &SpanData {
        self.0.get(name).unwrap_or_else(|| {
            let names: Vec<&String> = self.0.keys().collect();
            panic!("no {name} span in {names:?}")
        })
    }

    /// An attribute, as text (integers in decimal).
    fn attr(&self, name: &str, key: &str) -> Option<String> {
        let span = self.span(name);
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.as_str().into_owned())
    }

    fn text(&self, name: &str, key: &str) -> String {
        self.attr(name, key)
            .unwrap_or_else(|| panic!("{name} has no {key}: {:?}", self.span(name).attributes))
    }

    /// The span's OpenTelemetry status: `Unset`, `Ok` or `Error { .. }` (named through Debug:
    /// the gateway has no direct `opentelemetry` dependency).
    fn status(&self, name: &str) -> String {
        format!("{:?}", self.span(name).status)
    }

    fn assert_failed(&self, name: &str, error_type: &str) {
        let status = self.status(name);
        assert!(
            status.starts_with("Error"),
            "{name} is marked failed: {status}"
        );
        assert_eq!(self.text(name, "error_type"), error_type, "{name}");
    }

    /// A refused request: its `error_type` is recorded, its status is left unset.
    fn assert_refused(&self, name: &str, error_type: &str) {
        assert_eq!(self.status(name), "Unset", "{name}");
        assert_eq!(self.text(name, "error_type"), error_type, "{name}");
    }

    fn assert_not_failed(&self, name: &str) {
        assert_eq!(self.status(name), "Unset", "{name}");
        assert_eq!(self.attr(name, "error_type"), None, "{name}");
    }
}

#[test]
fn request_spans_join_the_client_trace_and_carry_the_request() {
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
        let ok = json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 3}});
        let (status, body) = post(&server, "/generate", TRACE_OK, ok).await;
        assert_eq!(status, 200, "{body}");
        for path in ["/metrics", "/health", "/info", "/v1/models"] {
            let response = server
                .client
                .get(server.url(path))
                .header("traceparent", traceparent(TRACE_PROBES))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{path}");
        }
        let (status, body) = post(&server, "/generate", TRACE_INVALID, json!({"inputs": ""})).await;
        assert_eq!(status, 422, "{body}");
        server.stop().await;

        let refusing = FakeScript {
            refuse_with: Some(ErrorCode::Unavailable),
            ..FakeScript::default()
        };
        let server = TestServer::start(config(), refusing).await;
        let (status, body) =
            post(&server, "/generate", TRACE_REFUSED, json!({"inputs": "Hi"})).await;
        assert_eq!(status, 503, "{body}");
        server.stop().await;

        let failing = FakeScript {
            fail_at: Some(1),
            ..FakeScript::default()
        };
        let server = TestServer::start(config(), failing).await;
        let stream = json!({"inputs": "Hi", "parameters": {"max_new_tokens": 4}});
        let (status, body) = post(&server, "/generate_stream", TRACE_STREAM_FAILS, stream).await;
        assert_eq!(status, 200, "an SSE stream starts before it fails");
        assert!(body.contains("error_type"), "{body}");
        server.stop().await;
    });
    drop(rt);
    guard.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().unwrap();

    // A generation: the whole tree in the client's trace, the request's identity on the root.
    let ok = Trace::of(&spans, TRACE_OK);
    let root = ok.span("http_request");
    assert_eq!(root.parent_span_id.to_string(), CLIENT_SPAN_ID);
    for child in ["validate", "generate"] {
        assert_eq!(
            ok.span(child).parent_span_id,
            root.span_context.span_id(),
            "{child} is a child of http_request"
        );
    }
    let request_id = ok.text("generate", "request_id");
    assert_eq!(request_id.len(), 32, "a UUID: {request_id}");
    assert_eq!(ok.text("http_request", "request_id"), request_id);
    for span in ["http_request", "generate"] {
        assert_eq!(ok.text(span, "model"), "stories260K", "{span}");
        assert_eq!(ok.text(span, "max_new_tokens"), "3", "{span}");
        let prompt_tokens: i64 = ok.text(span, "prompt_tokens").parse().unwrap();
        assert!(prompt_tokens > 0, "{span}");
        ok.assert_not_failed(span);
    }
    assert_eq!(ok.attr("http_request", "status"), Some("200".into()));
    assert_eq!(ok.text("generate", "finish_reason"), "length");
    assert!(ok.attr("generate", "ttft_ms").is_some());

    // Probes and scrapes start no trace, with or without a client's traceparent.
    let probes: Vec<&str> = spans
        .iter()
        .filter(|s| s.span_context.trace_id().to_string() == TRACE_PROBES)
        .map(|s| s.name.as_ref())
        .collect();
    assert!(probes.is_empty(), "probes traced: {probes:?}");
    let roots = spans.iter().filter(|s| s.name == "http_request").count();
    assert_eq!(roots, 4, "one http_request per API call, none per probe");

    // A request refused at validation (a client error): the root says why without being
    // marked failed; there is no generation.
    let invalid = Trace::of(&spans, TRACE_INVALID);
    invalid.assert_refused("http_request", "validation");
    assert_eq!(invalid.attr("http_request", "status"), Some("422".into()));
    assert_eq!(invalid.text("http_request", "model"), "stories260K");
    assert!(!invalid.0.contains_key("generate"));

    // The backend refuses: both the root and the generation are failed.
    let refused = Trace::of(&spans, TRACE_REFUSED);
    refused.assert_failed("http_request", "unavailable");
    refused.assert_failed("generate", "unavailable");
    assert_eq!(
        refused.text("http_request", "request_id"),
        refused.text("generate", "request_id")
    );

    // A stream that fails after its 200: only `generate` can say so.
    let stream = Trace::of(&spans, TRACE_STREAM_FAILS);
    stream.assert_not_failed("http_request");
    stream.assert_failed("generate", "internal");
}
