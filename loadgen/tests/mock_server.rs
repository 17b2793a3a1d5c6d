//! The library's entry point against a real HTTP server on 127.0.0.1 that speaks each API
//! with known delays: the first token after `TTFT`, each next one `ITL` later. The measured
//! TTFT and TPOT must match them, and the JSON and SVG files must be written.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use loadgen::config::{Api, Bounds, LoadConfig, LoadPlan, LoadShape, Target};
use loadgen::prompt::PromptStyle;
use loadgen::{Slo, WorkloadConfig};
use serde_json::{json, Value};

const TTFT: Duration = Duration::from_millis(60);
const ITL: Duration = Duration::from_millis(20);
const OUTPUT_LEN: usize = 6;

#[derive(Clone, Default)]
struct Mock {
    bodies: Arc<Mutex<Vec<Value>>>,
    requests: Arc<AtomicUsize>,
    /// Every `fail_every`-th request gets 429 (0: never).
    fail_every: usize,
}

async fn start(mock: Mock) -> SocketAddr {
    let app = Router::new()
        .route(
            "/v1/models",
            get(|| async { Json(json!({"data": [{"id": "mock-model"}]})) }),
        )
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/generate_stream", post(tgi))
        .with_state(mock);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Records the body; `Err` with a 429 when this request is one the mock fails.
fn admit(mock: &Mock, body: Value) -> Result<(), Box<Response>> {
    let n = mock.requests.fetch_add(1, Ordering::SeqCst) + 1;
    mock.bodies.lock().expect("not poisoned").push(body);
    if mock.fail_every > 0 && n.is_multiple_of(mock.fail_every) {
        let err = json!({"error": "queue full", "error_type": "overloaded"});
        return Err(Box::new(
            (StatusCode::TOO_MANY_REQUESTS, Json(err)).into_response(),
        ));
    }
    Ok(())
}

/// An SSE response: each event after its delay.
fn sse(events: Vec<(Duration, String)>) -> Response {
    let stream = futures::stream::unfold(events.into_iter(), |mut it| async move {
        let (delay, data) = it.next()?;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        Some((Ok::<_, Infallible>(format!("data: {data}\n\n")), it))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

fn token_delay(i: usize) -> Duration {
    if i == 0 {
        TTFT
    } else {
        ITL
    }
}

/// Fission-like: a chunk per token, `finish_reason` on the last, usage, `[DONE]`.
async fn completions(State(mock): State<Mock>, Json(body): Json<Value>) -> Response {
    let n = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    if let Err(r) = admit(&mock, body) {
        return *r;
    }
    let mut events: Vec<(Duration, String)> = (0..n)
        .map(|i| {
            let finish = if i + 1 == n {
                json!("length")
            } else {
                Value::Null
            };
            let chunk = json!({"choices": [{"index": 0, "text": " the", "finish_reason": finish}]});
            (token_delay(i), chunk.to_string())
        })
        .collect();
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}});
    events.push((Duration::ZERO, usage.to_string()));
    events.push((Duration::ZERO, "[DONE]".into()));
    sse(events)
}

/// llama-server-like: a role-only delta at once, content deltas, an empty delta with the
/// `finish_reason`, `[DONE]`, and no usage.
async fn chat(State(mock): State<Mock>, Json(body): Json<Value>) -> Response {
    let n = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    if let Err(r) = admit(&mock, body) {
        return *r;
    }
    let delta = |d: Value, finish: Value| {
        json!({"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}).to_string()
    };
    let mut events = vec![(
        Duration::ZERO,
        delta(json!({"role": "assistant", "content": null}), Value::Null),
    )];
    events.extend((0..n).map(|i| (token_delay(i), delta(json!({"content": " a"}), Value::Null))));
    events.push((Duration::ZERO, delta(json!({}), json!("length"))));
    events.push((Duration::ZERO, "[DONE]".into()));
    sse(events)
}

/// TGI: an event per token, the last with `generated_text` and `details`.
async fn tgi(State(mock): State<Mock>, Json(body): Json<Value>) -> Response {
    let n = body["parameters"]["max_new_tokens"].as_u64().unwrap_or(16) as usize;
    if let Err(r) = admit(&mock, body) {
        return *r;
    }
    let events = (0..n)
        .map(|i| {
            let last = i + 1 == n;
            let ev = json!({
                "index": i + 1,
                "token": {"id": 5, "text": " it", "logprob": 0.0, "special": false},
                "generated_text": if last { json!("...") } else { Value::Null },
                "details": if last { json!({"finish_reason": "length", "generated_tokens": n}) } else { Value::Null },
            });
            (token_delay(i), ev.to_string())
        })
        .collect();
    sse(events)
}

fn config(addr: SocketAddr, api: Api, plan: LoadPlan) -> LoadConfig {
    LoadConfig {
        target: Target {
            base_url: format!("http://{addr}"),
            api,
            model: None,
            api_key: None,
        },
        plan,
        workload: WorkloadConfig::fixed(16, OUTPUT_LEN, PromptStyle::Words),
        bounds: Bounds {
            duration: Duration::from_millis(1200),
            max_requests: 60,
            request_timeout: Duration::from_secs(10),
        },
        slo: Slo {
            ttft_ms: 1000.0,
            tpot_ms: 200.0,
        },
        seed: 1,
        warmup_requests: 1,
        json_path: None,
        plot_dir: None,
        quiet: true,
    }
}

fn within(label: &str, measured: Option<f64>, floor: Duration, slack_ms: f64) {
    let v = measured.unwrap_or_else(|| panic!("{label}: no samples"));
    let floor = floor.as_secs_f64() * 1e3;
    // The server cannot be faster than its delays; the slack absorbs a loaded 2-core machine.
    assert!(
        v >= floor - 1.0 && v <= floor + slack_ms,
        "{label} = {v:.1} ms, expected {floor} ms (+{slack_ms})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_is_measured_against_known_delays() {
    for api in [Api::OpenaiCompletions, Api::OpenaiChat, Api::Tgi] {
        let mock = Mock::default();
        let addr = start(mock.clone()).await;
        let plan = LoadPlan::Single(LoadShape::Closed { concurrency: 2 });
        let report = loadgen::run(&config(addr, api, plan))
            .await
            .expect("run completes");
        let s = &report.levels[0].summary;
        assert!(s.requests >= 4, "{api:?}: only {} requests", s.requests);
        assert_eq!(s.failed, 0, "{api:?}: {:?}", s.errors);
        assert_eq!(s.mean_output_tokens, OUTPUT_LEN as f64, "{api:?}");
        within(&format!("{api:?} TTFT p50"), s.ttft_ms.p50, TTFT, 80.0);
        within(&format!("{api:?} TPOT p50"), s.tpot_ms.p50, ITL, 20.0);
        within(&format!("{api:?} ITL p50"), s.itl_ms.p50, ITL, 20.0);
        let e2e = TTFT + ITL * (OUTPUT_LEN as u32 - 1);
        within(&format!("{api:?} e2e p50"), s.e2e_ms.p50, e2e, 150.0);
        assert_eq!(s.slo_attainment, 1.0, "{api:?}");
        // Closed loop, 2 clients, ~160 ms a request: about 12 req/s, never past the bound.
        assert!(s.requests <= 60);
        // The warm-up request and the level's, nothing else.
        assert_eq!(mock.requests.load(Ordering::SeqCst), s.requests + 1);
        let bodies = mock.bodies.lock().expect("not poisoned");
        for b in bodies.iter() {
            match api {
                Api::Tgi => assert_eq!(b["parameters"]["max_new_tokens"], OUTPUT_LEN),
                _ => {
                    assert_eq!(b["max_tokens"], OUTPUT_LEN);
                    assert_eq!(b["ignore_eos"], true);
                    assert_eq!(b["stream"], true);
                    assert_eq!(b["model"], "mock-model", "discovered from /v1/models");
                }
            }
        }
        assert_eq!(
            report.model.as_deref(),
            api.is_openai().then_some("mock-model")
        );
    }
}

fn assert_svg(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        text.contains("<svg") && text.contains("</svg>"),
        "{}",
        path.display()
    );
    assert!(
        text.contains("<polyline") || text.contains("<path"),
        "{} has no lines",
        path.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_finds_the_goodput_and_writes_json_and_plots() {
    let addr = start(Mock::default()).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let json_path = dir.path().join("out.json");
    let plot_dir = dir.path().join("plots");
    let plan = LoadPlan::Sweep {
        rates: "4,8,16".parse().expect("valid sweep"),
        burstiness: 1.0,
        bisect_steps: 2,
    };
    let mut c = config(addr, Api::OpenaiCompletions, plan);
    c.bounds.duration = Duration::from_millis(1000);
    c.json_path = Some(json_path.clone());
    c.plot_dir = Some(plot_dir.clone());
    let report = loadgen::run(&c).await.expect("sweep completes");
    // The mock serves every request in ~160 ms: every rate meets a 1 s / 200 ms SLO.
    let sweep = report.sweep.as_ref().expect("a sweep report");
    assert_eq!(sweep.goodput_rps, Some(16.0), "{}", report.markdown());
    assert_eq!(sweep.first_miss_rps, None);
    assert_eq!(report.levels.len(), 3);
    let md = report.markdown();
    assert!(md.contains("goodput ≥ 16.000 req/s"), "{md}");
    assert!(md.contains("| TTFT | TPOT | ITL | end-to-end |"), "{md}");

    let v: Value = serde_json::from_slice(&std::fs::read(&json_path).expect("JSON written"))
        .expect("valid JSON");
    assert_eq!(v["sweep"]["goodput_rps"], 16.0);
    assert_eq!(v["levels"].as_array().map(Vec::len), Some(3));
    let first = &v["levels"][0];
    assert_eq!(first["summary"]["shape"]["rate_rps"], 4.0);
    assert!(first["summary"]["ttft_ms"]["p99"].as_f64().is_some());
    assert_eq!(
        first["requests"].as_array().map(Vec::len),
        first["summary"]["requests"].as_u64().map(|n| n as usize)
    );
    for name in [
        "ttft_cdf.svg",
        "tpot_cdf.svg",
        "e2e_cdf.svg",
        "attainment_vs_rate.svg",
        "goodput_vs_rate.svg",
        "ttft_vs_rate.svg",
        "tpot_vs_rate.svg",
    ] {
        assert_svg(&plot_dir.join(name));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slos_tighter_than_the_server_leave_no_goodput() {
    let addr = start(Mock::default()).await;
    let plan = LoadPlan::Single(LoadShape::Open {
        rate_rps: 5.0,
        burstiness: 1.0,
    });
    let mut c = config(addr, Api::OpenaiChat, plan);
    // The mock's first token takes 60 ms: a 30 ms TTFT SLO cannot be met.
    c.slo.ttft_ms = 30.0;
    let dir = tempfile::tempdir().expect("temp dir");
    c.json_path = Some(dir.path().join("single.json"));
    let report = loadgen::run(&c).await.expect("run completes");
    let v: Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("single.json")).expect("JSON written"),
    )
    .expect("valid JSON");
    assert_eq!(v["config"]["plan"]["single"]["mode"], "open");
    assert_eq!(v["config"]["target"]["api"], "openai-chat");
    assert!(
        v["config"]["target"].get("api_key").is_none(),
        "keys stay out of reports"
    );
    assert_eq!(v["sweep"], Value::Null);
    assert_eq!(v["levels"][0]["summary"]["meets_slo"], false);
    let s = &report.levels[0].summary;
    assert!(s.ok > 0);
    assert_eq!(s.slo_attainment, 0.0);
    assert!(!s.meets_slo);
    assert_eq!(report.goodput_rps(), None);
    assert!(report.markdown().contains("goodput: none"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind() {
    let mock = Mock {
        fail_every: 2,
        ..Mock::default()
    };
    let addr = start(mock).await;
    let plan = LoadPlan::Single(LoadShape::Closed { concurrency: 1 });
    let mut c = config(addr, Api::OpenaiCompletions, plan);
    c.warmup_requests = 0;
    c.bounds.max_requests = 6;
    let report = loadgen::run(&c).await.expect("run completes");
    let s = &report.levels[0].summary;
    assert_eq!(s.requests, 6, "bounded by max_requests");
    assert_eq!(s.errors.get("http_429"), Some(&3), "{:?}", s.errors);
    assert!((s.slo_attainment - 0.5).abs() < 1e-9);

    // A port with nothing listening: every request is a connect error, and the run still ends.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("bound")
    };
    let mut c = config(
        closed,
        Api::Tgi,
        LoadPlan::Single(LoadShape::Closed { concurrency: 1 }),
    );
    c.warmup_requests = 0;
    c.bounds.max_requests = 3;
    let report = loadgen::run(&c).await.expect("run completes");
    assert_eq!(report.levels[0].summary.errors.get("connect"), Some(&3));
}
