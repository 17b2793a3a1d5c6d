//! `fission-loadtest simulate`: the binary's flags for the simulator (the `simulator` crate), and
//! the glue from them to the library. A module of the binary, not of the library.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use loadgen::config::parse_duration;
use loadgen::sweep::SweepSpec;
use loadgen::{Api, Bounds, LoadConfig, LoadPlan, LoadShape, Slo, Target};
use simulator::calibrate::{self, MeasureGrid};
use simulator::cluster::{GatewaySettings, NodeSettings, SharedHost};
use simulator::cost::{Link, NodeSpec};
use simulator::link_probe::{LinkProbe, LinkTransport};
use simulator::node_probe::{NodeEndpoint, NodeProbe};
use simulator::{plan, CostModel, PlanConfig, PolicyKind, SimCluster, Topology};

use crate::WorkloadArgs;

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct SimulateArgs {
    #[command(subcommand)]
    action: Option<SimAction>,
    #[command(flatten)]
    run: SimRunArgs,
}

#[derive(Subcommand)]
enum SimAction {
    /// Recommend the P:D split for each GPU count and compare it with colocated serving.
    Plan(PlanArgs),
    /// Fit a cost profile to the engine's step times (measured here, or from
    /// `fission bench engine --out FILE`).
    Calibrate(CalibrateArgs),
}

/// What every simulation takes: the profile, the nodes' and gateway's settings, the workload,
/// the SLO and the level bounds.
#[derive(Args)]
struct SimCommon {
    /// A built-in profile (h100-llama8b) or a profile JSON file (see `simulate calibrate`).
    #[arg(long, env = "LOADTEST_PROFILE", default_value = "h100-llama8b")]
    profile: String,
    /// The gateway's routing policy.
    #[arg(long, value_enum, default_value_t = GatewaySettings::default().routing)]
    routing: PolicyKind,
    /// Disaggregated clusters: prompts shorter than this are prefilled on the decode node.
    #[arg(long, default_value_t = GatewaySettings::default().max_local_prefill_tokens)]
    max_local_prefill_tokens: usize,
    /// Requests on the nodes at once (the gateway's --max-concurrent-requests); no limit by
    /// default.
    #[arg(long)]
    max_concurrent_requests: Option<usize>,
    /// Longest prompt + output the gateway accepts; longer requests fail with 422.
    #[arg(long, default_value_t = GatewaySettings::default().max_total_tokens)]
    max_total_tokens: usize,
    /// KV blocks per node (the nodes' --num-kv-blocks); the profile's by default.
    #[arg(long)]
    kv_blocks: Option<usize>,
    #[arg(long, default_value_t = NodeSettings::default().max_batch_prefill_tokens)]
    max_batch_prefill_tokens: usize,
    #[arg(long, default_value_t = NodeSettings::default().max_num_seqs)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = NodeSettings::default().max_prefill_chunk_tokens)]
    max_prefill_chunk_tokens: usize,
    #[arg(long)]
    disable_prefix_caching: bool,
    /// Push the KV after the whole prefill instead of layer by layer as it is computed.
    #[arg(long)]
    push_after_prefill: bool,
    /// All nodes share one machine with this many cores (a test cluster on one host): a step
    /// is stretched while other nodes compute. The profile must be fitted with
    /// `--threads-per-node` threads.
    #[arg(long)]
    shared_host_cores: Option<f64>,
    /// With `--shared-host-cores`: the threads each node's steps use (the cores by default).
    #[arg(long, requires = "shared_host_cores")]
    threads_per_node: Option<f64>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[arg(long, default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    #[arg(long, default_value_t = 200.0)]
    slo_tpot_ms: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Gamma shape of inter-arrival times: 1 is Poisson, below 1 burstier.
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Simulated time each level sends requests for.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    duration: Duration,
    #[arg(long, default_value_t = 1_000_000)]
    max_requests: usize,
    /// A request unanswered this long after it was sent counts as a timeout.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    request_timeout: Duration,
    /// Write the report as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write SVG plots into this directory.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Args)]
struct SimRunArgs {
    /// The cluster: `2P+6D` (prefill + decode nodes) or `8C` (colocated nodes).
    #[arg(long)]
    cluster: Option<Topology>,
    /// Open-loop requests per second.
    #[arg(long, conflicts_with = "sweep")]
    rate: Option<f64>,
    /// Rates to sweep for the goodput: `0.5,1,2,4` or `start:factor:max`.
    #[arg(long)]
    sweep: Option<SweepSpec>,
    #[arg(long, default_value_t = 0)]
    bisect: usize,
    #[command(flatten)]
    common: SimCommon,
}

#[derive(Args)]
struct PlanArgs {
    /// GPU counts: `8..64` (doubling: 8, 16, 32, 64), `8..64:8` (step 8) or `8,24,64`.
    #[arg(long, default_value = "8..64")]
    gpus: String,
    /// Each goodput is bisected to within this fraction.
    #[arg(long, default_value_t = 0.05)]
    precision: f64,
    #[command(flatten)]
    common: SimCommon,
}

#[derive(Args)]
struct CalibrateArgs {
    /// The model directory (its config.json gives the shape; the engine runs it unless
    /// --bench-json is given).
    #[arg(long)]
    model: String,
    /// Fit to this `fission bench engine --out FILE` JSON instead of measuring.
    #[arg(long)]
    bench_json: Option<PathBuf>,
    /// f32 (the CPU default), bf16 or f16.
    #[arg(long)]
    dtype: Option<String>,
    #[arg(long, value_delimiter = ',', default_value = "32,128,256,512,1024")]
    prefill: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    batch: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    context: Vec<usize>,
    /// Decode steps timed per (batch, context); the median is kept.
    #[arg(long, default_value_t = 8)]
    steps: usize,
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Mixed steps, timed to check the profile on them (not fitted): a prompt of each of
    /// these lengths computed together with each `--mixed-batch` of decodes.
    #[arg(long, value_delimiter = ',', default_value = "32,128,512")]
    mixed_prompt: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "2,8")]
    mixed_batch: Vec<usize>,
    /// Each mixed step's decodes run over this many prompt tokens (and 2 generated).
    #[arg(long, default_value_t = 128)]
    mixed_context: usize,
    /// KV blocks per node: match the nodes' --num-kv-blocks.
    #[arg(long, default_value_t = 2048)]
    kv_blocks: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Measure the KV link with the nodes' transport: its bandwidth, and how much a push
    /// lengthens the prefill step beside it (`--prefill` lengths up to 512, timed alone and
    /// beside their push), instead of taking --link-bandwidth-bytes-per-s.
    #[arg(long, value_enum, conflicts_with = "bench_json")]
    measure_link: Option<LinkTransport>,
    /// The KV link (measure it with `fission bench kvtransfer`, or --measure-link).
    #[arg(long, default_value_t = 1e9, conflicts_with = "measure_link")]
    link_bandwidth_bytes_per_s: f64,
    #[arg(long, default_value_t = 1e-4)]
    link_latency_s: f64,
    /// Also time the steps of a running one-node colocated cluster (its gateway URL) against
    /// the engine's, and scale the fits to the node's (`--node-metrics`: that node's metrics URL).
    #[arg(long, requires = "node_metrics", conflicts_with = "bench_json")]
    node_gateway: Option<String>,
    #[arg(long, requires = "node_gateway")]
    node_metrics: Option<String>,
    /// With --node-gateway: a running 1P+1D cluster's gateway URL, whose prefill node's step
    /// (`--prefill-metrics`) prices the push instead of --measure-link's loopback figure.
    #[arg(long, requires_all = ["node_gateway", "prefill_metrics"])]
    prefill_gateway: Option<String>,
    #[arg(long, requires = "prefill_gateway")]
    prefill_metrics: Option<String>,
    /// Rounds of node against engine, alternating; the medians are kept.
    #[arg(long, default_value_t = 3)]
    node_rounds: usize,
    /// The prompt of the node's requests (tokens), and the new tokens of its decode request
    /// (twice as many for each of the batch the 1P+1D prefill step is timed beside).
    #[arg(long, default_value_t = 128)]
    node_prompt: usize,
    #[arg(long, default_value_t = 64)]
    node_new_tokens: usize,
    #[arg(long, default_value = "calibrated")]
    name: String,
    /// Write the profile here (JSON); it is printed either way.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub(crate) fn run(args: SimulateArgs, first_extra_id: usize, vocab: usize) -> anyhow::Result<()> {
    match args.action {
        None => simulate(args.run, first_extra_id, vocab),
        Some(SimAction::Plan(p)) => run_plan(p, first_extra_id, vocab),
        Some(SimAction::Calibrate(c)) => run_calibrate(c, first_extra_id, vocab),
    }
}

impl SimCommon {
    fn cluster(&self, topology: Topology) -> anyhow::Result<SimCluster> {
        let mut cost = CostModel::load(&self.profile)?;
        if self.push_after_prefill {
            cost.link.layerwise = false;
        }
        let mut c = SimCluster::new(topology, cost);
        c.node.kv_blocks = self.kv_blocks;
        c.node.max_batch_prefill_tokens = self.max_batch_prefill_tokens;
        c.node.max_num_seqs = self.max_num_seqs;
        c.node.max_prefill_chunk_tokens = self.max_prefill_chunk_tokens;
        c.node.enable_prefix_caching = !self.disable_prefix_caching;
        let decode_step_cores = c.cost.decode_step_cores;
        c.node.shared_host = self.shared_host_cores.map(|cores| {
            SharedHost::new(
                cores,
                self.threads_per_node.unwrap_or(cores),
                decode_step_cores,
            )
        });
        c.gateway.routing = self.routing;
        c.gateway.max_local_prefill_tokens = self.max_local_prefill_tokens;
        c.gateway.max_concurrent_requests = self.max_concurrent_requests;
        c.gateway.max_total_tokens = self.max_total_tokens;
        Ok(c)
    }

    fn bounds(&self) -> Bounds {
        Bounds {
            duration: self.duration,
            max_requests: self.max_requests,
            request_timeout: self.request_timeout,
        }
    }

    fn slo(&self) -> Slo {
        Slo {
            ttft_ms: self.slo_ttft_ms,
            tpot_ms: self.slo_tpot_ms,
        }
    }
}

fn simulate(a: SimRunArgs, first_extra_id: usize, vocab: usize) -> anyhow::Result<()> {
    let c = &a.common;
    let topology = a
        .cluster
        .context("give --cluster (2P+6D or 8C), or a subcommand: plan, calibrate")?;
    let cluster = c.cluster(topology)?;
    let plan = match (a.rate, a.sweep) {
        (Some(rate_rps), None) => LoadPlan::Single(LoadShape::Open {
            rate_rps,
            burstiness: c.burstiness,
        }),
        (None, Some(rates)) => LoadPlan::Sweep {
            rates,
            burstiness: c.burstiness,
            bisect_steps: a.bisect,
        },
        _ => anyhow::bail!("give one of --rate R or --sweep RATES"),
    };
    let config = LoadConfig {
        target: Target {
            base_url: format!("simulated:{topology}"),
            api: Api::OpenaiCompletions,
            model: None,
            api_key: None,
        },
        plan,
        workload: c.workload.config(first_extra_id, vocab),
        bounds: c.bounds(),
        slo: c.slo(),
        seed: c.seed,
        warmup_requests: 0,
        json_path: c.json.clone(),
        plot_dir: c.plot.clone(),
        quiet: true,
    };
    let (report, cost) = simulator::simulate_run(&cluster, &config)?;
    print!("{}", report.markdown());
    eprintln!(
        "simulated {} level(s), {} requests, {} steps in {:.2} s",
        cost.levels, cost.requests, cost.steps, cost.elapsed_s
    );
    Ok(())
}

/// `8..64` doubles, `8..64:8` steps, `8,24,64` lists.
fn parse_gpus(s: &str) -> anyhow::Result<Vec<usize>> {
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .with_context(|| format!("`{x}` in --gpus {s} is not a GPU count"))
    };
    let v = if let Some((lo, rest)) = s.split_once("..") {
        let (hi, step) = match rest.split_once(':') {
            Some((hi, step)) => (num(hi)?, Some(num(step)?)),
            None => (num(rest)?, None),
        };
        let mut v = Vec::new();
        let mut n = num(lo)?;
        anyhow::ensure!(n >= 2 && n <= hi, "--gpus {s}: need 2 <= from <= to");
        while n <= hi && v.len() < 64 {
            v.push(n);
            n = match step {
                Some(k) if k > 0 => n + k,
                Some(_) => anyhow::bail!("--gpus {s}: the step must be above 0"),
                None => n * 2,
            };
        }
        v
    } else {
        s.split(',').map(num).collect::<anyhow::Result<Vec<_>>>()?
    };
    anyhow::ensure!(!v.is_empty(), "--gpus {s} names no GPU count");
    Ok(v)
}

fn run_plan(a: PlanArgs, first_extra_id: usize, vocab: usize) -> anyhow::Result<()> {
    let c = &a.common;
    // Any topology: only the settings are taken from it.
    let base = c.cluster(Topology::Colocated { nodes: 1 })?;
    let config = PlanConfig {
        profile: base.profile.clone(),
        cost: base.cost.clone(),
        node: base.node.clone(),
        gateway: base.gateway.clone(),
        gpus: parse_gpus(&a.gpus)?,
        workload: c.workload.config(first_extra_id, vocab),
        burstiness: c.burstiness,
        bounds: c.bounds(),
        slo: c.slo(),
        seed: c.seed,
        precision: a.precision,
    };
    let report = plan(&config)?;
    print!("{}", report.markdown());
    if let Some(path) = &c.json {
        report.write_json(path)?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &c.plot {
        report.write_plots(dir)?;
        eprintln!("wrote plots to {}", dir.display());
    }
    Ok(())
}

fn run_calibrate(a: CalibrateArgs, first_extra_id: usize, vocab: usize) -> anyhow::Result<()> {
    let dtype_bytes = match a.dtype.as_deref() {
        None | Some("f32") => 4,
        Some("bf16" | "f16") => 2,
        Some(other) => anyhow::bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    let shape = calibrate::model_shape(&a.model, dtype_bytes)?;
    let model = if a.bench_json.is_none() {
        let dtype = a
            .dtype
            .as_deref()
            .map(engine::model::parse_dtype)
            .transpose()?;
        Some(
            engine::model::LoadedModel::load(
                &engine::loader::ModelSource::parse(&a.model),
                dtype,
                &candle_core::Device::Cpu,
            )
            .with_context(|| format!("loading {}", a.model))?,
        )
    } else {
        None
    };
    let (measurements, origin) = match &a.bench_json {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            (
                calibrate::from_bench_json(&text)?,
                format!("`fission bench engine` output {}", path.display()),
            )
        }
        None => {
            let model = model.as_ref().expect("loaded without --bench-json");
            let grid = MeasureGrid {
                prefill_tokens: a.prefill.clone(),
                batches: a.batch.clone(),
                contexts: a.context.clone(),
                steps: a.steps,
                repeats: a.repeats,
                mixed_prompts: a.mixed_prompt.clone(),
                mixed_batches: a.mixed_batch.clone(),
                mixed_context: a.mixed_context,
            };
            eprintln!("timing the engine's steps on {} ...", a.model);
            (
                calibrate::measure(model, &grid)?,
                format!("engine steps of {} timed by `simulate calibrate`", a.model),
            )
        }
    };
    let (link, link_source) = match (a.measure_link, &model) {
        (Some(transport), Some(model)) => {
            eprintln!("pushing KV over loopback ({transport:?}), and beside prefill steps ...");
            let probe = LinkProbe {
                model,
                shape: &shape,
                block_size: a.block_size,
                transport,
                latency_s: a.link_latency_s,
                step_tokens: a.prefill.iter().copied().filter(|&n| n <= 512).collect(),
                repeats: a.repeats.max(5),
            };
            let measured = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(probe.run())
            })?;
            eprint!("{}", measured.report);
            let source = format!(
                "measured by `simulate calibrate --measure-link {}` over loopback, both ends on this host: bandwidth by kvtransfer's bench; push_step_s_per_byte as the prefill steps' slowdown beside their push; latency given (--link-latency-s)",
                format!("{transport:?}").to_lowercase()
            );
            (measured.link, Some(source))
        }
        _ => (
            Link {
                bandwidth_bytes_per_s: a.link_bandwidth_bytes_per_s,
                latency_s: a.link_latency_s,
                layerwise: true,
                push_step_s_per_byte: 0.0,
            },
            None,
        ),
    };
    let node = NodeSpec {
        kv_blocks: a.kv_blocks,
        block_size: a.block_size,
    };
    let node_factors = match (&a.node_gateway, &a.node_metrics, &model) {
        (Some(gateway), Some(metrics), Some(model)) => {
            eprintln!("timing a node's steps against the engine's ...");
            let probe = NodeProbe {
                model,
                colocated: NodeEndpoint {
                    gateway: gateway.clone(),
                    metrics: metrics.clone(),
                },
                disaggregated: a
                    .prefill_gateway
                    .clone()
                    .zip(a.prefill_metrics.clone())
                    .map(|(gateway, metrics)| NodeEndpoint { gateway, metrics }),
                prompt_tokens: a.node_prompt,
                new_tokens: a.node_new_tokens,
                rounds: a.node_rounds,
                beside_new_tokens: 2 * a.node_new_tokens,
                prompt_kv_bytes: (shape.kv_bytes_per_token()
                    * a.node_prompt.div_ceil(a.block_size) as u64
                    * a.block_size as u64) as f64,
                first_extra_id,
                vocab,
            };
            let factors = tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(probe.run())
            })?;
            eprint!("{}", factors.report);
            eprintln!(
                "node / engine: prefill {:.3}, decode {:.3}; push {}; a decode step takes {} cores",
                factors.prefill,
                factors.decode,
                factors
                    .push_step_s_per_byte
                    .map_or("not measured".into(), |p| format!("{:.2} ns/B", p * 1e9)),
                factors
                    .decode_step_cores
                    .map_or("(not measured)".into(), |c| format!("{c:.2}"))
            );
            Some(factors)
        }
        _ => None,
    };
    let mut cal = calibrate::calibrate(&a.name, shape, measurements, link, node, &origin)?;
    if let Some(source) = link_source {
        cal.profile.sources.insert("link".into(), source);
    }
    if let Some(f) = &node_factors {
        f.apply(&mut cal.profile);
        cal.profile.sources.insert(
            "node".into(),
            format!(
                "the fits scaled by a node's steps over the engine's, timed alternately through running clusters by `simulate calibrate --node-gateway` (prompt {} tokens, {} rounds, medians): prefill x{:.3}, decode x{:.3}{}{}",
                a.node_prompt,
                a.node_rounds,
                f.prefill,
                f.decode,
                f.push_step_s_per_byte.map_or(String::new(), |p| format!(
                    "; link.push_step_s_per_byte from the 1P+1D prefill node's step over the colocated node's: {:.2} ns/B",
                    p * 1e9
                )),
                f.decode_step_cores.map_or(String::new(), |c| format!(
                    "; decode_step_cores from the 1P+1D prefill node's step beside the colocated node decoding a batch over its step alone: {c:.2}"
                ))
            ),
        );
    }
    eprintln!(
        "prefill fit: t = {:.3e} + {:.3e} * tokens + {:.3e} * tokens^2/1e6 s (rms error {:.1}%)",
        cal.prefill_fit.coef.a,
        cal.prefill_fit.coef.b,
        cal.prefill_fit.coef.c,
        cal.prefill_fit.rms_rel_error * 100.0
    );
    eprintln!(
        "decode fit:  t = {:.3e} + {:.3e} * batch + {:.3e} * context_tokens s (rms error {:.1}%)",
        cal.decode_fit.coef.a,
        cal.decode_fit.coef.b,
        cal.decode_fit.coef.c,
        cal.decode_fit.rms_rel_error * 100.0
    );
    if let Some(mixed) = cal.mixed_rms_rel_error {
        eprintln!(
            "mixed steps ({} timed, not fitted): rms error {:.1}%",
            cal.measurements.mixed.len(),
            mixed * 100.0
        );
        for m in &cal.measurements.mixed {
            eprintln!(
                "  prompt {:>4} + {:>2} decodes over {:>4} tokens: {:>7.2} ms measured",
                m.0,
                m.1,
                m.2,
                m.3 * 1e3
            );
        }
    }
    let json = cal.profile.to_json();
    print!("{json}");
    if let Some(out) = &a.out {
        std::fs::write(out, &json).with_context(|| format!("writing {}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_counts_parse_as_doublings_steps_and_lists() {
        assert_eq!(parse_gpus("8..64").expect("valid"), vec![8, 16, 32, 64]);
        assert_eq!(parse_gpus("8..32:8").expect("valid"), vec![8, 16, 24, 32]);
        assert_eq!(parse_gpus("8,24").expect("valid"), vec![8, 24]);
        assert!(parse_gpus("1..8").is_err());
        assert!(parse_gpus("8..4").is_err());
        assert!(parse_gpus("eight").is_err());
    }
}
