//! What tracing costs one request: the spans, events, links and trace-context hops that the
//! gateway, a prefill node and a decode node make for one request, run in one process, with
//! tracing off (the services' default: the log layer only, at `warn`), with OTLP export to a
//! closed port (a dead collector), and with export to an in-process sink (a healthy
//! collector), alternating in one run.
//!
//! `cargo bench -p telemetry --bench request_spans`. Prints the median microseconds per request
//! for 2 layers (the overhead scenario's tiny model) and 30 layers (SmolLM2-135M), and the
//! added cost next to the off baseline. Compare the added cost with the cluster's CPU time per
//! request, which `loadtest/scenarios/otlp_overhead.sh` prints.

use std::hint::black_box;
use std::net::TcpListener;
use std::time::{Duration, Instant};

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use telemetry::{OpenTelemetrySpanExt, TelemetryGuard, TelemetrySettings};

/// New tokens per request, as in the overhead scenario.
const NEW_TOKENS: usize = 32;
/// Requests sharing a decode batch composition (the scenario's concurrency).
const BATCH: usize = 8;
const REQUESTS_PER_ROUND: usize = 1000;
const ROUNDS: usize = 15;

#[derive(Debug)]
struct Sink;

impl SpanExporter for Sink {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        black_box(batch);
        Ok(())
    }
}

fn settings(endpoint: Option<String>) -> TelemetrySettings {
    TelemetrySettings {
        service_name: "fission-span-bench".into(),
        otlp_endpoint: endpoint,
        default_filter: "warn".into(),
    }
}

/// A future's poll under its `Instrumented` span: enter, do nothing, exit.
fn poll_in(span: &tracing::Span) {
    let entered = span.enter();
    black_box(&entered);
}

/// One request's tracing work on all three services, shaped after the real call sites.
fn one_request(id: u64, layers: usize, client_traceparent: &http::HeaderMap) {
    // Gateway: the request span under the client's context, validation, the generation span
    // and routing, then a poll per streamed token.
    let request = tracing::info_span!(
        "http_request",
        method = "POST",
        path = "/generate_stream",
        request_id = id
    );
    telemetry::set_parent(&request, telemetry::extract_http(client_traceparent));
    let generate = request.in_scope(|| {
        tracing::info_span!("validate", prompt_tokens = 64).in_scope(|| black_box(id));
        tracing::info_span!(
            "generate",
            request_id = id,
            model = "bench",
            prompt_tokens = 64,
            max_new_tokens = NEW_TOKENS as i64,
            finish_reason = tracing::field::Empty,
            ttft_ms = tracing::field::Empty,
            tpot_ms = tracing::field::Empty
        )
    });
    let (mut to_prefill, mut to_decode) = generate.in_scope(|| {
        let route = tracing::info_span!(
            "route",
            policy = "cache-aware",
            prefill = "p-1",
            decode = "d-1",
            attempts = 1
        );
        route.in_scope(|| {
            let mut a = tonic::metadata::MetadataMap::new();
            let mut b = tonic::metadata::MetadataMap::new();
            telemetry::inject_grpc(&mut a);
            telemetry::inject_grpc(&mut b);
            (a, b)
        })
    });

    // Prefill node: the request's span under the gateway's, its queue wait, the batch step
    // that links to it, and the KV transfer with an event per layer and the frame's context.
    let prefill = tracing::info_span!(
        "prefill",
        request_id = id,
        prompt_tokens = 64,
        chunks = tracing::field::Empty,
        compute_ms = tracing::field::Empty
    );
    telemetry::set_parent(&prefill, telemetry::extract_grpc(&to_prefill));
    drop(tracing::info_span!(parent: &prefill, "queue_wait"));
    let step = tracing::info_span!(parent: None, "prefill_batch", tokens = 64, sequences = 1);
    telemetry::add_link(&step, &prefill.context());
    drop(step);
    let frame_traceparent = prefill.in_scope(|| {
        let transfer = tracing::info_span!("kv_transfer", request_id = id, kv_bytes = 0u64);
        transfer.in_scope(|| {
            for layer in 0..layers {
                tracing::info!(
                    layer = layer as i64,
                    bytes = 4096i64,
                    duration_ms = 0.1,
                    "layer sent"
                );
            }
            telemetry::current_traceparent()
        })
    });
    prefill.record("chunks", 1);
    prefill.record("compute_ms", 1.5);
    drop(prefill);

    // Decode node: KV receive under the transfer (through the frame header), the decode span
    // under the gateway's, its queue wait, its share of a batch span, and the token stream.
    let receive = tracing::info_span!("kv_receive", request_id = id, layers = layers as i64);
    if let Some(tp) = &frame_traceparent {
        telemetry::set_parent(&receive, telemetry::context_from_traceparent(tp));
    }
    for _ in 0..layers {
        poll_in(&receive);
    }
    drop(receive);
    let decode = tracing::info_span!(
        "decode",
        request_id = id,
        tokens = tracing::field::Empty,
        steps = tracing::field::Empty
    );
    telemetry::set_parent(&decode, telemetry::extract_grpc(&to_decode));
    drop(tracing::info_span!(parent: &decode, "queue_wait"));
    if id % BATCH as u64 == 0 {
        let batch = tracing::info_span!(parent: None, "decode_batch", sequences = BATCH as i64);
        for _ in 0..BATCH {
            telemetry::add_link(&batch, &decode.context());
        }
        drop(batch);
    }
    let stream = tracing::info_span!(parent: &decode, "stream", tokens = tracing::field::Empty);
    for _ in 0..NEW_TOKENS {
        poll_in(&stream);
        // The gateway polls its response future, under both of its spans, per token.
        poll_in(&request);
        poll_in(&generate);
    }
    stream.record("tokens", NEW_TOKENS as i64);
    decode.record("tokens", NEW_TOKENS as i64);
    decode.record("steps", NEW_TOKENS as i64);
    generate.record("finish_reason", "length");
    generate.record("ttft_ms", 12.5);
    generate.record("tpot_ms", 3.1);
    drop((stream, decode, generate, request));
    to_prefill.clear();
    to_decode.clear();
}

fn round(dispatch: &tracing::Dispatch, layers: usize, headers: &http::HeaderMap) -> Duration {
    tracing::dispatcher::with_default(dispatch, || {
        let started = Instant::now();
        for id in 0..REQUESTS_PER_ROUND as u64 {
            one_request(id, layers, headers);
        }
        started.elapsed()
    })
}

fn median_us(v: &mut [Duration]) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6 / REQUESTS_PER_ROUND as f64
}

fn main() -> anyhow::Result<()> {
    for var in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ] {
        anyhow::ensure!(
            std::env::var_os(var).is_none(),
            "unset {var}: it would turn the off baseline on"
        );
    }
    let closed_port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse()?,
    );

    let (off, g0) = telemetry::build(&settings(None))?;
    let (dead, g1) = telemetry::build(&settings(Some(format!("http://127.0.0.1:{closed_port}"))))?;
    let (sink, g2) = telemetry::build_with_exporter(&settings(None), Sink)?;
    let variants: [(&str, &tracing::Dispatch, &TelemetryGuard); 3] = [
        ("tracing off", &off, &g0),
        ("OTLP, dead collector", &dead, &g1),
        ("OTLP, healthy sink", &sink, &g2),
    ];

    println!(
        "tracing cost per request ({NEW_TOKENS} new tokens, {REQUESTS_PER_ROUND} requests x {ROUNDS} rounds, medians)"
    );
    println!(
        "{:>6}  {:<22} {:>12} {:>14}",
        "layers", "mode", "us/request", "added vs off"
    );
    for layers in [2usize, 30] {
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
        for (_, d, _) in &variants {
            round(d, layers, &headers); // warm-up
        }
        // Alternate the modes, starting each round with the next one, so that drift on a
        // shared machine hits them alike; flush each mode's export thread before the next
        // mode's timed round, so no round pays for another's export.
        for r in 0..ROUNDS {
            for k in 0..variants.len() {
                let i = (r + k) % variants.len();
                let (_, d, guard) = variants[i];
                times[i].push(round(d, layers, &headers));
                guard.force_flush().ok();
            }
        }
        let base = median_us(&mut times[0]);
        for (i, (name, _, _)) in variants.iter().enumerate() {
            let us = median_us(&mut times[i]);
            let added = if i == 0 {
                "baseline".to_string()
            } else {
                format!("+{:.1} us", us - base)
            };
            println!("{layers:>6}  {name:<22} {us:>12.1} {added:>14}");
        }
    }
    Ok(())
}
