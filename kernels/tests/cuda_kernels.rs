//! The CUDA kernels against their CPU references: attention within bf16/f16/f32 tolerances,
//! copies bit-exact. Needs a GPU: `cargo test --release --features cuda -p kernels --test
//! cuda_kernels` (benchmarks/history/2026-11-21-gpu-run-plan.md has the command that runs it on
//! the GPU machine).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use kernels::cuda::{AttentionKernel, CudaKernels, CudaKvElem, PinnedStaging};
use kernels::reference::paged_attention_reference;
use kernels::{AttnOptions, CacheShape, KernelError, KvElem, SeqAttn};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn gpu() -> CudaKernels {
    CudaKernels::on_device(0).expect("these tests need a CUDA device and driver")
}

fn random<T: KvElem>(rng: &mut StdRng, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| T::from_f32(rng.random_range(-1.0..1.0)))
        .collect()
}

/// A ragged batch on shuffled blocks: `shapes` holds (q_len, context_len) per sequence.
struct Batch<T> {
    layout: CacheShape,
    num_heads: usize,
    k: Vec<T>,
    v: Vec<T>,
    q: Vec<T>,
    seqs: Vec<(usize, usize, usize, Vec<u32>)>,
}

impl<T: CudaKvElem> Batch<T> {
    fn new(
        seed: u64,
        group: usize,
        kv_heads: usize,
        head_dim: usize,
        shapes: &[(usize, usize)],
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let block_size = 16;
        let needed: usize = shapes.iter().map(|s| s.1.div_ceil(block_size)).sum();
        let layout = CacheShape {
            num_blocks: needed + 3,
            block_size,
            num_kv_heads: kv_heads,
            head_dim,
        };
        let mut ids: Vec<u32> = (0..layout.num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut ids = ids.into_iter();
        let mut seqs = Vec::new();
        let mut q_start = 0;
        for &(q_len, ctx) in shapes {
            seqs.push((
                q_start,
                q_len,
                ctx,
                ids.by_ref().take(ctx.div_ceil(block_size)).collect(),
            ));
            q_start += q_len;
        }
        seqs.shuffle(&mut rng);
        let num_heads = group * kv_heads;
        Batch {
            layout,
            num_heads,
            k: random(&mut rng, layout.layer_elems()),
            v: random(&mut rng, layout.layer_elems()),
            q: random(&mut rng, q_start * num_heads * head_dim),
            seqs,
        }
    }

    fn seq_attn(&self) -> Vec<SeqAttn<'_>> {
        self.seqs
            .iter()
            .map(|(q_start, q_len, context_len, table)| SeqAttn {
                q_start: *q_start,
                q_len: *q_len,
                context_len: *context_len,
                block_table: table,
            })
            .collect()
    }

    /// GPU against the CPU reference, for every kernel, within `tolerance * (1 + |want|)`.
    /// Without a window or soft-cap the reference is the plain one; with them, the CPU
    /// kernels' `paged_attention_with`, which the CPU tests hold to its own reference.
    fn check(&self, gpu: &CudaKernels, opts: AttnOptions, tolerance: f32) {
        let seqs = self.seq_attn();
        let mut want = vec![T::default(); self.q.len()];
        if opts.window.is_none() && opts.softcap.is_none() {
            paged_attention_reference(
                &self.layout,
                &self.k,
                &self.v,
                &self.q,
                &mut want,
                self.num_heads,
                &seqs,
                opts.scale,
            )
            .expect("valid batch");
        } else {
            kernels::paged_attention_with(
                &self.layout,
                &self.k,
                &self.v,
                &self.q,
                &mut want,
                self.num_heads,
                &seqs,
                opts,
            )
            .expect("valid batch");
        }
        let stream = gpu.stream();
        let k = stream.clone_htod(&self.k).expect("upload");
        let v = stream.clone_htod(&self.v).expect("upload");
        let q = stream.clone_htod(&self.q).expect("upload");
        let kernels = [
            AttentionKernel::Auto,
            AttentionKernel::Decode,
            AttentionKernel::DecodeSplitK { partition_keys: 32 },
            AttentionKernel::DecodeSplitK {
                partition_keys: 512,
            },
            AttentionKernel::Prefill,
        ];
        for kernel in kernels {
            let mut out = stream.alloc_zeros::<T>(self.q.len()).expect("alloc");
            gpu.paged_attention_with(
                &self.layout,
                &k,
                &v,
                &q,
                &mut out,
                self.num_heads,
                &seqs,
                opts,
                kernel,
            )
            .expect("valid batch");
            let got = stream.clone_dtoh(&out).expect("download");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let (g, w) = (g.to_f32(), w.to_f32());
                assert!(
                    (g - w).abs() <= tolerance * (1.0 + w.abs()),
                    "{kernel:?} {:?} element {i}: got {g}, want {w}",
                    T::DTYPE
                );
            }
        }
    }
}

fn check_all_dtypes(
    seed: u64,
    group: usize,
    kv_heads: usize,
    head_dim: usize,
    shapes: &[(usize, usize)],
) {
    let gpu = gpu();
    for scale in [1.0 / (head_dim as f32).sqrt(), 1.5] {
        let opts = AttnOptions {
            scale,
            window: None,
            softcap: None,
        };
        check_dtypes(&gpu, seed, group, kv_heads, head_dim, shapes, opts);
    }
}

fn check_dtypes(
    gpu: &CudaKernels,
    seed: u64,
    group: usize,
    kv_heads: usize,
    head_dim: usize,
    shapes: &[(usize, usize)],
    opts: AttnOptions,
) {
    Batch::<f32>::new(seed, group, kv_heads, head_dim, shapes).check(gpu, opts, 1e-4);
    // Same inputs as the reference; only the f32 summation order and the final rounding
    // differ, so one or two units in the last place.
    Batch::<bf16>::new(seed, group, kv_heads, head_dim, shapes).check(gpu, opts, 1.6e-2);
    Batch::<f16>::new(seed, group, kv_heads, head_dim, shapes).check(gpu, opts, 2e-3);
}

#[test]
fn windowed_and_soft_capped_batches_match_the_cpu_kernels() {
    // Gemma's options: windows shorter and longer than a staged tile of 32 keys and than the
    // split-K parts, a prefill chunk past its window beside decode rows, with and without a cap.
    let gpu = gpu();
    let shapes = [(70, 700), (1, 300), (1, 20), (33, 64)];
    for (window, softcap) in [
        (Some(16), None),
        (Some(100), Some(50.0)),
        (None, Some(20.0)),
    ] {
        let opts = AttnOptions {
            scale: 0.125,
            window,
            softcap,
        };
        check_dtypes(&gpu, 9, 2, 2, 64, &shapes, opts);
    }
}

#[test]
fn decode_batches_match_the_reference() {
    // Llama-3.2-1B's shape (group 4, head_dim 64), long and short contexts.
    check_all_dtypes(1, 4, 8, 64, &[(1, 1), (1, 17), (1, 700), (1, 2500)]);
    // Group 8 and 20 (blocks hold part of a group), head_dim 128.
    check_all_dtypes(2, 8, 2, 128, &[(1, 300), (1, 33)]);
    check_all_dtypes(3, 20, 1, 128, &[(1, 1030)]);
}

#[test]
fn prefill_and_mixed_batches_match_the_reference() {
    // A chunk continuing a cached prefix, a fresh prompt and decode rows in one call.
    check_all_dtypes(4, 4, 2, 64, &[(100, 612), (37, 37), (1, 90)]);
    // Odd head dims use the next bucket with masked lanes: stories260K (8), 80, 256.
    check_all_dtypes(5, 2, 4, 8, &[(20, 20), (1, 64)]);
    check_all_dtypes(6, 1, 3, 80, &[(65, 200)]);
    check_all_dtypes(7, 4, 1, 256, &[(33, 70), (1, 40)]);
}

#[test]
fn bad_arguments_fail_before_launching() {
    let gpu = gpu();
    let b = Batch::<f32>::new(8, 2, 2, 64, &[(1, 20)]);
    let stream = gpu.stream();
    let k = stream.clone_htod(&b.k).expect("upload");
    let q = stream.clone_htod(&b.q).expect("upload");
    let mut out = stream.alloc_zeros::<f32>(b.q.len() + 1).expect("alloc");
    let err = gpu
        .paged_attention(
            &b.layout,
            &k,
            &k,
            &q,
            &mut out,
            b.num_heads,
            &b.seq_attn(),
            1.0,
            AttentionKernel::Auto,
        )
        .expect_err("out is one element too long");
    assert!(matches!(err, KernelError::BadLength { what: "out", .. }));
    let wide = CacheShape {
        head_dim: 512,
        ..b.layout
    };
    let err = gpu
        .paged_attention(
            &wide,
            &k,
            &k,
            &q,
            &mut out,
            b.num_heads,
            &b.seq_attn(),
            1.0,
            AttentionKernel::Auto,
        )
        .expect_err("head_dim 512 is not supported");
    assert!(matches!(
        err,
        KernelError::BadLength { .. } | KernelError::Invalid(_)
    ));
}

fn copy_layout() -> CacheShape {
    CacheShape {
        num_blocks: 12,
        block_size: 16,
        num_kv_heads: 2,
        head_dim: 64,
    }
}

/// Bit patterns, so that a bit-exact comparison also covers NaN payloads.
fn bits<T: KvElem>(x: &[T]) -> Vec<u32> {
    x.iter().map(|v| v.to_f32().to_bits()).collect()
}

fn check_copies<T: CudaKvElem>(layout: CacheShape) {
    let gpu = gpu();
    let stream = gpu.stream();
    let mut rng = StdRng::seed_from_u64(9);
    let mut kc: Vec<T> = random(&mut rng, layout.layer_elems());
    let mut vc: Vec<T> = random(&mut rng, layout.layer_elems());
    let mut dk = stream.clone_htod(&kc).expect("upload");
    let mut dv = stream.clone_htod(&vc).expect("upload");

    // reshape_and_cache with a repeated slot: the last token wins on both.
    let slots = [5u32, 40, 5, 191, 0].map(|s| s % layout.num_slots() as u32);
    let rows: Vec<T> = random(&mut rng, slots.len() * layout.row_elems());
    let rows_v: Vec<T> = random(&mut rng, rows.len());
    kernels::reshape_and_cache(&layout, &mut kc, &mut vc, &rows, &rows_v, &slots).expect("cpu");
    let (rk, rv) = (
        stream.clone_htod(&rows).expect("up"),
        stream.clone_htod(&rows_v).expect("up"),
    );
    gpu.reshape_and_cache(&layout, &mut dk, &mut dv, &rk, &rv, &slots)
        .expect("gpu");
    assert_eq!(bits(&stream.clone_dtoh(&dk).expect("down")), bits(&kc));
    assert_eq!(bits(&stream.clone_dtoh(&dv).expect("down")), bits(&vc));

    // gather, then scatter into other blocks (with a repeat), then copy-on-write with a chain.
    let ids = [3u32, 0, 11, 7];
    let n = 2 * ids.len() * layout.block_elems();
    let mut staged = vec![T::default(); n];
    kernels::gather_blocks(&layout, &kc, &vc, &ids, &mut staged).expect("cpu");
    let mut dstaged = stream.alloc_zeros::<T>(n).expect("alloc");
    gpu.gather_blocks(&layout, &dk, &dv, &ids, &mut dstaged)
        .expect("gpu");
    assert_eq!(
        bits(&stream.clone_dtoh(&dstaged).expect("down")),
        bits(&staged)
    );

    let to = [1u32, 2, 1, 9];
    kernels::scatter_blocks(&layout, &mut kc, &mut vc, &to, &staged).expect("cpu");
    gpu.scatter_blocks(&layout, &mut dk, &mut dv, &to, &dstaged)
        .expect("gpu");
    let pairs = [(1u32, 4u32), (4, 5), (6, 6), (2, 1)];
    kernels::copy_blocks(&layout, &mut kc, &mut vc, &pairs).expect("cpu");
    gpu.copy_blocks(&layout, &mut dk, &mut dv, &pairs)
        .expect("gpu");
    assert_eq!(bits(&stream.clone_dtoh(&dk).expect("down")), bits(&kc));
    assert_eq!(bits(&stream.clone_dtoh(&dv).expect("down")), bits(&vc));

    // Through pinned host staging, as the QUIC/TCP transports use it.
    let mut staging = PinnedStaging::<T>::new(&gpu, &layout, 8).expect("pinned");
    let len = gpu
        .gather_blocks_to_host(&layout, &dk, &dv, &ids, &mut staging)
        .expect("gpu");
    kernels::gather_blocks(&layout, &kc, &vc, &ids, &mut staged).expect("cpu");
    assert_eq!(bits(&staging.host().expect("host")[..len]), bits(&staged));
    let back = [10u32, 8, 6, 4];
    gpu.scatter_blocks_from_host(&layout, &mut dk, &mut dv, &back, &mut staging)
        .expect("gpu");
    kernels::scatter_blocks(&layout, &mut kc, &mut vc, &back, &staged).expect("cpu");
    assert_eq!(bits(&stream.clone_dtoh(&dk).expect("down")), bits(&kc));
    assert_eq!(bits(&stream.clone_dtoh(&dv).expect("down")), bits(&vc));
    let too_many = [0u32; 9];
    assert!(gpu
        .gather_blocks_to_host(&layout, &dk, &dv, &too_many, &mut staging)
        .is_err());
}

#[test]
fn copies_are_bit_exact() {
    check_copies::<f32>(copy_layout());
    check_copies::<bf16>(copy_layout());
    check_copies::<f16>(copy_layout());
    // A block of 2 * 3 * 5 bf16 (60 bytes) is not 16-byte aligned: the 2-byte word path.
    let odd = CacheShape {
        num_blocks: 12,
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 5,
    };
    check_copies::<bf16>(CacheShape {
        block_size: 2,
        ..odd
    });
    check_copies::<f32>(odd);
}

/// The push's copies on the device, measured (issue 35): one Llama-3.2-1B-shaped layer (8 KV
/// heads of 64, 16-token blocks, bf16) of a 2,048-token prompt, gathered into pinned host
/// staging and scattered back from it, as a prefill node sends a layer and a decode node
/// receives it. Prints GB/s of K+V bytes each way (the GPU run's "KV push device -> host ->
/// device"); asserts only that the round trip is bit-exact.
#[test]
fn push_copies_bandwidth() {
    let layout = CacheShape {
        num_blocks: 256,
        block_size: 16,
        num_kv_heads: 8,
        head_dim: 64,
    };
    let blocks = 128;
    let gpu = gpu();
    let stream = gpu.stream();
    let mut rng = StdRng::seed_from_u64(35);
    let kc: Vec<bf16> = random(&mut rng, layout.layer_elems());
    let vc: Vec<bf16> = random(&mut rng, layout.layer_elems());
    let (dk, dv) = (
        stream.clone_htod(&kc).expect("up"),
        stream.clone_htod(&vc).expect("up"),
    );
    let mut ids: Vec<u32> = (0..layout.num_blocks as u32).collect();
    ids.shuffle(&mut rng);
    let (from, to) = (&ids[..blocks], &ids[blocks..2 * blocks]);
    let (mut ek, mut ev) = (
        stream.alloc_zeros::<bf16>(kc.len()).expect("alloc"),
        stream.alloc_zeros::<bf16>(vc.len()).expect("alloc"),
    );
    let mut staging = PinnedStaging::<bf16>::new(&gpu, &layout, blocks).expect("pinned");
    let bytes = (2 * blocks * layout.block_elems() * 2) as f64;
    let (mut down, mut up) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let t = std::time::Instant::now();
        gpu.gather_blocks_to_host(&layout, &dk, &dv, from, &mut staging)
            .expect("gather");
        staging.host().expect("host");
        down.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        let t = std::time::Instant::now();
        gpu.scatter_blocks_from_host(&layout, &mut ek, &mut ev, to, &mut staging)
            .expect("scatter");
        stream.synchronize().expect("sync");
        up.push(bytes / t.elapsed().as_secs_f64() / 1e9);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "KV push copies, {:.1} MiB a layer: device -> pinned host {:.1} GB/s, pinned host -> \
         device {:.1} GB/s (medians of 20)",
        bytes / (1 << 20) as f64,
        median(&mut down),
        median(&mut up)
    );
    let mut again = vec![bf16::default(); 2 * blocks * layout.block_elems()];
    let (hk, hv) = (
        stream.clone_dtoh(&ek).expect("down"),
        stream.clone_dtoh(&ev).expect("down"),
    );
    kernels::gather_blocks(&layout, &hk, &hv, to, &mut again).expect("cpu");
    let mut want = vec![bf16::default(); again.len()];
    kernels::gather_blocks(&layout, &kc, &vc, from, &mut want).expect("cpu");
    assert_eq!(bits(&again), bits(&want));
}
