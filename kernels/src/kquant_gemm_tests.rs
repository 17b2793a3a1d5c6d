use super::*;
use crate::kquant::{random_blocks, KQuantPart};
use rand::{Rng, SeedableRng};

const TYPES: [KQuantType; 5] = [
    KQuantType::Q4_0,
    KQuantType::Q5_0,
    KQuantType::Q4K,
    KQuantType::Q5K,
    KQuantType::Q6K,
];

/// The simplest statement of the product: activations quantised per 32 (`max|x| / 127`,
/// ties to even), times the weights dequantised from the panels, in f64; and the sum of
/// the terms' magnitudes, which bounds the f32 rounding the kernels may add.
fn reference(x: &[f32], m: usize, w: &KQuantWeight) -> (Vec<f64>, Vec<f64>) {
    let (k, n) = (w.k(), w.n());
    let wd: Vec<f64> = (0..k * n).map(|t| f64::from(w.get(t / n, t % n))).collect();
    let mut out = vec![0f64; m * n];
    let mut mag = vec![0f64; m * n];
    for r in 0..m {
        for b0 in (0..k).step_by(32) {
            let block = &x[r * k + b0..r * k + b0 + 32];
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
            let q: Vec<f64> = block
                .iter()
                .map(|v| f64::from((v * inv).round_ties_even()) * f64::from(d))
                .collect();
            for j in 0..n {
                let s: f64 = (0..32).map(|i| q[i] * wd[(b0 + i) * n + j]).sum();
                out[r * n + j] += s;
                mag[r * n + j] += s.abs();
            }
        }
    }
    (out, mag)
}

fn check(parts: &[(KQuantType, usize)], m: usize, k: usize, seed: u64) {
    let raws: Vec<Vec<u8>> = parts
        .iter()
        .enumerate()
        .map(|(i, &(ty, rows))| random_blocks(ty, rows, k, seed + i as u64))
        .collect();
    let list: Vec<KQuantPart> = parts
        .iter()
        .zip(&raws)
        .map(|(&(ty, rows), data)| KQuantPart { ty, rows, data })
        .collect();
    let w = KQuantWeight::from_gguf(k, &list).expect("pack");
    let n = w.n();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let (want, mag) = reference(&x, m, &w);
    let base: Vec<f32> = (0..m * n).map(|_| rng.random_range(-1.0..1.0)).collect();
    for isa in QIsa::available() {
        for add in [false, true] {
            let mut out = if add {
                base.clone()
            } else {
                vec![f32::NAN; m * n]
            };
            w.matmul_on(isa, &x, m, &mut out, add).expect("shapes");
            for (i, g) in out.iter().enumerate() {
                let want = want[i] + if add { f64::from(base[i]) } else { 0.0 };
                let tol = 2e-6 * (mag[i] + 1.0);
                assert!(
                    (f64::from(*g) - want).abs() <= tol,
                    "{isa:?} {parts:?} add={add} m={m} k={k} at {i}: {g} vs {want}"
                );
            }
        }
    }
}

#[test]
fn every_type_and_isa_matches_the_reference() {
    for ty in TYPES {
        for (m, k, rows) in [(1, 256, 16), (3, 512, 40), (7, 256, 33), (13, 768, 17)] {
            check(&[(ty, rows)], m, k, (m * 31 + rows) as u64);
        }
    }
}

#[test]
fn mixed_segments_fill_their_own_columns() {
    // A Q4_K_M q/k/v: Q4_K, Q4_K then Q6_K rows, sizes not multiples of a panel.
    check(
        &[
            (KQuantType::Q4K, 40),
            (KQuantType::Q4K, 8),
            (KQuantType::Q6K, 24),
        ],
        5,
        512,
        9,
    );
}

#[test]
fn batches_and_prefill_sized_inputs() {
    // Past MC rows and KB blocks, and past the pool's thresholds.
    check(&[(KQuantType::Q4K, 64)], 140, 1024, 1);
    check(&[(KQuantType::Q6K, 48)], 33, 1024, 2);
}

#[test]
fn unsigned_dots_match_portable_at_the_extremes() {
    // The largest u (63) against -128 and 127 in every lane: maddubs must not saturate.
    for ty in [KQuantType::Q6K, KQuantType::Q4K] {
        let k = 256;
        let mut raw = random_blocks(ty, 16, k, 5);
        let bb = ty.block_bytes();
        for blk in raw.chunks_exact_mut(bb) {
            let data = if ty == KQuantType::Q6K {
                0..192
            } else {
                16..144
            };
            blk[data].fill(0xFF);
        }
        let w = KQuantWeight::from_gguf(
            k,
            &[KQuantPart {
                ty,
                rows: 16,
                data: &raw,
            }],
        )
        .expect("pack");
        for xv in [-1.0f32, 1.0] {
            let x = vec![xv; k];
            let mut want = vec![0f32; 16];
            w.matmul_on(QIsa::Portable, &x, 1, &mut want, false)
                .expect("shapes");
            for isa in QIsa::available() {
                let mut got = vec![0f32; 16];
                w.matmul_on(isa, &x, 1, &mut got, false).expect("shapes");
                for (g, e) in got.iter().zip(&want) {
                    assert!((g - e).abs() <= 1e-5 * e.abs().max(1.0), "{isa:?} {ty:?}");
                }
            }
        }
    }
}

#[test]
fn bad_lengths_are_errors() {
    let raw = random_blocks(KQuantType::Q4K, 16, 256, 1);
    let w = KQuantWeight::from_gguf(
        256,
        &[KQuantPart {
            ty: KQuantType::Q4K,
            rows: 16,
            data: &raw,
        }],
    )
    .expect("pack");
    let mut out = vec![0f32; 16];
    assert!(w.matmul(&[0.0; 255], 1, &mut out, false).is_err());
    assert!(w.matmul(&[0.0; 256], 1, &mut out[..15], false).is_err());
    assert!(w.matmul(&[], 0, &mut [], false).is_ok());
}

#[test]
fn one_tile_batches_read_whole_columns() {
    // At most one row tile: each column's blocks in one run, past KB, with the prefetches.
    for m in [1, 2, 4] {
        check(
            &[
                (KQuantType::Q4K, 40),
                (KQuantType::Q5K, 16),
                (KQuantType::Q6K, 24),
            ],
            m,
            2048,
            m as u64,
        );
        check(
            &[(KQuantType::Q4_0, 20), (KQuantType::Q5_0, 16)],
            m,
            1056,
            7,
        );
    }
}
