//! Batch-1 k-quant products on a Llama-3.2-1B-shaped layer mix (issue 33): the GB/s of the
//! panels a decode step streams, against a plain read of as many bytes on the same threads, and
//! batch 32 and a 512-row prefill beside them, each figure the median of `reps` alternating
//! passes, so a shared machine's drift lands on all of them.
//!
//!   cargo run --release -p kernels --example kquant_b1 -- [layers] [reps]
//!
//! Each layer: q (2048→2048), k (2048→512), o, gate and up (2048→8192) as Q4_K, v (2048→512)
//! and down (8192→2048) as Q6_K: llama.cpp's Q4_K_M mix on this shape, about 40 MB a layer, so
//! three layers are far past the last-level cache. To compare panel formats or loop orders,
//! run two builds' binaries one after another, several times (history 2026-11-29-kquant-b1).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kernels::{random_blocks, KQuantPart, KQuantType, KQuantWeight};

fn weight(ty: KQuantType, k: usize, n: usize, seed: u64) -> KQuantWeight {
    let raw = random_blocks(ty, n, k, seed);
    KQuantWeight::from_gguf(
        k,
        &[KQuantPart {
            ty,
            rows: n,
            data: &raw,
        }],
    )
    .expect("pack")
}

/// Seconds for one pass of `m`-row products over every weight.
fn pass(ws: &[KQuantWeight], x: &[f32], m: usize, out: &mut [f32]) -> f64 {
    let t = Instant::now();
    for w in ws {
        let (k, n) = (w.k(), w.n());
        w.matmul(&x[..m * k], m, &mut out[..m * n], false)
            .expect("shapes");
    }
    std::hint::black_box(&out);
    t.elapsed().as_secs_f64()
}

/// Seconds to read `buf` once on the pool's threads.
fn read_pass(buf: &[u64], sums: &[AtomicU64]) -> f64 {
    let threads = sums.len();
    let per = buf.len().div_ceil(threads);
    let t = Instant::now();
    kernels::parallel_for(threads, &|i| {
        let part = &buf[(i * per).min(buf.len())..((i + 1) * per).min(buf.len())];
        let s = part.iter().fold(0u64, |a, &b| a.wrapping_add(b));
        sums[i].fetch_add(s, Ordering::Relaxed);
    });
    t.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let layers = args.first().copied().unwrap_or(3);
    let reps = args.get(1).copied().unwrap_or(9);
    let (h, f, kv) = (2048, 8192, 512);
    let mut q4 = Vec::new();
    let mut q6 = Vec::new();
    for l in 0..layers as u64 {
        for (i, (k, n)) in [(h, h), (h, kv), (h, h), (h, f), (h, f)]
            .into_iter()
            .enumerate()
        {
            q4.push(weight(KQuantType::Q4K, k, n, l * 16 + i as u64));
        }
        q6.push(weight(KQuantType::Q6K, h, kv, l * 16 + 8));
        q6.push(weight(KQuantType::Q6K, f, h, l * 16 + 9));
    }
    let bytes = |ws: &[KQuantWeight]| ws.iter().map(|w| w.bytes()).sum::<usize>();
    let weights = |ws: &[KQuantWeight]| ws.iter().map(|w| w.k() * w.n()).sum::<usize>();
    let all: Vec<KQuantWeight> = q4.iter().chain(&q6).cloned().collect();
    let total = bytes(&all);
    eprintln!(
        "{layers} layers: Q4_K {:.1} MB ({:.3} bits/weight), Q6_K {:.1} MB ({:.3} bits/weight); threads {}",
        bytes(&q4) as f64 / 1e6,
        bytes(&q4) as f64 * 8.0 / weights(&q4) as f64,
        bytes(&q6) as f64 / 1e6,
        bytes(&q6) as f64 * 8.0 / weights(&q6) as f64,
        kernels::pool_threads()
    );
    let m_max = 32;
    let x: Vec<f32> = (0..m_max * f)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut out = vec![0f32; m_max * f];
    let buf: Vec<u64> = (0..(total / 8) as u64).collect();
    let sums: Vec<AtomicU64> = (0..kernels::pool_threads())
        .map(|_| AtomicU64::new(0))
        .collect();
    let layer0: Vec<KQuantWeight> = q4[..5].iter().chain(&q6[..2]).cloned().collect();
    let m_pre = 512;
    let xp: Vec<f32> = (0..m_pre * f)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let mut outp = vec![0f32; m_pre * f];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); 6];
    for _ in 0..reps {
        times[0].push(read_pass(&buf, &sums));
        times[1].push(pass(&all, &x, 1, &mut out));
        times[2].push(pass(&q4, &x, 1, &mut out));
        times[3].push(pass(&q6, &x, 1, &mut out));
        times[4].push(pass(&all, &x, 32, &mut out));
        times[5].push(pass(&layer0, &xp, m_pre, &mut outp));
    }
    let gbs = |b: usize, t: &[f64]| {
        let (med, lo, hi) = median(t.to_vec());
        format!(
            "{:6.1} GB/s (min {:.1}, max {:.1})",
            b as f64 / med / 1e9,
            b as f64 / hi / 1e9,
            b as f64 / lo / 1e9
        )
    };
    println!(
        "plain read of {:.1} MB: {}",
        total as f64 / 1e6,
        gbs(total, &times[0])
    );
    let ms = |t: &[f64]| {
        let (med, lo, hi) = median(t.to_vec());
        format!(
            "{:.2} ms a pass ({:.2}-{:.2})",
            med * 1e3,
            lo * 1e3,
            hi * 1e3
        )
    };
    println!("b1 all:  {} {}", gbs(total, &times[1]), ms(&times[1]));
    println!("b1 Q4_K: {} {}", gbs(bytes(&q4), &times[2]), ms(&times[2]));
    println!("b1 Q6_K: {} {}", gbs(bytes(&q6), &times[3]), ms(&times[3]));
    println!("b32 all: {}", ms(&times[4]));
    println!("b512 one layer: {}", ms(&times[5]));
}
