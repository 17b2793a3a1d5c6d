//! Next-token agreement and KL divergence between the f32 model and a cheaper load of the same
//! checkpoint (bf16 weights, int8 weights), over generated positions.
//!
//! The f32 model writes greedy continuations; both models then score every position of those
//! sequences (teacher forcing), so each position compares the two distributions on the same
//! prefix.

use candle_core::{DType, Device};
use engine::engine::EngineConfig;
use engine::loader::ModelSource;
use engine::model::{ForwardBatch, LoadedModel};
use engine::quantize::Quantize;

use super::{engine, greedy};

pub struct Agreement {
    pub positions: usize,
    pub top1: f64,
    pub mean_kl: f64,
}

pub fn load(dir: &std::path::Path, dtype: DType, quantize: Quantize) -> LoadedModel {
    LoadedModel::load_quantized(
        &ModelSource::parse(dir.to_str().expect("utf-8 path")),
        Some(dtype),
        quantize,
        &Device::Cpu,
    )
    .expect("load")
}

/// Logits at every position of `ids`, one sequence per forward pass.
fn all_logits(model: &LoadedModel, ids: &[u32]) -> Vec<Vec<f32>> {
    let mut e = engine(
        model,
        EngineConfig {
            num_kv_blocks: Some(ids.len().div_ceil(16) + 1),
            ..Default::default()
        },
    );
    let mut fb = ForwardBatch::default();
    fb.push_seq(
        ids,
        0,
        (0..ids.len().div_ceil(16) as u32).collect(),
        16,
        false,
    );
    fb.logits_rows = (0..ids.len() as u32).collect();
    let logits = model.model.forward(&fb, e.cache_mut()).expect("forward");
    logits.to_vec2::<f32>().expect("logits")
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let exp: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|v| v / sum).collect()
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

/// `prompts` continued greedily by the f32 model for `new_tokens` each, then scored by it and
/// by `candidate` (the same checkpoint loaded otherwise).
pub fn compare(
    dir: &std::path::Path,
    candidate: &LoadedModel,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Agreement {
    let f32_model = load(dir, DType::F32, Quantize::None);
    let mut e = engine(
        &f32_model,
        EngineConfig {
            num_kv_blocks: Some(512),
            ..Default::default()
        },
    );
    let reqs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(i as u64, p.clone(), new_tokens))
        .collect();
    let outs = e.generate(reqs).expect("generate");
    let (mut positions, mut agree, mut kl) = (0usize, 0usize, 0f64);
    for (p, out) in prompts.iter().zip(&outs) {
        let ids: Vec<u32> = p.iter().chain(&out.output_ids).copied().collect();
        let a = all_logits(&f32_model, &ids);
        let b = all_logits(candidate, &ids);
        // Positions from the prompt's last token on: each predicts a generated token.
        for (ra, rb) in a.iter().zip(&b).skip(p.len() - 1) {
            positions += 1;
            agree += usize::from(argmax(ra) == argmax(rb));
            let (pa, pb) = (softmax(ra), softmax(rb));
            kl += pa
                .iter()
                .zip(&pb)
                .filter(|(x, _)| **x > 0.0)
                .map(|(x, y)| x * (x / y.max(1e-300)).ln())
                .sum::<f64>();
        }
    }
    let r = Agreement {
        positions,
        top1: agree as f64 / positions as f64,
        mean_kl: kl / positions as f64,
    };
    eprintln!(
        "{} vs {:?}: {} positions, top-1 agreement {:.4}, mean KL {:.3e}",
        dir.display(),
        candidate.model.dtype(),
        r.positions,
        r.top1,
        r.mean_kl
    );
    r
}

/// `n` prompts of `len` ids, as the benches make them.
pub fn prompts(vocab: usize, n: usize, len: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|b| {
            std::iter::once(1)
                .chain((1..len).map(|i| (3 + ((i * 7919 + 13 + b * 104_729) % (vocab - 3))) as u32))
                .collect()
        })
        .collect()
}

/// A random model of SmolLM2-135M's shape, with stories260K's tokenizer.
pub fn smollm2_shape() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    random_model::write_model(
        dir.path(),
        &random_model::ModelSpec::smollm2_135m(),
        &super::shared_model("stories260K"),
    )
    .expect("write model");
    dir
}
