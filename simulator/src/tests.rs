//! Tests of the event loop, the levels and the planner against cost models whose answers are
//! known.

use std::time::Duration;

use routing_policy::PolicyKind;

use crate::cluster::{SimCluster, Topology};
use crate::cost::{kv_arrival_s, CostModel, Linear3, Link, NodeSpec};
use crate::level::simulate_level;
use crate::plan::{plan, PlanConfig};
use crate::simulate::{simulate, LevelLimits, SimRequest};
use loadgen::config::{Bounds, LoadShape};
use loadgen::goodput::Slo;
use loadgen::prompt::PromptStyle;
use loadgen::record::RequestRecord;
use loadgen::workload::{RequestPlan, WorkloadConfig, WorkloadKind};

fn cost(prefill: Linear3, decode: Linear3) -> CostModel {
    CostModel {
        name: "synthetic".into(),
        link: Link {
            // 1024 B per token: a 256-token prompt is 0.262 MB, 26.2 ms at 10 MB/s.
            bandwidth_bytes_per_s: 10e6,
            latency_s: 0.002,
            layerwise: true,
            push_step_s_per_byte: 0.0,
        },
        node: NodeSpec {
            kv_blocks: 4096,
            block_size: 16,
        },
        ..crate::cost::tests::linear(prefill, decode)
    }
}

fn standard() -> CostModel {
    cost(
        Linear3 {
            a: 0.010,
            b: 1e-4,
            c: 0.5,
        },
        Linear3 {
            a: 0.005,
            b: 2e-4,
            c: 1e-6,
        },
    )
}

fn cluster(topology: Topology, cost: CostModel) -> SimCluster {
    SimCluster::new(topology, cost)
}

fn req(index: u64, input_len: usize, output_len: usize, arrival_s: f64) -> SimRequest {
    SimRequest {
        plan: RequestPlan {
            index,
            input_len,
            output_len,
            segments: vec![(input_len, 1000 + index)],
            system_segments: 0,
        },
        arrival_s,
    }
}

const LIMITS: LevelLimits = LevelLimits {
    request_timeout_s: 600.0,
    stop_when_missed: None,
};

fn run(c: &SimCluster, reqs: &[SimRequest]) -> Vec<RequestRecord> {
    let out = simulate(c, reqs, LIMITS);
    assert!(!out.stopped_early);
    for r in &out.records {
        assert!(r.ok(), "{r:?}");
    }
    out.records
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

/// Decode steps of a lone sequence after its first token: contexts L+1 .. L+n-1.
fn lone_decode_s(c: &CostModel, input: usize, output: usize) -> f64 {
    (1..output).map(|k| c.decode_s(1, input + k)).sum()
}

#[test]
fn a_lone_disaggregated_request_takes_exactly_the_cost_models_time() {
    let m = standard();
    let c = cluster(
        Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        },
        m.clone(),
    );
    let (input, output) = (256, 10);
    let r = &run(&c, &[req(0, input, output, 1.5)])[0];
    let ttft = m.prefill_s(input);
    assert!(close(r.ttft_s.expect("a first token"), ttft), "{r:?}");
    let (arrive, _) = kv_arrival_s(&m, input, 1.5, 1.5 + ttft, 0.0);
    let e2e = (arrive - 1.5) + lone_decode_s(&m, input, output);
    assert!(close(r.e2e_s, e2e), "{} vs {e2e}", r.e2e_s);
    let tpot = (e2e - ttft) / (output - 1) as f64;
    assert!(close(r.tpot_s().expect("tokens"), tpot));
    assert_eq!((r.output_tokens, r.itl_s.len()), (output, output - 1));
}

#[test]
fn a_lone_colocated_request_prefills_then_decodes_on_one_node() {
    let m = standard();
    let c = cluster(Topology::Colocated { nodes: 1 }, m.clone());
    let (input, output) = (300, 5);
    let r = &run(&c, &[req(0, input, output, 0.0)])[0];
    assert!(close(r.ttft_s.expect("a first token"), m.prefill_s(input)));
    let e2e = m.prefill_s(input) + lone_decode_s(&m, input, output);
    assert!(close(r.e2e_s, e2e), "{} vs {e2e}", r.e2e_s);
}

#[test]
fn layerwise_push_hides_the_transfer_behind_the_prefill() {
    let mut m = standard();
    // A slow link: 2.6 s for 256 tokens, longer than the 0.058 s prefill.
    m.link.bandwidth_bytes_per_s = 1e5;
    let topo = Topology::Disaggregated {
        prefill: 1,
        decode: 1,
    };
    let (input, output) = (256, 3);
    let layerwise = &run(&cluster(topo, m.clone()), &[req(0, input, output, 0.0)])[0];
    m.link.layerwise = false;
    let after = &run(&cluster(topo, m.clone()), &[req(0, input, output, 0.0)])[0];
    assert_eq!(
        layerwise.ttft_s, after.ttft_s,
        "the first token does not wait for KV"
    );
    // Layer-wise, the first 3 of 4 layers go out during the step: the wait after it is the
    // transfer less what overlapped.
    let transfer_s = m.kv_bytes(input) / m.link.bandwidth_bytes_per_s;
    let step_s = m.prefill_s(input);
    let saved = after.e2e_s - layerwise.e2e_s;
    assert!(
        close(saved, step_s * 3.0 / 4.0),
        "{saved} vs {}",
        step_s * 0.75
    );
    assert!(transfer_s > step_s);
}

#[test]
fn a_burst_queues_behind_one_prefill_at_a_time() {
    let m = standard();
    let mut c = cluster(
        Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        },
        m.clone(),
    );
    // One 512-token prompt per prefill step.
    c.node.max_batch_prefill_tokens = 512;
    let burst: Vec<SimRequest> = (0..5).map(|i| req(i, 512, 2, 0.0)).collect();
    let recs = run(&c, &burst);
    for (k, r) in recs.iter().enumerate() {
        let want = (k + 1) as f64 * m.prefill_s(512);
        assert!(
            close(r.ttft_s.expect("a first token"), want),
            "request {k}: {r:?}"
        );
    }
}

#[test]
fn two_nodes_serve_two_requests_apart_and_one_node_batches_them() {
    let m = standard();
    let two = [req(0, 64, 4, 0.0), req(1, 64, 4, 0.0)];
    for policy in [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoaded,
        PolicyKind::CacheAware,
    ] {
        let mut c = cluster(Topology::Colocated { nodes: 2 }, m.clone());
        c.gateway.routing = policy;
        let recs = run(&c, &two);
        let alone = m.prefill_s(64) + lone_decode_s(&m, 64, 4);
        for r in &recs {
            assert!(close(r.e2e_s, alone), "{policy}: {r:?}");
        }
    }
    // On one node the second arrives while the first prefills, then shares its steps.
    let one = run(&cluster(Topology::Colocated { nodes: 1 }, m.clone()), &two);
    let alone = m.prefill_s(64) + lone_decode_s(&m, 64, 4);
    assert!(close(
        one[0].ttft_s.expect("a first token"),
        m.prefill_s(64)
    ));
    assert!(one[1].ttft_s.expect("a first token") > m.prefill_s(64) * 2.0);
    assert!(one[0].e2e_s > alone, "{one:?}");
}

#[test]
fn kv_pressure_preempts_and_every_request_still_finishes() {
    let mut m = standard();
    // 24 blocks of 16 tokens: four 80-token prompts growing to 160 tokens cannot all fit.
    m.node.kv_blocks = 24;
    let c = cluster(Topology::Colocated { nodes: 1 }, m);
    let reqs: Vec<SimRequest> = (0..4).map(|i| req(i, 80, 80, 0.0)).collect();
    let recs = run(&c, &reqs);
    assert!(recs.iter().all(|r| r.output_tokens == 80));
}

#[test]
fn an_overloaded_level_times_out_at_the_horizon() {
    let m = standard();
    let c = cluster(Topology::Colocated { nodes: 1 }, m);
    let reqs: Vec<SimRequest> = (0..200)
        .map(|i| req(i, 2000, 200, i as f64 * 0.001))
        .collect();
    let limits = LevelLimits {
        request_timeout_s: 5.0,
        stop_when_missed: None,
    };
    let out = simulate(&c, &reqs, limits);
    let timeouts = out.records.iter().filter(|r| !r.ok()).count();
    assert!(timeouts > 100, "{timeouts} timeouts");
    assert!(out.end_s <= 0.2 + 5.0 + 1e-9);
    for r in out.records.iter().filter(|r| !r.ok()) {
        assert_eq!(r.e2e_s, 5.0);
    }
}

fn workload(kind: WorkloadKind, input: usize, output: usize) -> WorkloadConfig {
    WorkloadConfig {
        kind,
        input_len: Some(input),
        output_len: Some(output),
        max_input_len: 4 * input,
        max_output_len: 4 * output,
        ..WorkloadConfig::fixed(input, output, PromptStyle::Words)
    }
}

fn bounds(secs: u64) -> Bounds {
    Bounds {
        duration: Duration::from_secs(secs),
        max_requests: 100_000,
        request_timeout: Duration::from_secs(60),
    }
}

const SLO: Slo = Slo {
    ttft_ms: 500.0,
    tpot_ms: 50.0,
};

#[test]
fn a_seeded_level_gives_identical_results_run_to_run() {
    let c = cluster(
        Topology::Disaggregated {
            prefill: 2,
            decode: 3,
        },
        standard(),
    );
    let w = workload(WorkloadKind::Sharegpt, 200, 60);
    let shape = LoadShape::Open {
        rate_rps: 20.0,
        burstiness: 0.5,
    };
    let run = || {
        let l = simulate_level(&c, &w, shape, &bounds(10), &SLO, 7, false).expect("runs");
        serde_json::to_string(&l.report).expect("serializes")
    };
    let first = run();
    assert_eq!(first, run());
    let other = simulate_level(&c, &w, shape, &bounds(10), &SLO, 8, false).expect("runs");
    assert_ne!(
        first,
        serde_json::to_string(&other.report).expect("serializes")
    );
}

#[test]
fn shared_prefixes_hit_the_prefill_nodes_cache() {
    let c = cluster(
        Topology::Disaggregated {
            prefill: 2,
            decode: 2,
        },
        standard(),
    );
    let w = WorkloadConfig {
        prefixes: 2,
        users: 4,
        prefix_len: 512,
        ..workload(WorkloadKind::SharedPrefix, 64, 8)
    };
    let shape = LoadShape::Open {
        rate_rps: 2.0,
        burstiness: 1.0,
    };
    let l = simulate_level(&c, &w, shape, &bounds(20), &SLO, 1, false).expect("runs");
    let mut ttft: Vec<f64> = l.report.requests.iter().filter_map(|r| r.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    // A cold 576-token prompt takes prefill_s(576); a hit computes only the last 64 or so.
    let cold = standard().prefill_s(576);
    assert!(
        ttft[ttft.len() / 2] < cold * 0.6,
        "median {} vs cold {cold}",
        ttft[ttft.len() / 2]
    );
}

fn plan_for(m: CostModel, w: WorkloadConfig) -> crate::plan::PlanReport {
    let config = PlanConfig {
        profile: m.name.clone(),
        cost: m,
        node: Default::default(),
        gateway: Default::default(),
        gpus: vec![6],
        workload: w,
        burstiness: 1.0,
        bounds: bounds(15),
        slo: Slo {
            ttft_ms: 1000.0,
            tpot_ms: 100.0,
        },
        seed: 3,
        precision: 0.05,
    };
    plan(&config).expect("plans")
}

#[test]
fn the_planner_gives_a_prefill_heavy_workload_more_prefill_nodes() {
    // Prefill costs 1 ms a token; decode steps are nearly free.
    let m = cost(
        Linear3 {
            a: 0.001,
            b: 1e-3,
            c: 0.0,
        },
        Linear3 {
            a: 0.001,
            b: 1e-5,
            c: 0.0,
        },
    );
    let heavy = plan_for(m.clone(), workload(WorkloadKind::Fixed, 400, 4));
    let row = &heavy.rows[0];
    let (p, d) = (row.prefill.expect("a split"), row.decode.expect("a split"));
    assert!(p > d, "prefill-heavy picked {p}:{d}");
    // Decode-heavy: long outputs with slow steps and short prompts.
    let m = cost(
        Linear3 {
            a: 0.001,
            b: 1e-5,
            c: 0.0,
        },
        Linear3 {
            a: 0.020,
            b: 1e-3,
            c: 0.0,
        },
    );
    let light = plan_for(m, workload(WorkloadKind::Fixed, 16, 200));
    let row = &light.rows[0];
    let (p, d) = (row.prefill.expect("a split"), row.decode.expect("a split"));
    assert!(p < d, "decode-heavy picked {p}:{d}");
    assert!(row.colocated_rps.is_some());
    assert_eq!(row.splits.len(), 5, "every split of 6 GPUs is searched");
    let md = light.markdown();
    assert!(md.contains(&format!("| 6 | {p}:{d} |")), "{md}");
}

#[test]
fn nodes_sharing_a_hosts_cores_slow_each_other_only_while_both_compute() {
    let m = standard();
    let mut c = cluster(Topology::Colocated { nodes: 2 }, m.clone());
    c.node.shared_host = Some(crate::cluster::SharedHost::new(2.0, 2.0, None));
    let input = 256;
    let w = m.prefill_s(input);
    // Alone on the host: the profile's time.
    let alone = &run(&c, &[req(0, input, 1, 0.0)])[0];
    assert!(close(alone.ttft_s.expect("a first token"), w));
    // Two prompts at once, one per node: 4 threads on 2 cores, both at half speed throughout.
    let both = run(&c, &[req(0, input, 1, 0.0), req(1, input, 1, 0.0)]);
    for r in &both {
        assert!(close(r.ttft_s.expect("first token"), 2.0 * w), "{both:?}");
    }
    // The second arrives halfway through the first: the first's other half runs at half speed
    // (done at 1.5 w); the second does half its work beside it, the rest alone (1.5 w after
    // its arrival).
    let staggered = run(&c, &[req(0, input, 1, 0.0), req(1, input, 1, w / 2.0)]);
    for r in &staggered {
        assert!(
            close(r.ttft_s.expect("first token"), 1.5 * w),
            "{staggered:?}"
        );
    }
    // Without the shared host, each node has its own hardware.
    c.node.shared_host = None;
    let apart = run(&c, &[req(0, input, 1, 0.0), req(1, input, 1, 0.0)]);
    assert!(apart.iter().all(|r| close(r.ttft_s.unwrap(), w)));
}

#[test]
fn a_decode_step_asks_the_shared_host_for_the_cores_calibration_measured() {
    let m = standard();
    let mut c = cluster(Topology::Colocated { nodes: 2 }, m.clone());
    let input = 256;
    let w = m.prefill_s(input);
    // Node 0 decodes a long answer throughout; node 1's prompt arrives once it decodes.
    let reqs = [req(0, 16, 2000, 0.0), req(1, input, 1, 1.0)];
    // (decode_step_cores, the prompt's stretch): 2 + d cores asked of 2.
    for (decode_cores, stretch) in [
        (None, 2.0),
        (Some(1.0), 1.5),
        (Some(0.0), 1.0),
        (Some(9.0), 2.0),
    ] {
        c.node.shared_host = Some(crate::cluster::SharedHost::new(2.0, 2.0, decode_cores));
        let out = run(&c, &reqs);
        let ttft = out[1].ttft_s.expect("a first token");
        assert!(
            close(ttft, stretch * w),
            "{decode_cores:?}: {ttft} against {}",
            stretch * w
        );
    }
    // Two decode steps share the host's read bandwidth, whatever cores they take: two
    // requests in lockstep, one per node, take twice one's time.
    c.node.shared_host = Some(crate::cluster::SharedHost::new(2.0, 2.0, Some(1.0)));
    let alone = run(&c, &[req(0, 16, 50, 0.0)])[0].e2e_s;
    let both = run(&c, &[req(0, 16, 50, 0.0), req(1, 16, 50, 0.0)]);
    for r in &both {
        assert!(close(r.e2e_s, 2.0 * alone), "{} against {alone}", r.e2e_s);
    }
}

#[test]
fn a_push_lengthens_its_prefill_step_by_the_profiles_price_per_byte() {
    let mut m = standard();
    // 1 µs per byte: a 256-token prompt's 0.262 MB adds 0.262 s.
    m.link.push_step_s_per_byte = 1e-6;
    let mut c = cluster(
        Topology::Disaggregated {
            prefill: 1,
            decode: 1,
        },
        m.clone(),
    );
    let input = 256;
    let with_push = m.prefill_s(input) + m.kv_bytes(input) * 1e-6;
    let alone = &run(&c, &[req(0, input, 1, 0.0)])[0];
    assert!(close(alone.ttft_s.expect("a first token"), with_push));
    // On a shared host too, where it then stretches like the rest of the step.
    c.node.shared_host = Some(crate::cluster::SharedHost::new(2.0, 2.0, None));
    let shared = &run(&c, &[req(0, input, 1, 0.0)])[0];
    assert!(close(shared.ttft_s.unwrap(), with_push));
    // Colocated nodes push nothing.
    let colocated = cluster(Topology::Colocated { nodes: 1 }, m.clone());
    let local = &run(&colocated, &[req(0, input, 1, 0.0)])[0];
    assert!(close(local.ttft_s.unwrap(), m.prefill_s(input)));
}
