//! Paged attention and block gather on the SmolLM2-135M attention shape, against the slow
//! reference (or a naive element loop for gather) measured in the same run.
//!
//! `cargo bench -p kernels --bench paged_attention`; prints one table. Timings are medians.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kernels::reference::paged_attention_reference;
use kernels::{gather_blocks, paged_attention, CacheShape, KernelError, SeqAttn};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const NUM_HEADS: usize = 9;
const NUM_KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const BLOCK_SIZE: usize = 16;

/// Median wall time of `f`, over at least `min_runs` runs and about `budget` of time.
fn median(min_runs: usize, budget: Duration, mut f: impl FnMut()) -> Duration {
    f(); // warm up caches, the thread pool and the ISA detection
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < min_runs || (start.elapsed() < budget && times.len() < 1000) {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}

/// The signature shared by `paged_attention` and `paged_attention_reference`.
type Kernel = fn(
    &CacheShape,
    &[f32],
    &[f32],
    &[f32],
    &mut [f32],
    usize,
    &[SeqAttn<'_>],
    f32,
) -> Result<(), KernelError>;

/// A cache with random contents and `(q_len, context_len)` sequences on shuffled blocks.
struct Workload {
    layout: CacheShape,
    k: Vec<f32>,
    v: Vec<f32>,
    q: Vec<f32>,
    tables: Vec<Vec<u32>>,
    shapes: Vec<(usize, usize)>,
}

impl Workload {
    fn new(shapes: Vec<(usize, usize)>) -> Self {
        let mut rng = StdRng::seed_from_u64(42);
        let num_blocks: usize = shapes.iter().map(|s| s.1.div_ceil(BLOCK_SIZE)).sum();
        let layout = CacheShape {
            num_blocks,
            block_size: BLOCK_SIZE,
            num_kv_heads: NUM_KV_HEADS,
            head_dim: HEAD_DIM,
        };
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut ids = ids.into_iter();
        let tables = shapes
            .iter()
            .map(|s| ids.by_ref().take(s.1.div_ceil(BLOCK_SIZE)).collect())
            .collect();
        let num_tokens: usize = shapes.iter().map(|s| s.0).sum();
        let mut fill = |n: usize| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        Workload {
            k: fill(layout.layer_elems()),
            v: fill(layout.layer_elems()),
            q: fill(num_tokens * NUM_HEADS * HEAD_DIM),
            layout,
            tables,
            shapes,
        }
    }

    fn seqs(&self) -> Vec<SeqAttn<'_>> {
        let mut q_start = 0;
        self.shapes
            .iter()
            .zip(&self.tables)
            .map(|(&(q_len, context_len), table)| {
                let s = SeqAttn {
                    q_start,
                    q_len,
                    context_len,
                    block_table: table,
                };
                q_start += q_len;
                s
            })
            .collect()
    }

    /// Multiply-adds of QK^T and PV, counted as 2 flops each, causal keys only.
    fn flops(&self) -> f64 {
        let per_key = (4 * NUM_HEADS * HEAD_DIM) as f64;
        self.shapes
            .iter()
            .map(|&(q_len, ctx)| {
                (0..q_len)
                    .map(|i| (ctx - q_len + i + 1) as f64 * per_key)
                    .sum::<f64>()
            })
            .sum()
    }

    fn run(&self, out: &mut [f32], kernel: Kernel) {
        let seqs = self.seqs();
        let scale = 1.0 / (HEAD_DIM as f32).sqrt();
        let r = kernel(
            &self.layout,
            &self.k,
            &self.v,
            &self.q,
            out,
            NUM_HEADS,
            &seqs,
            scale,
        );
        if let Err(e) = r {
            panic!("benchmark workload is invalid: {e}");
        }
        black_box(out);
    }
}

struct Row {
    name: String,
    fast: Duration,
    slow: Duration,
    unit: &'static str,
    fast_rate: f64,
    slow_rate: f64,
}

fn attention_row(name: &str, shapes: Vec<(usize, usize)>, slow_runs: usize) -> Row {
    let w = Workload::new(shapes);
    let mut out = vec![0.0f32; w.q.len()];
    let fast = median(10, Duration::from_secs(2), || {
        w.run(&mut out, paged_attention)
    });
    let mut reference_out = vec![0.0f32; w.q.len()];
    let slow = median(slow_runs, Duration::ZERO, || {
        w.run(&mut reference_out, paged_attention_reference)
    });
    let max_err = out
        .iter()
        .zip(&reference_out)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        max_err < 1e-4,
        "{name}: fast and reference differ by {max_err}"
    );
    let gflops = |t: Duration| w.flops() / t.as_secs_f64() / 1e9;
    Row {
        name: name.to_string(),
        fast,
        slow,
        unit: "GFLOP/s",
        fast_rate: gflops(fast),
        slow_rate: gflops(slow),
    }
}

/// The obvious gather: one element at a time, recomputing its address.
fn naive_gather(layout: &CacheShape, k: &[f32], v: &[f32], ids: &[u32], dst: &mut [f32]) {
    let block = layout.block_elems();
    for (c, cache) in [k, v].into_iter().enumerate() {
        for (i, &id) in ids.iter().enumerate() {
            for e in 0..block {
                dst[(c * ids.len() + i) * block + e] = cache[id as usize * block + e];
            }
        }
    }
}

fn gather_row(num_blocks: usize) -> Row {
    let w = Workload::new(vec![(1, 4 * num_blocks * BLOCK_SIZE)]);
    let mut rng = StdRng::seed_from_u64(7);
    let mut ids: Vec<u32> = (0..w.layout.num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    ids.truncate(num_blocks);
    let mut dst = vec![0.0f32; 2 * num_blocks * w.layout.block_elems()];
    let fast = median(50, Duration::from_secs(1), || {
        if let Err(e) = gather_blocks(&w.layout, &w.k, &w.v, &ids, &mut dst) {
            panic!("benchmark gather is invalid: {e}");
        }
        black_box(&mut dst);
    });
    let mut naive = vec![0.0f32; dst.len()];
    let slow = median(50, Duration::from_secs(1), || {
        naive_gather(&w.layout, &w.k, &w.v, black_box(&ids), &mut naive);
        black_box(&mut naive);
    });
    assert_eq!(dst, naive, "gather and naive gather differ");
    let gbps = |t: Duration| (dst.len() * 4) as f64 / t.as_secs_f64() / 1e9;
    Row {
        name: format!(
            "gather_blocks {num_blocks} blocks ({} KiB)",
            dst.len() * 4 / 1024
        ),
        fast,
        slow,
        unit: "GB/s",
        fast_rate: gbps(fast),
        slow_rate: gbps(slow),
    }
}

/// Decode attention as a step meets it: `layers` layers, each with a cache of its own, so the
/// K and V rows come from memory (the set is far larger than L3). The baseline is a plain
/// read of the same blocks by the same threads: the memory floor the kernel works against.
fn from_memory_row(batch: usize, ctx: usize, layers: usize) -> Row {
    let shapes = vec![(1, ctx); batch];
    let ws: Vec<Workload> = (0..layers).map(|_| Workload::new(shapes.clone())).collect();
    let mut out = vec![0.0f32; ws[0].q.len()];
    let read = |w: &Workload| {
        let block = w.layout.block_elems();
        let sums: Vec<std::sync::atomic::AtomicU32> =
            (0..batch).map(|_| Default::default()).collect();
        kernels::parallel_for(batch, &|b| {
            let mut acc = 0.0f32;
            for &id in &w.tables[b] {
                let at = id as usize * block;
                // One element per cache line: the loads, not the adds, are what is timed.
                for i in (0..block).step_by(16) {
                    acc += w.k[at + i] + w.v[at + i];
                }
            }
            sums[b].store(acc.to_bits(), std::sync::atomic::Ordering::Relaxed);
        });
        black_box(&sums);
    };
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        let t = Instant::now();
        for w in &ws {
            w.run(&mut out, paged_attention);
        }
        fast.push(t.elapsed());
        let t = Instant::now();
        ws.iter().for_each(read);
        slow.push(t.elapsed());
    }
    fast.sort();
    slow.sort();
    let (fast, slow) = (fast[7], slow[7]);
    let bytes = (layers * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 4 * 2) as f64;
    let gbps = |t: Duration| bytes / t.as_secs_f64() / 1e9;
    Row {
        name: format!("decode {batch} x ctx {ctx}, {layers} layers, from memory"),
        fast,
        slow,
        unit: "GB/s",
        fast_rate: gbps(fast),
        slow_rate: gbps(slow),
    }
}

fn main() {
    println!(
        "shape: num_heads {NUM_HEADS}, num_kv_heads {NUM_KV_HEADS}, head_dim {HEAD_DIM}, \
         block_size {BLOCK_SIZE}, f32, kernel threads {}",
        kernels::pool_threads()
    );
    let rows = vec![
        attention_row("decode 32 x ctx 128", vec![(1, 128); 32], 5),
        attention_row("decode 32 x ctx 512", vec![(1, 512); 32], 3),
        attention_row("prefill 512", vec![(512, 512)], 3),
        attention_row("prefill 2048", vec![(2048, 2048)], 1),
        gather_row(64),
        from_memory_row(64, 64, 30),
        from_memory_row(32, 200, 30),
    ];
    println!(
        "{:<46} {:>10} {:>14} {:>10} {:>14} {:>8}",
        "workload", "kernel", "kernel rate", "baseline", "baseline rate", "speedup"
    );
    for r in rows {
        println!(
            "{:<46} {:>10} {:>14} {:>10} {:>14} {:>7.1}x",
            r.name,
            format!("{:.2?}", r.fast),
            format!("{:.1} {}", r.fast_rate, r.unit),
            format!("{:.2?}", r.slow),
            format!("{:.2} {}", r.slow_rate, r.unit),
            r.slow.as_secs_f64() / r.fast.as_secs_f64()
        );
    }
    println!("rates: GFLOP/s for attention (QK^T and PV, causal), GB/s of dst written for gather");
    println!(
        "baseline: paged_attention_reference for attention, an element-by-element loop for gather"
    );
    println!(
        "'from memory' rows: GB/s of K and V read; the baseline is a plain read of the same \
         blocks, the memory floor (its 'speedup' is the kernel's share of that floor)"
    );
}
