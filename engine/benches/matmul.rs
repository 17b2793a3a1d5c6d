//! Decode-shaped matmuls: the kernels crate's small-batch kernel against candle's matmul (gemm)
//! on the same operands, measured in the same run. `cargo bench -p engine --bench matmul`.

use std::time::Instant;

use candle_core::{Device, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

fn main() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    println!(
        "{:<22} {:>12} {:>10} {:>12} {:>10} {:>7}",
        "m x k x n", "kernel", "GB/s", "gemm", "GB/s", "ratio"
    );
    // SmolLM2-135M's projections and its 49152-wide lm_head, at decode batch sizes.
    for (m, k, n) in [
        (1, 576, 960),
        (1, 576, 3072),
        (1, 1536, 576),
        (1, 576, 49152),
        (4, 576, 3072),
        (8, 576, 3072),
        (8, 576, 49152),
    ] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).expect("x");
        let w = Tensor::randn(0f32, 1.0, (k, n), &Device::Cpu).expect("w");
        let xs: Vec<f32> = x.flatten_all().expect("f").to_vec1().expect("v");
        let ws: Vec<f32> = w.flatten_all().expect("f").to_vec1().expect("v");
        let mut out = vec![0f32; m * n];
        // Enough repetitions that the weights stream from memory, not from a warm cache.
        let reps = (400_000_000 / (k * n * 4)).clamp(20, 2000);
        let ours = time(reps, || {
            kernels::small_batch_matmul(&xs, m, k, &ws, n, &mut out).expect("shapes");
        });
        let theirs = time(reps, || {
            let _ = x.matmul(&w).expect("matmul");
        });
        let bytes = (k * n * 4) as f64;
        println!(
            "{:<22} {:>10.1}us {:>10.1} {:>10.1}us {:>10.1} {:>6.2}x",
            format!("{m} x {k} x {n}"),
            ours * 1e6,
            bytes / ours / 1e9,
            theirs * 1e6,
            bytes / theirs / 1e9,
            theirs / ours
        );
    }
}
