//! A decode node SIGKILLed while the prefill node pushes layers to it, over each transport
//! that writes into the decode node's memory rather than a socket: shared memory (the slots
//! the sink reads in place) and UCX, whose endpoints run without UCX's peer-failure mode
//! (kvtransfer/src/ucx/worker.rs). The prefill node must survive the death, fail its pushes
//! to the dead node at once, and serve every request through the other decode node over the
//! same transport, with every block back.

use std::time::{Duration, Instant};

use testkit::fission::metric;
use testkit::{streams, wait_until};

use crate::harness::{
    assert_all_ok, assert_ended_within, body, long_model, long_prompt, node, report, Cluster,
};
use crate::{serial, FAULT_BOUND, REQUEST_TIMEOUT};

/// UCX over TCP between the nodes, as between hosts: no shared memory beside it.
const UCX: [&str; 4] = [
    "--kv-transport",
    "ucx",
    "--insecure",
    "--kv-same-host-shm=false",
];
/// The same-host default: shared memory beside the TCP transport the suite's nodes run.
const SHM: [&str; 0] = [];

fn pushes_over(c: &Cluster, transport: &str) -> f64 {
    metric(
        &c.node("prefill-0").metrics,
        &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
    )
}

#[test]
fn a_decode_node_killed_mid_push_over_ucx_costs_no_request_and_no_prefill_node() {
    killed_mid_push(&UCX, "ucx");
}

#[test]
fn a_decode_node_killed_mid_push_over_shm_costs_no_request_and_no_prefill_node() {
    killed_mid_push(&SHM, "shm");
}

/// The nodes run with `transport_args`; every push must go over `transport`.
fn killed_mid_push(transport_args: &[&str], transport: &str) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let model = long_model(dir.path());
    let limits = ["--max-input-tokens", "1900", "--max-total-tokens", "2048"];
    let args: Vec<&str> = transport_args.iter().chain(&limits).copied().collect();
    let mut c = Cluster::start(
        dir.path(),
        &model,
        vec![
            node("prefill", "prefill-0", &args),
            node("decode", "decode-0", &args),
            node("decode", "decode-1", &args),
        ],
        &limits,
    );
    let url = c.url.clone();
    let load = std::thread::spawn(move || {
        streams::run(&url, 4, 3, REQUEST_TIMEOUT, |client, i| {
            body(
                &long_prompt(&format!("client {client} request {i}"), 1200),
                16,
            )
        })
    });
    // Kill decode-0 once layers have reached it and the prefill node has a prompt in flight:
    // a 1.2K-token prompt's layers stream while it computes.
    let decode0 = c.node("decode-0").metrics.clone();
    wait_until(
        "layers pushed to decode-0 with a prompt in flight",
        Duration::from_secs(60),
        || {
            metric(&decode0, "fission_decode_kv_received_bytes_total") > 0.0
                && c.info()["backend"]["nodes"]
                    .as_array()
                    .is_some_and(|nodes| {
                        nodes.iter().any(|n| {
                            n["node_id"] == "prefill-0" && n["in_flight"].as_u64() > Some(0)
                        })
                    })
        },
    );
    let pushed_before = pushes_over(&c, transport);
    // Alive until now: a transport's own faults show here (a crash inside UCX's TCP put
    // receive, with rendezvous over two devices, was one).
    assert!(c.alive("decode-0"), "decode-0 died before the kill");
    c.node("decode-0").signal(libc::SIGKILL);
    let fault = Instant::now();
    let records = load.join().unwrap();
    report(
        &format!("decode SIGKILL mid-push over {transport} on 1P+2D"),
        &records,
    );
    assert_all_ok(&records, "across decode-0's death");
    assert_ended_within(&records, fault, FAULT_BOUND * 3);
    // The prefill node lived through its peer's death, and went on pushing the same way.
    assert!(
        c.alive("prefill-0"),
        "prefill-0 died with its {transport} peer"
    );
    assert!(c.ready_nodes().iter().any(|n| n == "prefill-0"));
    assert!(
        pushes_over(&c, transport) > pushed_before,
        "no {transport} push after the kill"
    );
    let other: f64 = ["quic", "tcp", "shm", "ucx"]
        .iter()
        .filter(|&&t| t != transport)
        .map(|t| pushes_over(&c, t))
        .sum();
    assert_eq!(other, 0.0, "pushes beside {transport}");
    assert!(
        metric(
            &c.node("decode-1").metrics,
            "fission_decode_kv_received_bytes_total"
        ) > 0.0
    );
    c.assert_kv_released();
    c.assert_serves();
}
