//! The model's matmuls on SmolLM2-135M's shapes: the packed-weight GEMM against candle's
//! matmul (gemm, re-packing its operand per call), on the same operands in the same run,
//! alternating which goes first.
//! `cargo bench -p engine --bench matmul` (`-- quick` for fewer rounds).

use std::time::Instant;

use candle_core::{Device, Tensor};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per call, the median of a burst of `reps` calls.
fn burst(reps: usize, f: &mut dyn FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn main() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    let quick = std::env::args().any(|a| a == "quick");
    let rounds = if quick { 3 } else { 7 };
    println!(
        "{:<20} {:>10} {:>8} {:>8} {:>10} {:>8} {:>7} {:>7}",
        "m x k x n", "packed", "GFLOP/s", "GB/s", "gemm", "GFLOP/s", "p/gemm", "spread"
    );
    // SmolLM2-135M's fused QKV, o_proj, fused gate/up, down and lm_head, at decode batches
    // and prefill chunks.
    let shapes = [
        (576, 960),
        (576, 576),
        (576, 3072),
        (1536, 576),
        (576, 49152),
    ];
    for m in [1, 8, 32, 64, 512] {
        for (k, n) in shapes {
            if m == 512 && n == 49152 {
                continue; // prefill asks logits of one row per sequence
            }
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
            let w = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu).expect("w");
            let xs: Vec<f32> = x.flatten_all().expect("f").to_vec1().expect("v");
            let ws: Vec<f32> = w.flatten_all().expect("f").to_vec1().expect("v");
            let packed = kernels::PackedWeight::from_in_out(&ws, k, n).expect("pack");
            let mut out = vec![0f32; m * n];
            let flops = 2.0 * (m * k * n) as f64;
            // Each burst long enough (~20 ms) that the weights stream from memory.
            let reps = ((2e7 / (k * n) as f64) as usize).clamp(2, 400);
            let reps = (reps * 64 / m.max(64)).max(2);
            let (mut a, mut b, mut ratios) = (vec![], vec![], vec![]);
            let mut run_a = || {
                kernels::packed_matmul(&xs, m, &packed, &mut out).expect("shapes");
            };
            let mut run_b = || {
                let _ = x.matmul(&w).expect("matmul");
            };
            burst(1, &mut run_a);
            burst(1, &mut run_b);
            for round in 0..rounds {
                let (ta, tb) = if round % 2 == 0 {
                    let ta = burst(reps, &mut run_a);
                    (ta, burst(reps, &mut run_b))
                } else {
                    let tb = burst(reps, &mut run_b);
                    (burst(reps, &mut run_a), tb)
                };
                a.push(ta);
                b.push(tb);
                ratios.push(tb / ta);
            }
            let (ta, tb) = (median(&mut a), median(&mut b));
            let r = median(&mut ratios);
            let spread = format!(
                "{:.2}-{:.2}",
                ratios.iter().copied().fold(f64::INFINITY, f64::min),
                ratios.iter().copied().fold(0.0, f64::max)
            );
            println!(
                "{:<20} {:>8.1}us {:>8.1} {:>8.1} {:>8.1}us {:>8.1} {:>6.2}x {:>9}",
                format!("{m} x {k} x {n}"),
                ta * 1e6,
                flops / ta / 1e9,
                packed.bytes() as f64 / ta / 1e9,
                tb * 1e6,
                flops / tb / 1e9,
                r,
                spread
            );
        }
    }
}
