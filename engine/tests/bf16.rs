//! bf16 weights against f32 on the same checkpoint: next-token agreement and KL divergence
//! over at least 500 positions, on stories260K and on the SmolLM2-135M shape
//! (`common::agreement` says how).
//!
//! The thresholds sit below the measured values (BENCHMARKS.md, issue 14) with a margin for
//! other CPUs' summation order, and far above what a wrong kernel gives (a transposed or
//! misaligned bf16 panel drops agreement to chance).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::DType;
use common::agreement::{compare, load, prompts, smollm2_shape};
use engine::quantize::Quantize;

#[test]
fn bf16_weights_agree_with_f32_on_stories260k() {
    let dir = common::shared_model("stories260K");
    let bf16 = load(&dir, DType::BF16, Quantize::None);
    let r = compare(&dir, &bf16, &prompts(512, 6, 12), 100);
    assert!(r.positions >= 500, "{} positions", r.positions);
    assert!(r.top1 >= 0.97, "top-1 agreement {:.4}", r.top1);
    assert!(r.mean_kl <= 2e-3, "mean KL {:.3e}", r.mean_kl);
}

#[test]
fn bf16_weights_agree_with_f32_on_the_smollm2_shape() {
    let dir = smollm2_shape();
    let bf16 = load(dir.path(), DType::BF16, Quantize::None);
    let r = compare(dir.path(), &bf16, &prompts(49_152, 4, 16), 125);
    assert!(r.positions >= 500, "{} positions", r.positions);
    assert!(r.top1 >= 0.97, "top-1 agreement {:.4}", r.top1);
    assert!(r.mean_kl <= 2e-4, "mean KL {:.3e}", r.mean_kl);
}
