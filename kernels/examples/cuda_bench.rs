//! GPU kernel timings for one attention layer of a Llama-3.2-1B-shaped model (32 query heads,
//! 8 kv heads, head_dim 64, bf16, block size 16): decode attention at batch 1..128, prefill
//! attention at 512 and 2048 tokens, and a layer's block gather/scatter. Prints one JSON
//! object per figure, with the fraction of the GPU's roofline each reaches.
//!
//!     cargo build --release --features cuda -p kernels --example cuda_bench
//!     target/release/examples/cuda_bench [--peak-gbs 3350] [--peak-tflops 67]
//!
//! `--peak-gbs` is the HBM bandwidth (H100 SXM 3350, H200 4800) and `--peak-tflops` the f32
//! CUDA-core peak (H100 SXM 67): the kernels accumulate in f32 on CUDA cores, not tensor cores.
//! Each call's time includes its host-side planning and metadata upload, as in serving.

use std::time::Instant;

use cudarc::driver::CudaSlice;
use half::bf16;
use kernels::cuda::{AttentionKernel, CudaKernels, PinnedStaging};
use kernels::{CacheShape, SeqAttn};
use rand::{Rng, SeedableRng};

const NUM_HEADS: usize = 32;
const NUM_KV_HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const BLOCK_SIZE: usize = 16;

fn arg(name: &str, default: f64) -> f64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Median seconds per call of `f` over `iters` calls (after warm-up), synchronizing each time.
fn time(gpu: &CudaKernels, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    gpu.stream().synchronize().expect("sync");
    let mut samples: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            gpu.stream().synchronize().expect("sync");
            t.elapsed().as_secs_f64() / iters as f64
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[2]
}

fn upload(gpu: &CudaKernels, n: usize, seed: u64) -> CudaSlice<bf16> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let host: Vec<bf16> = (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0..1.0)))
        .collect();
    gpu.stream().clone_htod(&host).expect("upload")
}

fn main() {
    let (peak_gbs, peak_tflops) = (arg("--peak-gbs", 3350.0), arg("--peak-tflops", 67.0));
    let gpu = CudaKernels::on_device(0).expect("a CUDA device");
    let max_tokens = 128 * 2048;
    let layout = CacheShape {
        num_blocks: max_tokens / BLOCK_SIZE,
        block_size: BLOCK_SIZE,
        num_kv_heads: NUM_KV_HEADS,
        head_dim: HEAD_DIM,
    };
    let k = upload(&gpu, layout.layer_elems(), 1);
    let v = upload(&gpu, layout.layer_elems(), 2);
    let q = upload(&gpu, 2048 * NUM_HEADS * HEAD_DIM, 3);
    let mut out = gpu
        .stream()
        .alloc_zeros::<bf16>(2048 * NUM_HEADS * HEAD_DIM)
        .expect("alloc");
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let kv_bytes_per_token = (2 * NUM_KV_HEADS * HEAD_DIM * 2) as f64;

    // Decode: every sequence of the batch at the same context length, disjoint blocks.
    for context in [512, 2048] {
        for batch in [1, 8, 32, 64, 128] {
            let per_seq = context / BLOCK_SIZE;
            let tables: Vec<Vec<u32>> = (0..batch)
                .map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect())
                .collect();
            let seqs: Vec<SeqAttn<'_>> = tables
                .iter()
                .enumerate()
                .map(|(b, t)| SeqAttn {
                    q_start: b,
                    q_len: 1,
                    context_len: context,
                    block_table: t,
                })
                .collect();
            let q_b = q.slice(..batch * NUM_HEADS * HEAD_DIM);
            for (name, kernel) in [
                ("auto", AttentionKernel::Auto),
                ("v1", AttentionKernel::Decode),
                (
                    "split_k_512",
                    AttentionKernel::DecodeSplitK {
                        partition_keys: 512,
                    },
                ),
            ] {
                let secs = time(&gpu, 20, || {
                    let mut o = out.slice_mut(..batch * NUM_HEADS * HEAD_DIM);
                    gpu.paged_attention(
                        &layout, &k, &v, &q_b, &mut o, NUM_HEADS, &seqs, scale, kernel,
                    )
                    .expect("attention");
                });
                let gbs = (batch * context) as f64 * kv_bytes_per_token / secs / 1e9;
                println!(
                    r#"{{"figure": "decode_attention", "kernel": "{name}", "batch": {batch}, "context": {context}, "us": {:.2}, "kv_gb_s": {gbs:.1}, "roofline_fraction": {:.3}}}"#,
                    secs * 1e6,
                    gbs / peak_gbs
                );
            }
        }
    }

    // Prefill: one prompt, causal.
    for tokens in [512, 2048] {
        let table: Vec<u32> = (0..(tokens / BLOCK_SIZE) as u32).collect();
        let seqs = [SeqAttn {
            q_start: 0,
            q_len: tokens,
            context_len: tokens,
            block_table: &table,
        }];
        let q_n = q.slice(..tokens * NUM_HEADS * HEAD_DIM);
        let secs = time(&gpu, 5, || {
            let mut o = out.slice_mut(..tokens * NUM_HEADS * HEAD_DIM);
            gpu.paged_attention(
                &layout,
                &k,
                &v,
                &q_n,
                &mut o,
                NUM_HEADS,
                &seqs,
                scale,
                AttentionKernel::Prefill,
            )
            .expect("attention");
        });
        // QK^T and PV over the causal half: 2 * 2 * n^2 / 2 * heads * head_dim.
        let flops = 2.0 * (tokens * tokens) as f64 * (NUM_HEADS * HEAD_DIM) as f64;
        let tflops = flops / secs / 1e12;
        println!(
            r#"{{"figure": "prefill_attention", "tokens": {tokens}, "us": {:.2}, "tok_s_per_layer": {:.0}, "tflops": {tflops:.2}, "roofline_fraction": {:.3}}}"#,
            secs * 1e6,
            tokens as f64 / secs,
            tflops / peak_tflops
        );
    }

    // KV transfer staging: one layer's blocks of a 2048-token prompt.
    let ids: Vec<u32> = (0..(2048 / BLOCK_SIZE) as u32)
        .map(|i| i * 7 % 1024)
        .collect();
    let n = 2 * ids.len() * layout.block_elems();
    let mut staging = gpu.stream().alloc_zeros::<bf16>(n).expect("alloc");
    let bytes = (n * 2) as f64;
    let secs = time(&gpu, 50, || {
        gpu.gather_blocks(&layout, &k, &v, &ids, &mut staging)
            .expect("gather");
    });
    let gbs = 2.0 * bytes / secs / 1e9; // read and write
    println!(
        r#"{{"figure": "gather_blocks", "blocks": {}, "bytes": {bytes}, "us": {:.2}, "gb_s": {gbs:.1}, "roofline_fraction": {:.3}}}"#,
        ids.len(),
        secs * 1e6,
        gbs / peak_gbs
    );
    let mut pinned = PinnedStaging::<bf16>::new(&gpu, &layout, ids.len()).expect("pinned");
    let secs = time(&gpu, 20, || {
        gpu.gather_blocks_to_host(&layout, &k, &v, &ids, &mut pinned)
            .expect("gather");
        pinned.host().expect("host");
    });
    println!(
        r#"{{"figure": "gather_blocks_to_pinned_host", "bytes": {bytes}, "us": {:.2}, "gb_s": {:.1}}}"#,
        secs * 1e6,
        bytes / secs / 1e9
    );
}
