//! Requests through a real 1P+1D cluster (`fission up`, separate processes) export their
//! traces to a real OTLP backend (Arize Phoenix):
//!
//! - every process reports under its own service name (`fission-gateway`, `fission-prefill`,
//!   `fission-decode`) even when the user's environment sets `OTEL_SERVICE_NAME`, and
//!   `fission up --otlp-endpoint` reaches every process, beating the standard variables;
//! - a disaggregated request is one trace across the three services, joined by the client's
//!   `traceparent`, with `kv_transfer` and `kv_receive` whose parents chain up to the gateway's
//!   root span;
//! - a colocated request (a prompt under `--max-local-prefill-tokens`) is one trace too: the
//!   decode node's spans share the client's trace id and chain up to the gateway's root.
//!
//! Phoenix files spans under the project named by the resource attribute
//! `openinference.project.name` (`telemetry` sets it to `service.name`), but a whole trace goes
//! under the project of its first span to arrive, and resource attributes are not returned.
//! So services are told apart by traces that only one service makes: a request the gateway
//! rejects, and the nodes' batch spans (roots of their own).
//!
//! Needs Phoenix (`./deploy/install-test-tools.sh`); without it the test says so and passes,
//! unless `FISSION_REQUIRE_TEST_TOOLS=1` (CI sets it).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use testkit::cluster_builder::ClusterBuilder;
use testkit::phoenix::{Phoenix, PhoenixSpan};

const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";
/// A prompt of more than [`MAX_LOCAL_PREFILL_TOKENS`] tokens: prefilled on the prefill node.
const TRACE_DISAGGREGATED: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
/// A prompt of fewer: prefilled on the decode node.
const TRACE_COLOCATED: &str = "4bf92f3577b34da6a3ce929d0e0e4737";
/// An empty prompt: rejected by the gateway, so only the gateway traces it.
const TRACE_REJECTED: &str = "4bf92f3577b34da6a3ce929d0e0e4738";
const LONG_PROMPT: &str =
    "Once upon a time there was a little girl named Lily. She liked to play in the park.";
const SHORT_PROMPT: &str = "Hi";
const MAX_LOCAL_PREFILL_TOKENS: usize = 8;
const SERVICES: [&str; 3] = ["fission-gateway", "fission-prefill", "fission-decode"];
/// What a user may have exported for some other program; `fission up` must not pass it on.
const LEAKED_SERVICE_NAME: &str = "fission-e2e-leaked-name";
/// Nothing listens here: a process exporting to the standard variables loses its spans.
const DEAD_ENDPOINT: &str = "http://127.0.0.1:9";

/// `POST /generate` with the client span `00f067aa0ba902b7` of `trace_id`; the status.
fn generate(
    rt: &tokio::runtime::Runtime,
    url: &str,
    trace_id: &str,
    prompt: &str,
) -> anyhow::Result<u16> {
    rt.block_on(async {
        let response = reqwest::Client::new()
            .post(format!("{url}/generate"))
            .header("traceparent", format!("00-{trace_id}-{CLIENT_SPAN_ID}-01"))
            .json(&serde_json::json!({"inputs": prompt, "parameters": {"max_new_tokens": 8}}))
            .send()
            .await?;
        let status = response.status().as_u16();
        let body = response.text().await?;
        if status == 200 {
            anyhow::ensure!(body.contains("generated_text"), "{body}");
        }
        Ok(status)
    })
}

/// The names of Phoenix's projects.
fn projects(rt: &tokio::runtime::Runtime, phoenix: &Phoenix) -> anyhow::Result<Vec<String>> {
    let url = format!("http://{}/v1/projects?limit=1000", phoenix.http_addr());
    let body: serde_json::Value =
        rt.block_on(async { reqwest::get(&url).await?.error_for_status()?.json().await })?;
    Ok(body["data"]
        .as_array()
        .context("a list of projects")?
        .iter()
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect())
}

/// Every span Phoenix holds, by the project it filed them under.
fn spans_by_project(phoenix: &Phoenix) -> anyhow::Result<HashMap<&'static str, Vec<PhoenixSpan>>> {
    SERVICES
        .iter()
        .map(|p| Ok((*p, phoenix.spans(p)?)))
        .collect()
}

fn in_trace<'a>(
    by_project: &'a HashMap<&str, Vec<PhoenixSpan>>,
    trace_id: &str,
) -> Vec<&'a PhoenixSpan> {
    by_project
        .values()
        .flatten()
        .filter(|s| s.trace_id == trace_id)
        .collect()
}

const DISAGGREGATED_SPANS: [&str; 10] = [
    "http_request",
    "validate",
    "generate",
    "route",
    "prefill",
    "queue_wait",
    "kv_transfer",
    "kv_receive",
    "decode",
    "stream",
];
const COLOCATED_SPANS: [&str; 7] = [
    "http_request",
    "validate",
    "generate",
    "route",
    "stream",
    "decode",
    "queue_wait",
];

/// Whether everything the assertions read has arrived.
fn complete(by_project: &HashMap<&str, Vec<PhoenixSpan>>) -> bool {
    let has = |trace: &str, names: &[&str]| {
        let spans = in_trace(by_project, trace);
        names.iter().all(|n| spans.iter().any(|s| s.name == *n))
    };
    let batch_in = |project: &str, name: &str| {
        by_project[project]
            .iter()
            .any(|s| s.name == name && s.parent_id.is_none())
    };
    has(TRACE_DISAGGREGATED, &DISAGGREGATED_SPANS)
        && has(TRACE_COLOCATED, &COLOCATED_SPANS)
        && has(TRACE_REJECTED, &["http_request"])
        && batch_in("fission-prefill", "prefill_batch")
        && batch_in("fission-decode", "decode_batch")
}

/// One request's spans, checked.
struct Trace<'a> {
    spans: Vec<&'a PhoenixSpan>,
}

impl<'a> Trace<'a> {
    fn find(&self, name: &str) -> &'a PhoenixSpan {
        self.spans
            .iter()
            .find(|s| s.name == name)
            .copied()
            .unwrap_or_else(|| panic!("no {name} span in the trace"))
    }

    fn attr(&self, name: &str, key: &str) -> String {
        self.find(name).attributes[key]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    /// The gateway's root hangs off the client's span; returns it.
    fn root(&self) -> &'a PhoenixSpan {
        let root = self.find("http_request");
        assert_eq!(root.parent_id.as_deref(), Some(CLIENT_SPAN_ID));
        root
    }

    /// Follows parents from `start` and asserts the walk ends at the gateway's root.
    fn assert_chains_to_root(&self, start: &str) {
        let by_id: HashMap<&str, &PhoenixSpan> = self
            .spans
            .iter()
            .map(|s| (s.span_id.as_str(), *s))
            .collect();
        let root = self.root();
        let mut at = self.find(start);
        let mut chain = vec![at.name.clone()];
        while let Some(parent) = at.parent_id.as_deref().and_then(|p| by_id.get(p)) {
            at = parent;
            chain.push(at.name.clone());
        }
        assert_eq!(
            at.span_id, root.span_id,
            "{start} chains up to the gateway's root: {chain:?}"
        );
        println!("{}", chain.join(" -> "));
    }
}

#[test]
fn requests_are_traces_across_services_named_per_process() -> anyhow::Result<()> {
    let Some(phoenix) = Phoenix::start()? else {
        return Ok(());
    };
    // The flag must beat both variables in every process, and every process must report
    // under its own name whatever `OTEL_SERVICE_NAME` says.
    let up = ClusterBuilder::new(env!("CARGO_BIN_EXE_fission"))
        .num_kv_blocks(256)
        .arg(format!(
            "--max-local-prefill-tokens={MAX_LOCAL_PREFILL_TOKENS}"
        ))
        .arg("--otlp-endpoint")
        .arg(phoenix.otlp_grpc_endpoint())
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", DEAD_ENDPOINT)
        .env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", DEAD_ENDPOINT)
        .env("OTEL_SERVICE_NAME", LEAKED_SERVICE_NAME)
        .start();
    let url = up.url.clone();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    assert_eq!(generate(&rt, &url, TRACE_DISAGGREGATED, LONG_PROMPT)?, 200);
    assert_eq!(generate(&rt, &url, TRACE_COLOCATED, SHORT_PROMPT)?, 200);
    assert_eq!(generate(&rt, &url, TRACE_REJECTED, "")?, 422);

    let mut by_project = HashMap::new();
    let arrived = testkit::wait::try_wait_until(
        "every span to reach Phoenix",
        Duration::from_secs(60),
        || {
            by_project = spans_by_project(&phoenix).unwrap_or_default();
            complete(&by_project)
        },
    );
    if let Err(timed_out) = arrived {
        let names = |trace| -> Vec<String> {
            in_trace(&by_project, trace)
                .iter()
                .map(|s| s.name.clone())
                .collect()
        };
        panic!(
            "{timed_out}: disaggregated {:?}, colocated {:?}, rejected {:?}; projects {:?}\n{}",
            names(TRACE_DISAGGREGATED),
            names(TRACE_COLOCATED),
            names(TRACE_REJECTED),
            projects(&rt, &phoenix)?,
            phoenix.log_tail()
        );
    }
    drop(up);

    // Every process reported under its own service name, none under the inherited one.
    let projects = projects(&rt, &phoenix)?;
    assert!(
        !projects.iter().any(|p| p == LEAKED_SERVICE_NAME),
        "OTEL_SERVICE_NAME leaked into the children: {projects:?}"
    );
    // Traces that only one service makes are filed under that service.
    let rejected: Vec<&str> = by_project["fission-gateway"]
        .iter()
        .filter(|s| s.trace_id == TRACE_REJECTED)
        .map(|s| s.name.as_str())
        .collect();
    assert!(
        rejected.contains(&"http_request"),
        "the gateway's own trace is under fission-gateway: {rejected:?}"
    );
    for (service, batch, other) in [
        ("fission-prefill", "prefill_batch", "decode_batch"),
        ("fission-decode", "decode_batch", "prefill_batch"),
    ] {
        let names: Vec<&str> = by_project[service]
            .iter()
            .filter(|s| s.parent_id.is_none())
            .map(|s| s.name.as_str())
            .collect();
        assert!(names.contains(&batch), "{batch} under {service}: {names:?}");
        assert!(
            !names.contains(&other),
            "{other} under {service}: {names:?}"
        );
    }
    assert!(
        !by_project["fission-gateway"]
            .iter()
            .any(|s| s.name.ends_with("_batch")),
        "node batches under fission-gateway"
    );

    // The disaggregated request: kv_receive (decode) -> kv_transfer (prefill) -> prefill ->
    // route -> ... -> http_request, all in the client's trace.
    let disaggregated = Trace {
        spans: in_trace(&by_project, TRACE_DISAGGREGATED),
    };
    disaggregated.root();
    assert_eq!(disaggregated.attr("route", "mode"), "disaggregated");
    let transfer = disaggregated.find("kv_transfer");
    assert_eq!(
        disaggregated.find("kv_receive").parent_id.as_deref(),
        Some(transfer.span_id.as_str())
    );
    assert_eq!(
        transfer.parent_id.as_deref(),
        Some(disaggregated.find("prefill").span_id.as_str())
    );
    for start in ["kv_receive", "decode", "stream"] {
        disaggregated.assert_chains_to_root(start);
    }

    // The colocated request: the decode node's spans are in the client's trace under the
    // gateway's root, and no prefill node took part.
    let colocated = Trace {
        spans: in_trace(&by_project, TRACE_COLOCATED),
    };
    colocated.root();
    assert_eq!(colocated.attr("route", "mode"), "colocated");
    for start in ["stream", "decode", "queue_wait"] {
        colocated.assert_chains_to_root(start);
    }
    for absent in ["prefill", "kv_transfer", "kv_receive"] {
        assert!(
            !colocated.spans.iter().any(|s| s.name == absent),
            "{absent} in a colocated request"
        );
    }

    // The rejected request says why on the gateway's root; a client error leaves the span's
    // status unset (OpenTelemetry's HTTP conventions for server spans).
    let rejected = Trace {
        spans: in_trace(&by_project, TRACE_REJECTED),
    };
    rejected.root();
    assert_eq!(rejected.attr("http_request", "error_type"), "validation");
    let status = &rejected.find("http_request").attributes["status"];
    assert!(
        status == 422 || status == "422",
        "http_request status {status}"
    );
    assert_ne!(rejected.find("http_request").raw["status_code"], "ERROR");

    // Prompt text never appears in span attributes.
    for s in by_project.values().flatten() {
        let attributes = s.attributes.to_string();
        assert!(
            !attributes.contains(LONG_PROMPT) && !attributes.contains("little girl named Lily"),
            "{} carries the prompt",
            s.name
        );
    }
    for (name, trace) in [("disaggregated", &disaggregated), ("colocated", &colocated)] {
        let names: Vec<&str> = trace.spans.iter().map(|s| s.name.as_str()).collect();
        println!("{name}: {} spans {names:?}", names.len());
    }
    Ok(())
}
