//! int8 weights (`--quantize int8`, llama.cpp's Q8_0 layout) against f32 on the same
//! checkpoint: next-token agreement and KL divergence over at least 500 positions, on
//! stories260K and on the SmolLM2-135M shape (`common::agreement` says how), quantised from an
//! f32 load and from a bf16 one.
//!
//! The thresholds sit below the measured values (BENCHMARKS.md, issue 14) with a margin for
//! other CPUs' summation order, and far above what a wrong kernel gives (a misplaced group or
//! scale drops agreement to chance).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::DType;
use common::agreement::{compare, load, prompts, smollm2_shape};
use engine::quantize::Quantize;

#[test]
fn int8_weights_agree_with_f32_on_stories260k() {
    let dir = common::shared_model("stories260K");
    let int8 = load(&dir, DType::F32, Quantize::Int8);
    let r = compare(&dir, &int8, &prompts(512, 6, 12), 100);
    // Measured (AMD EPYC, AVX512-VNNI): 606 positions, top-1 0.9835, mean KL 1.67e-3.
    assert!(r.positions >= 500, "{} positions", r.positions);
    assert!(r.top1 >= 0.95, "top-1 agreement {:.4}", r.top1);
    assert!(r.mean_kl <= 4e-3, "mean KL {:.3e}", r.mean_kl);
}

#[test]
fn int8_from_bf16_agrees_with_f32_on_stories260k() {
    let dir = common::shared_model("stories260K");
    let int8 = load(&dir, DType::BF16, Quantize::Int8);
    let r = compare(&dir, &int8, &prompts(512, 6, 12), 100);
    // Measured: 606 positions, top-1 0.9752, mean KL 1.67e-3 (the bf16 KV cache included).
    assert!(r.positions >= 500, "{} positions", r.positions);
    assert!(r.top1 >= 0.95, "top-1 agreement {:.4}", r.top1);
    assert!(r.mean_kl <= 4e-3, "mean KL {:.3e}", r.mean_kl);
}

#[test]
fn int8_weights_agree_with_f32_on_the_smollm2_shape() {
    let dir = smollm2_shape();
    let int8 = load(dir.path(), DType::F32, Quantize::Int8);
    let r = compare(dir.path(), &int8, &prompts(49_152, 4, 16), 125);
    // Measured: 504 positions, top-1 0.9921, mean KL 7.6e-5.
    assert!(r.positions >= 500, "{} positions", r.positions);
    assert!(r.top1 >= 0.97, "top-1 agreement {:.4}", r.top1);
    assert!(r.mean_kl <= 2e-4, "mean KL {:.3e}", r.mean_kl);
}
