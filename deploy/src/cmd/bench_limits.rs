//! `fission bench limits`: the machine's own ceilings, measured in the same run as the engine
//! figures they bound. Batch-1 decode reads every weight once per token, so its ceiling is
//! weight bytes ÷ read bandwidth; batched decode and prefill are multiply-adds, so theirs is
//! FLOPs ÷ the best GEMM this build has, on the model's own shapes. Above both sits the
//! hardware's: the FMA throughput of the instruction set the kernels run, with no memory at all.

use std::time::Instant;

use clap::Args;
use serde_json::json;

#[derive(Args, Debug)]
pub struct LimitsArgs {
    /// Bytes of the buffer the read benchmark streams (far above the last-level cache).
    #[arg(long, default_value_t = 1 << 30)]
    pub read_bytes: usize,
    /// Passes per figure; the best is reported (a ceiling, not a typical run).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Rounds of the FMA-peak loop per pass (12 vector FMAs each, per thread).
const FMA_ROUNDS: usize = 100_000_000;

/// SmolLM2-135M's projections as `(k inputs, n outputs)`: fused QKV, o_proj, fused gate/up,
/// down and the lm_head.
const SHAPES: [(usize, usize); 5] = [
    (576, 960),
    (576, 576),
    (576, 3072),
    (1536, 576),
    (576, 49152),
];

pub fn run(args: LimitsArgs) -> anyhow::Result<()> {
    let repeats = args.repeats.max(1);
    let read = read_gb_s(args.read_bytes, repeats);
    eprintln!(
        "read bandwidth ({} MiB, {} threads): {read:.1} GB/s",
        args.read_bytes >> 20,
        kernels::pool_threads()
    );
    // About a quarter of a second of multiply-adds per pass, the best of `repeats`.
    let fma = (0..repeats)
        .map(|_| kernels::fma_peak_gflops(FMA_ROUNDS))
        .fold(0f64, f64::max);
    eprintln!("FMA peak (registers only): {fma:.1} GFLOP/s");
    let mut gemm = serde_json::Map::new();
    let mut peak = 0f64;
    for m in [32usize, 64, 512] {
        let mut row = serde_json::Map::new();
        for (k, n) in SHAPES {
            let g = gemm_gflops(m, k, n, repeats)?;
            peak = peak.max(g);
            row.insert(format!("{k}x{n}"), json!(g));
            eprintln!("packed GEMM m={m:>3} {k:>5}x{n:<6}: {g:>7.1} GFLOP/s");
        }
        gemm.insert(m.to_string(), serde_json::Value::Object(row));
    }
    // The same GEMM over a whole decode step's distinct weights, as a step meets them: every
    // layer's panels come from memory, not from the caches a repeated product keeps warm.
    let mut step = serde_json::Map::new();
    for m in [32usize, 64] {
        let g = step_gflops(m, repeats)?;
        step.insert(m.to_string(), json!(g));
        eprintln!("packed GEMM m={m:>3} one step's {LAYERS} layers + lm_head: {g:>7.1} GFLOP/s");
    }
    // The int8 GEMM (`--quantize int8`): at m=1 bound by its weight bytes, above by int8 dots.
    let mut gemm_int8 = serde_json::Map::new();
    for m in [1usize, 32, 512] {
        let mut row = serde_json::Map::new();
        for (k, n) in SHAPES {
            let g = gemm_gflops_of(m, k, n, repeats, kernels::WeightDtype::Int8)?;
            row.insert(format!("{k}x{n}"), json!(g));
            eprintln!("int8 GEMM   m={m:>3} {k:>5}x{n:<6}: {g:>7.1} GOP/s");
        }
        gemm_int8.insert(m.to_string(), serde_json::Value::Object(row));
    }
    let report = json!({
        "read_gb_s": read,
        "gemm_gflops": gemm,
        "fma_peak_gflops": fma,
        "gemm_peak_gflops": peak,
        "gemm_step_gflops": step,
        "gemm_int8_gops": gemm_int8,
        "threads": kernels::pool_threads(),
        "kernel_isa": kernels::kernel_isa(),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if let Some(out) = args.out {
        std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}

/// STREAM-like read: every kernel thread sums its own contiguous share of the buffer. Integer
/// adds, so the compiler may vectorise them freely and the loop is bound by memory alone.
fn read_gb_s(bytes: usize, repeats: usize) -> f64 {
    let words = (bytes / 8).max(1);
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = kernels::pool_threads();
    let per = words.div_ceil(threads);
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..threads)
        .map(|_| std::sync::atomic::AtomicU64::new(0))
        .collect();
    let mut best = 0f64;
    for _ in 0..repeats {
        let t = Instant::now();
        kernels::parallel_for(threads, &|i| {
            let part = &buf[(i * per).min(words)..((i + 1) * per).min(words)];
            let s = part.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            sums[i].fetch_add(s, std::sync::atomic::Ordering::Relaxed);
        });
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    // The sums are used, so the reads cannot be optimised away.
    let total = sums.iter().fold(0u64, |a, s| {
        a.wrapping_add(s.load(std::sync::atomic::Ordering::Relaxed))
    });
    std::hint::black_box(total);
    best
}

/// SmolLM2-135M's layer count.
const LAYERS: usize = 30;

/// The packed GEMM's best GFLOP/s over one decode step's products at batch `m`: the four
/// projections of each of [`LAYERS`] layers, each with weights of its own, then the lm_head.
fn step_gflops(m: usize, repeats: usize) -> anyhow::Result<f64> {
    let (layer, head) = SHAPES.split_at(SHAPES.len() - 1);
    let mut weights = Vec::new();
    for l in 0..LAYERS {
        for &(k, n) in layer {
            weights.push(seeded_weight(k, n, l)?);
        }
    }
    weights.push(seeded_weight(head[0].0, head[0].1, LAYERS)?);
    let kmax = SHAPES.iter().map(|s| s.0).max().unwrap_or(0);
    let nmax = SHAPES.iter().map(|s| s.1).max().unwrap_or(0);
    let x: Vec<f32> = (0..m * kmax)
        .map(|i| ((i % 89) as f32 - 44.0) / 89.0)
        .collect();
    let mut out = vec![0f32; m * nmax];
    let flops: f64 = weights
        .iter()
        .map(|w| 2.0 * (m * w.k() * w.n()) as f64)
        .sum();
    let mut best = 0f64;
    for _ in 0..repeats + 1 {
        let t = Instant::now();
        for w in &weights {
            kernels::packed_matmul(&x[..m * w.k()], m, w, &mut out[..m * w.n()])?;
        }
        best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&out);
    Ok(best)
}

fn seeded_weight(k: usize, n: usize, seed: usize) -> anyhow::Result<kernels::PackedWeight> {
    let w: Vec<f32> = (0..k * n)
        .map(|i| (((i + seed) % 97) as f32 - 48.0) / 97.0)
        .collect();
    Ok(kernels::PackedWeight::from_in_out(&w, k, n)?)
}

/// The packed GEMM's best GFLOP/s for `[m, k] @ [k, n]`.
fn gemm_gflops(m: usize, k: usize, n: usize, repeats: usize) -> anyhow::Result<f64> {
    gemm_gflops_of(m, k, n, repeats, kernels::WeightDtype::F32)
}

/// [`gemm_gflops`] for f32 or int8 weights (bf16 is not measured here).
fn gemm_gflops_of(
    m: usize,
    k: usize,
    n: usize,
    repeats: usize,
    dtype: kernels::WeightDtype,
) -> anyhow::Result<f64> {
    let w: Vec<f32> = (0..k * n)
        .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
        .collect();
    let w = match dtype {
        kernels::WeightDtype::Int8 => kernels::PackedWeight::from_out_in_int8(&w, n, k)?,
        _ => kernels::PackedWeight::from_in_out(&w, k, n)?,
    };
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i % 89) as f32 - 44.0) / 89.0)
        .collect();
    let mut out = vec![0f32; m * n];
    // Enough calls for about ten milliseconds a pass, after one warm-up.
    kernels::packed_matmul(&x, m, &w, &mut out)?;
    let flops = 2.0 * (m * k * n) as f64;
    let calls = ((2e9 / flops) as usize).clamp(1, 10_000);
    let mut best = 0f64;
    for _ in 0..repeats {
        let t = Instant::now();
        for _ in 0..calls {
            kernels::packed_matmul(&x, m, &w, &mut out)?;
        }
        best = best.max(flops * calls as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    std::hint::black_box(&out);
    Ok(best)
}
