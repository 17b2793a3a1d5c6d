use kernels::{paged_attention, KvLayout, SeqAttn};
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let q_len: usize = args[1].parse().unwrap();
    let ctx: usize = args[2].parse().unwrap();
    let nseq: usize = args[3].parse().unwrap();
    let iters: usize = args[4].parse().unwrap();
    let layout = KvLayout {
        num_blocks: nseq * ctx.div_ceil(16),
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    };
    let k: Vec<f32> = (0..layout.layer_elems())
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let v = k.clone();
    let q: Vec<f32> = (0..nseq * q_len * 9 * 64)
        .map(|i| ((i * 104729) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let tables: Vec<Vec<u32>> = (0..nseq)
        .map(|s| {
            (0..ctx.div_ceil(16))
                .map(|b| (s * ctx.div_ceil(16) + b) as u32)
                .collect()
        })
        .collect();
    let seqs: Vec<SeqAttn> = (0..nseq)
        .map(|s| SeqAttn {
            q_start: s * q_len,
            q_len,
            context_len: ctx,
            block_table: &tables[s],
        })
        .collect();
    let mut out = vec![0.0f32; q.len()];
    let t = Instant::now();
    for _ in 0..iters {
        paged_attention(&layout, &k, &v, &q, &mut out, 9, &seqs, 0.125).unwrap();
    }
    let dt = t.elapsed().as_secs_f64() / iters as f64;
    let flops: f64 = (0..nseq)
        .map(|_| {
            (0..q_len)
                .map(|i| (ctx - q_len + i + 1) as f64 * 4.0 * 9.0 * 64.0)
                .sum::<f64>()
        })
        .sum();
    println!("{:.3} ms  {:.1} GFLOP/s", dt * 1e3, flops / dt / 1e9);
}
