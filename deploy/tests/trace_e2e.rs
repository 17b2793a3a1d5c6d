//! One request through a real 1P+1D cluster (`fission up`, separate processes) exports one
//! trace to a real OTLP backend (Arize Phoenix): spans from the gateway, the prefill node and
//! the decode node, joined by the client's `traceparent`, with `kv_transfer` and `kv_receive`
//! whose parents chain up to the gateway's root span.
//!
//! Needs Phoenix (`./deploy/install-test-tools.sh`); without it the test says so and passes,
//! unless `FISSION_REQUIRE_TEST_TOOLS=1` (CI sets it).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::phoenix::{Phoenix, PhoenixSpan};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN_ID: &str = "00f067aa0ba902b7";

fn stories_dir() -> PathBuf {
    let root = std::env::var_os("FISSION_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared")));
    root.join("models/stories260K")
}

struct Up(std::process::Child);

impl Drop for Up {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.0.id() as libc::pid_t, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

#[test]
fn one_request_is_one_trace_across_three_services() -> anyhow::Result<()> {
    let Some(phoenix) = Phoenix::start()? else {
        return Ok(());
    };
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fission"))
        .args(["up", "--model"])
        .arg(stories_dir())
        .args([
            "--prefill",
            "1",
            "--decode",
            "1",
            "--port",
            &port.to_string(),
        ])
        .arg("--node-arg=--num-kv-blocks=256")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", phoenix.otlp_grpc_endpoint())
        .env_remove("OTEL_SERVICE_NAME")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let out = child.stdout.take().expect("stdout");
    let up = Up(child);
    let url = BufReader::new(out)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("Fission is up: ").map(str::to_string))
        .expect("fission up comes up");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let resp = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{url}/generate"))
            .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"))
            .json(&serde_json::json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}))
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    })?;
    assert!(resp.contains("generated_text"), "{resp}");

    // Phoenix files a whole trace under one project (the first service's), so read all three
    // and tell the services apart by the module that made each span: each module runs in one
    // service only.
    let expected = [
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
    let projects = ["fission-gateway", "fission-prefill", "fission-decode"];
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let all: Vec<PhoenixSpan> = loop {
        let mut spans = Vec::new();
        for p in projects {
            spans.extend(
                phoenix
                    .spans(p)?
                    .into_iter()
                    .filter(|s| s.trace_id == TRACE_ID),
            );
        }
        if expected.iter().all(|n| spans.iter().any(|s| s.name == *n)) {
            break spans;
        }
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        assert!(
            std::time::Instant::now() < deadline,
            "trace incomplete after 60 s: {names:?}\n{}",
            phoenix.log_tail()
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    drop(up);
    let module = |s: &PhoenixSpan| {
        s.attributes["code.module.name"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    for prefix in ["gateway::", "prefill_node::", "decode_node::"] {
        assert!(
            all.iter().any(|s| module(s).starts_with(prefix)),
            "spans from the {prefix} service"
        );
    }
    let by_id: HashMap<&str, &PhoenixSpan> = all.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let find = |name: &str| -> &PhoenixSpan {
        all.iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in the trace"))
    };

    // The gateway's root hangs off the client's span.
    let root = find("http_request");
    assert_eq!(root.parent_id.as_deref(), Some(CLIENT_SPAN_ID));

    // kv_receive (decode) -> kv_transfer (prefill) -> prefill -> route -> ... -> http_request.
    let receive = find("kv_receive");
    let transfer = find("kv_transfer");
    assert_eq!(
        receive.parent_id.as_deref(),
        Some(transfer.span_id.as_str())
    );
    assert_eq!(
        transfer.parent_id.as_deref(),
        Some(find("prefill").span_id.as_str())
    );
    for start in [receive, find("decode"), find("stream")] {
        let mut chain = vec![start.name.clone()];
        let mut at = start;
        while let Some(parent) = at.parent_id.as_deref().and_then(|p| by_id.get(p)) {
            at = parent;
            chain.push(at.name.clone());
        }
        assert_eq!(
            at.span_id, root.span_id,
            "{} chains up to the gateway's root: {chain:?}",
            start.name
        );
        println!("{}", chain.join(" -> "));
    }
    // Prompt text never appears in span attributes.
    for s in &all {
        assert!(
            !s.attributes.to_string().contains("Once upon a time"),
            "{} carries the prompt",
            s.name
        );
    }
    let count = |prefix: &str| all.iter().filter(|s| module(s).starts_with(prefix)).count();
    println!(
        "trace {TRACE_ID}: {} gateway, {} prefill, {} decode (+{} kv_receive) spans",
        count("gateway::"),
        count("prefill_node::"),
        count("decode_node::"),
        count("kvtransfer::")
    );
    Ok(())
}
