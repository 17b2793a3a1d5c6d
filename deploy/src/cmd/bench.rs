//! `fission bench engine`: prefill and decode throughput of the local engine, in the same
//! workload shapes that `engine/benches/peers/` measures for transformers and llama.cpp.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::op_timing::{self, Op, OpTimes};
use engine::model::{parse_dtype, LoadedModel};
use engine::quantize::Quantize;
use serde_json::json;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill tokens/s and decode throughput of the engine.
    Engine(EngineBenchArgs),
    /// KV transfer GB/s and latency over QUIC and TCP against a raw TCP socket baseline.
    Kvtransfer(KvBenchArgs),
    /// The machine's ceilings for the engine: read bandwidth and the packed GEMM's GFLOP/s.
    Limits(super::bench_limits::LimitsArgs),
}

#[derive(Args, Debug)]
pub struct KvBenchArgs {
    /// Prompt lengths in tokens (SmolLM2-135M shape: 46,080 bytes of KV per token).
    #[arg(long, value_delimiter = ',', default_value = "128,1024,4096")]
    pub tokens: Vec<usize>,
    #[arg(long, default_value_t = 10)]
    pub repeats: usize,
}

#[derive(Args, Debug)]
pub struct EngineBenchArgs {
    #[arg(long)]
    pub model: String,
    #[arg(long)]
    pub dtype: Option<String>,
    /// none, or int8 (llama.cpp's Q8_0 layout, quantised at load).
    #[arg(long, default_value = "none")]
    pub quantize: Quantize,
    /// Where the model runs: cpu, or cuda[:N] (a binary built with `--features cuda`).
    #[arg(long, env = "FISSION_DEVICE", default_value = "cpu")]
    pub device: engine::device::DeviceSpec,
    /// The forward pass: auto, host, or tensor (the device-generic path, on the CPU too).
    #[arg(long = "path", env = "FISSION_PATH", default_value = "auto")]
    pub forward_path: engine::device::ForwardPath,
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    pub prefill: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub batch: Vec<usize>,
    /// Repeats per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Write the figures as JSON here (the schema the peer scripts use).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Also time each op of the forward pass, and print each figure's time per op as shares of
    /// its clock time (the JSON gains `op_times`, in ms): timers, where perf misattributes the
    /// inlined kernels.
    #[arg(long)]
    pub op_times: bool,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Engine(args) => engine_bench(args),
        BenchCommand::Kvtransfer(args) => kvtransfer_bench(args),
        BenchCommand::Limits(args) => super::bench_limits::run(args),
    }
}

/// Prompt ids shared with the peer scripts: `3 + ((i * 7919 + 13 + b * 104729) % (vocab - 3))`.
pub fn bench_prompt(len: usize, b: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (3 + ((i * 7919 + 13 + b * 104_729) % (vocab - 3))) as u32)
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn request(id: u64, prompt_ids: Vec<u32>, max_new_tokens: usize) -> Request {
    Request::greedy_fixed_length(SeqId(id), prompt_ids, max_new_tokens)
}

fn new_engine(
    model: &LoadedModel,
    num_blocks: usize,
    max_prefill: usize,
) -> anyhow::Result<Engine> {
    Ok(Engine::new(
        model.clone(),
        EngineConfig {
            num_kv_blocks: Some(num_blocks),
            max_batch_prefill_tokens: max_prefill,
            max_prefill_chunk_tokens: max_prefill,
            // Every run must compute its prompt: a prefix hit would flatter the figures.
            enable_prefix_caching: false,
            // A fresh engine's first use of each block would page-fault inside the measured
            // steps; a serving node has touched its blocks long before (and llama.cpp clears
            // its whole cache when it creates it).
            prefault_kv: true,
            ..Default::default()
        },
    )?)
}

/// One measured run: its throughput, its clock time and the time its ops took (with `--op-times`).
struct Run {
    tok_s: f64,
    elapsed: Duration,
    ops: OpTimes,
}

impl Run {
    fn measure(tokens: impl FnOnce() -> anyhow::Result<usize>) -> anyhow::Result<Run> {
        let (t, before) = (Instant::now(), op_timing::snapshot());
        let tokens = tokens()?;
        let (elapsed, ops) = (t.elapsed(), op_timing::snapshot().since(&before));
        Ok(Run {
            tok_s: tokens as f64 / elapsed.as_secs_f64(),
            elapsed,
            ops,
        })
    }
}

/// Prefill tokens/s for one prompt of `len` tokens (time to the first token).
fn prefill_once(model: &LoadedModel, len: usize) -> anyhow::Result<Run> {
    let vocab = model.config().vocab_size;
    let mut e = new_engine(model, len.div_ceil(16) + 2, len.max(16))?;
    e.add_request(request(0, bench_prompt(len, 0, vocab), 1))?;
    Run::measure(|| {
        while e.has_work() {
            e.step()?;
        }
        Ok(len)
    })
}

/// Decode-only tokens/s for `batch` sequences of 32-token prompts generating `new_tokens`
/// each: the clock starts once every sequence has its first token.
fn decode_once(model: &LoadedModel, batch: usize, new_tokens: usize) -> anyhow::Result<Run> {
    let vocab = model.config().vocab_size;
    let blocks = batch * (32 + new_tokens).div_ceil(16) + 2;
    let mut e = new_engine(model, blocks, 32 * batch)?;
    for b in 0..batch {
        e.add_request(request(b as u64, bench_prompt(32, b, vocab), new_tokens))?;
    }
    let mut first = 0;
    while first < batch {
        first += e.step()?.iter().filter(|ev| ev.index == 0).count();
    }
    Run::measure(|| {
        let mut tokens = 0usize;
        while e.has_work() {
            tokens += e.step()?.len();
        }
        Ok(tokens)
    })
}

/// The median throughput of `runs`, and with `--op-times` their summed time per op, printed as
/// shares of their clock time and added to `op_times` under `name`.
fn figure(
    name: &str,
    runs: Vec<Run>,
    show: bool,
    op_times: &mut serde_json::Map<String, serde_json::Value>,
) -> f64 {
    if show {
        let total: Duration = runs.iter().map(|r| r.elapsed).sum();
        let mut ms = serde_json::Map::new();
        let mut line = format!("op times {name} ({:.1} ms):", total.as_secs_f64() * 1e3);
        for op in Op::ALL {
            let t: Duration = runs.iter().map(|r| r.ops.get(op)).sum();
            line += &format!(
                " {} {:.1}%",
                op.name(),
                100.0 * t.as_secs_f64() / total.as_secs_f64()
            );
            ms.insert(op.name().into(), json!(t.as_secs_f64() * 1e3));
        }
        ms.insert("clock".into(), json!(total.as_secs_f64() * 1e3));
        eprintln!("{line}");
        op_times.insert(name.into(), ms.into());
    }
    median(runs.iter().map(|r| r.tok_s).collect())
}

fn engine_bench(args: EngineBenchArgs) -> anyhow::Result<()> {
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    args.device.open()?;
    let model = engine::device::load_model(
        &ModelSource::parse(&args.model),
        dtype,
        args.quantize,
        args.device,
        args.forward_path,
    )
    .with_context(|| format!("loading {}", args.model))?;
    let max_ctx = model.config().max_context;
    let repeats = args.repeats.max(1);
    // Warm-up: first-touch page faults and thread-pool start-up are not throughput.
    prefill_once(&model, 32.min(max_ctx - 1))?;
    op_timing::enable(args.op_times);
    let mut op_times = serde_json::Map::new();

    let mut prefill = serde_json::Map::new();
    for &len in &args.prefill {
        if len + 1 > max_ctx {
            eprintln!("prefill {len}: skipped (model context is {max_ctx})");
            continue;
        }
        let runs = (0..repeats)
            .map(|_| prefill_once(&model, len))
            .collect::<anyhow::Result<_>>()?;
        let tps = figure(
            &format!("prefill {len}"),
            runs,
            args.op_times,
            &mut op_times,
        );
        eprintln!("prefill {len:>5} tokens: {tps:>9.1} tok/s");
        prefill.insert(len.to_string(), json!(tps));
    }
    let runs = (0..repeats)
        .map(|_| decode_once(&model, 1, 128))
        .collect::<anyhow::Result<_>>()?;
    let single = figure("single stream", runs, args.op_times, &mut op_times);
    eprintln!("decode single stream (32 prompt, 128 new): {single:>9.1} tok/s");
    let mut batched = serde_json::Map::new();
    for &b in &args.batch {
        let runs = (0..repeats)
            .map(|_| decode_once(&model, b, 64))
            .collect::<anyhow::Result<_>>()?;
        let tps = figure(&format!("batch {b}"), runs, args.op_times, &mut op_times);
        eprintln!("decode batch {b:>3} (32 prompt, 64 new each): {tps:>9.1} tok/s");
        batched.insert(b.to_string(), json!(tps));
    }
    let name = std::path::Path::new(&args.model)
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| args.model.clone());
    let mut report = json!({
        "engine": "fission",
        "model": name,
        "quantize": args.quantize.to_string(),
        "prefill_tok_s": prefill,
        "decode_single_tok_s": single,
        "decode_batch_tok_s": batched,
        "kernel_isa": kernels::kernel_isa(),
        "notes": format!("median of {repeats}; {} threads", kernels::pool_threads()),
    });
    if args.op_times {
        report["op_times"] = op_times.into();
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(out) = args.out {
        std::fs::write(&out, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

fn kvtransfer_bench(args: KvBenchArgs) -> anyhow::Result<()> {
    let cfg = kv_bench::BenchConfig {
        prompt_tokens: args.tokens,
        repetitions: args.repeats.max(1),
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(kv_bench::run_bench(cfg))?;
    println!("{report}");
    Ok(())
}
