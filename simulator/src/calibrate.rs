//! `simulate calibrate`: a linear cost model fitted to measured step times of the real engine.
//!
//! Two sources of measurements:
//! - the JSON `fission bench engine --out FILE` writes: `prefill_tok_s` (one prompt of each
//!   length in one step: `t = len / tok_s`) and `decode_batch_tok_s` (batches of 32-token
//!   prompts generating 64 tokens each, timed after every first token: a step of batch `b`
//!   takes `b / tok_s` over `64 * b` context tokens on average, the contexts running from 33
//!   to 96), plus `decode_single_tok_s` (one sequence, 32 + 128 tokens: 96 on average). That
//!   benchmark grows the context with the batch, so the fit cannot tell the two terms apart
//!   and keeps whichever explains the times (see [`crate::fit`]);
//! - the engine itself, run here ([`measure`]): each prompt length prefilled alone, and each
//!   (batch, context) pair's decode steps timed one by one (median), so batch and context
//!   vary independently.
//!
//! The model's shape (for KV bytes per token) comes from its `config.json`; the link and the KV
//! capacity are the caller's (measure the link with `fission bench kvtransfer`).

use std::collections::BTreeMap;
use std::time::Instant;

use engine::engine::{Engine, EngineConfig, LayerHook, Request};
use engine::ids::SeqId;
use engine::loader::{ModelFiles, ModelSource};
use engine::model::LoadedModel;
use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, Link, ModelShape, NodeSpec, StepCost, StepWork};
use crate::fit::{decode_samples, fit_cost, prefill_samples, Fit};
use loadgen::error::LoadError;

/// Measured step times.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Measurements {
    /// `(prompt tokens, seconds)` of a prompt computed in one step.
    pub prefill: Vec<(usize, f64)>,
    /// `(batch, context tokens of the step, seconds)` of a decode step.
    pub decode: Vec<(usize, usize, f64)>,
    /// `(prompt tokens, decode batch, the decodes' context tokens, seconds)` of a step that
    /// computes a prompt and decodes together, as a colocated node's steps do. Not fitted:
    /// they check how the profile prices such steps.
    pub mixed: Vec<(usize, usize, usize, f64)>,
}

/// The part of `fission bench engine`'s JSON the fit reads.
#[derive(Debug, Deserialize)]
struct BenchJson {
    prefill_tok_s: BTreeMap<String, f64>,
    decode_single_tok_s: Option<f64>,
    #[serde(default)]
    decode_batch_tok_s: BTreeMap<String, f64>,
}

/// The prompt and output lengths `fission bench engine`'s decode figures use.
const BENCH_PROMPT: usize = 32;
const BENCH_BATCH_NEW: usize = 64;
const BENCH_SINGLE_NEW: usize = 128;

pub fn from_bench_json(text: &str) -> Result<Measurements, LoadError> {
    let b: BenchJson = serde_json::from_str(text)
        .map_err(|e| LoadError::invalid("bench json", e.to_string(), "fission bench engine"))?;
    let key = |k: &str| {
        k.parse::<usize>()
            .map_err(|_| LoadError::invalid("bench json", "keys must be integers", k))
    };
    let mut m = Measurements::default();
    for (k, tok_s) in &b.prefill_tok_s {
        let n = key(k)?;
        m.prefill.push((n, n as f64 / tok_s));
    }
    // Mean context over a sequence's decode steps: the prompt, the first token, and half of
    // the rest.
    let mean_ctx = |new: usize| BENCH_PROMPT + 1 + (new - 1) / 2;
    if let Some(tok_s) = b.decode_single_tok_s {
        m.decode.push((1, mean_ctx(BENCH_SINGLE_NEW), 1.0 / tok_s));
    }
    for (k, tok_s) in &b.decode_batch_tok_s {
        let batch = key(k)?;
        m.decode.push((
            batch,
            batch * mean_ctx(BENCH_BATCH_NEW),
            batch as f64 / tok_s,
        ));
    }
    m.prefill.sort_by_key(|p| p.0);
    Ok(m)
}

/// What to measure when running the engine here.
#[derive(Debug, Clone)]
pub struct MeasureGrid {
    pub prefill_tokens: Vec<usize>,
    pub batches: Vec<usize>,
    pub contexts: Vec<usize>,
    /// Decode steps timed per (batch, context); the median is kept.
    pub steps: usize,
    /// Prefills timed per length; the median is kept.
    pub repeats: usize,
    /// Mixed steps: a prompt of each of `mixed_prompts` tokens computed with each of
    /// `mixed_batches` decodes over `mixed_context` tokens each.
    pub mixed_prompts: Vec<usize>,
    pub mixed_batches: Vec<usize>,
    pub mixed_context: usize,
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Prompt ids as `fission bench engine` builds them.
fn bench_prompt(len: usize, b: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (3 + ((i * 7919 + 13 + b * 104_729) % (vocab - 3))) as u32)
        .collect()
}

fn engine_for(model: &LoadedModel, blocks: usize, max_prefill: usize) -> Result<Engine, LoadError> {
    Engine::new(
        model.clone(),
        EngineConfig {
            num_kv_blocks: Some(blocks),
            max_batch_prefill_tokens: max_prefill,
            max_prefill_chunk_tokens: max_prefill,
            enable_prefix_caching: false,
            ..Default::default()
        },
    )
    .map_err(engine_err)
}

fn engine_err(e: engine::error::EngineError) -> LoadError {
    LoadError::RequestFailed {
        what: "calibration run of the engine".into(),
        reason: e.to_string(),
    }
}

/// Tokens per KV block of the engines timed here (the nodes' default).
const BLOCK: usize = 16;

/// Runs the engine on `model` over `grid`, timing each step.
pub fn measure(model: &LoadedModel, grid: &MeasureGrid) -> Result<Measurements, LoadError> {
    let vocab = model.config().vocab_size;
    let max_ctx = model.config().max_context;
    let mut m = Measurements::default();
    let mut id = 0u64;
    let mut next_id = || {
        id += 1;
        SeqId(id)
    };
    // Warm-up: first-touch page faults and thread-pool start-up are not step time.
    let mut e = engine_for(model, 8, 64)?;
    e.add_request(Request::greedy_fixed_length(
        next_id(),
        bench_prompt(32.min(max_ctx - 1), 0, vocab),
        2,
    ))
    .map_err(engine_err)?;
    while e.has_work() {
        e.step().map_err(engine_err)?;
    }
    for &len in grid.prefill_tokens.iter().filter(|&&n| n + 1 < max_ctx) {
        let mut times = Vec::new();
        for r in 0..grid.repeats.max(1) {
            times.push(time_prefill(model, len, r, None)?);
        }
        m.prefill.push((len, median(times)));
    }
    let steps = grid.steps.max(1);
    for &ctx in &grid.contexts {
        if ctx + steps + 2 > max_ctx {
            continue;
        }
        for &batch in &grid.batches {
            let times = time_decode_steps(model, batch, ctx, steps, &mut next_id)?;
            let mid = times[times.len() / 2].1;
            m.decode
                .push((batch, mid, median(times.iter().map(|t| t.0).collect())));
        }
    }
    let ctx = grid.mixed_context;
    for &prompt in &grid.mixed_prompts {
        for &batch in &grid.mixed_batches {
            if ctx.max(prompt) + 8 > max_ctx {
                continue;
            }
            let mut times = Vec::new();
            for r in 0..grid.repeats.max(1) {
                times.push(time_mixed_step(model, prompt, batch, ctx, r, &mut next_id)?);
            }
            m.mixed
                .push((prompt, batch, batch * (ctx + 2), median(times)));
        }
    }
    Ok(m)
}

/// Seconds one engine step takes to prefill a `len`-token prompt (variant `variant`) on a
/// fresh engine; `hook` sees each layer as a prefill node's does.
pub fn time_prefill(
    model: &LoadedModel,
    len: usize,
    variant: usize,
    hook: Option<&mut LayerHook<'_>>,
) -> Result<f64, LoadError> {
    let vocab = model.config().vocab_size;
    let mut e = engine_for(model, len.div_ceil(BLOCK) + 2, len.max(16))?;
    e.add_request(Request::greedy_fixed_length(
        SeqId(1),
        bench_prompt(len, variant, vocab),
        1,
    ))
    .map_err(engine_err)?;
    let t = Instant::now();
    match hook {
        Some(hook) => e.step_with_layer_hook(hook),
        None => e.step(),
    }
    .map_err(engine_err)?;
    Ok(t.elapsed().as_secs_f64())
}

/// Times `steps` decode steps of `batch` sequences over `ctx`-token prompts on a fresh
/// engine: each step's seconds and the context tokens it reads (step j from 1 runs each
/// sequence over `ctx + j` tokens).
pub fn time_decode_steps(
    model: &LoadedModel,
    batch: usize,
    ctx: usize,
    steps: usize,
    next_id: &mut impl FnMut() -> SeqId,
) -> Result<Vec<(f64, usize)>, LoadError> {
    let vocab = model.config().vocab_size;
    let new = steps + 2;
    let blocks = batch * (ctx + new).div_ceil(BLOCK) + 2;
    let mut e = engine_for(model, blocks, (ctx * batch).max(16))?;
    start_decoding(&mut e, batch, ctx, 0, new, vocab, next_id)?;
    let mut times = Vec::new();
    for j in 1..=steps {
        let t = Instant::now();
        e.step().map_err(engine_err)?;
        times.push((t.elapsed().as_secs_f64(), batch * (ctx + j)));
    }
    Ok(times)
}

/// Adds `batch` requests of `ctx`-token prompts (prompt variants from `first_variant`), each
/// to generate `new` tokens, and steps until every one has its first token.
fn start_decoding(
    e: &mut Engine,
    batch: usize,
    ctx: usize,
    first_variant: usize,
    new: usize,
    vocab: usize,
    next_id: &mut impl FnMut() -> SeqId,
) -> Result<(), LoadError> {
    for b in 0..batch {
        e.add_request(Request::greedy_fixed_length(
            next_id(),
            bench_prompt(ctx, first_variant + b, vocab),
            new,
        ))
        .map_err(engine_err)?;
    }
    let mut first = 0;
    while first < batch {
        first += e
            .step()
            .map_err(engine_err)?
            .iter()
            .filter(|ev| ev.index == 0)
            .count();
    }
    Ok(())
}

/// Seconds of one step that prefills a `prompt`-token prompt while `batch` sequences of
/// `ctx` prompt tokens take their second decode step (over `ctx + 2` tokens each).
fn time_mixed_step(
    model: &LoadedModel,
    prompt: usize,
    batch: usize,
    ctx: usize,
    round: usize,
    next_id: &mut impl FnMut() -> SeqId,
) -> Result<f64, LoadError> {
    let vocab = model.config().vocab_size;
    let blocks = batch * (ctx + 8).div_ceil(BLOCK) + prompt.div_ceil(BLOCK) + 4;
    let mut e = engine_for(model, blocks, (ctx * batch).max(prompt).max(16))?;
    start_decoding(&mut e, batch, ctx, round * batch, 8, vocab, next_id)?;
    e.step().map_err(engine_err)?;
    let id = next_id();
    e.add_request(Request::greedy_fixed_length(
        id,
        bench_prompt(prompt, 1_000 + round, vocab),
        2,
    ))
    .map_err(engine_err)?;
    let t = Instant::now();
    let events = e.step().map_err(engine_err)?;
    let s = t.elapsed().as_secs_f64();
    // The step must have been mixed: the prompt's first token and every decode's next.
    let prompt_done = events.iter().any(|ev| ev.seq_id == id && ev.index == 0);
    let decodes = events.iter().filter(|ev| ev.seq_id != id).count();
    if !prompt_done || decodes != batch {
        return Err(LoadError::RequestFailed {
            what: "a mixed calibration step".into(),
            reason: format!(
                "the engine split it (prompt done: {prompt_done}, {decodes} of {batch} decodes)"
            ),
        });
    }
    Ok(s)
}

/// The model's shape from its `config.json` (`dtype_bytes`: 4 for f32, 2 for bf16/f16).
pub fn model_shape(model: &str, dtype_bytes: usize) -> Result<ModelShape, LoadError> {
    let files = ModelFiles::resolve(&ModelSource::parse(model)).map_err(engine_err)?;
    let cfg = engine::config::LlamaConfig::from_file(&files.config)
        .and_then(|c| c.resolve())
        .map_err(engine_err)?;
    Ok(ModelShape {
        name: model.to_string(),
        num_layers: cfg.num_layers,
        hidden_size: cfg.hidden_size,
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        intermediate_size: cfg.intermediate_size,
        vocab_size: cfg.vocab_size,
        tie_word_embeddings: cfg.tie_word_embeddings,
        dtype_bytes,
    })
}

/// What calibration produced: the profile and how well each fit matches its measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    pub profile: CostModel,
    pub prefill_fit: Fit,
    pub decode_fit: Fit,
    /// RMS relative error of the profile on the measured mixed steps (`None`: none measured).
    pub mixed_rms_rel_error: Option<f64>,
    pub measurements: Measurements,
}

/// The work of a measured mixed step.
fn mixed_work(&(prompt, batch, context, _): &(usize, usize, usize, f64)) -> StepWork {
    let decode = StepWork::decode(batch, context);
    StepWork {
        decode_seqs: decode.decode_seqs,
        decode_context_tokens: decode.decode_context_tokens,
        ..StepWork::prefill(prompt)
    }
}

/// RMS relative error of `price` over the measured mixed steps.
fn mixed_error(
    mixed: &[(usize, usize, usize, f64)],
    price: impl Fn(&StepWork) -> f64,
) -> Option<f64> {
    if mixed.is_empty() {
        return None;
    }
    let sq: f64 = mixed
        .iter()
        .map(|m| (price(&mixed_work(m)) / m.3 - 1.0).powi(2))
        .sum();
    Some((sq / mixed.len() as f64).sqrt())
}

pub fn calibrate(
    name: &str,
    shape: ModelShape,
    m: Measurements,
    link: Link,
    node: NodeSpec,
    origin: &str,
) -> Result<Calibration, LoadError> {
    let (step, prefill_fit, decode_fit) =
        fit_cost(&prefill_samples(&m.prefill), &decode_samples(&m.decode))?;
    let mixed_rms_rel_error = mixed_error(&m.mixed, |w| step.mixed_s(w));
    let mixed_note = mixed_rms_rel_error.map_or(String::new(), |e| {
        format!(
            "; on {} mixed prefill+decode steps (not fitted) {:.1}%",
            m.mixed.len(),
            e * 100.0
        )
    });
    let mut sources = BTreeMap::new();
    sources.insert(
        "step".to_string(),
        format!(
            "least-squares fit (relative error, non-negative) of {} prefill and {} decode step times from {origin}; rms relative error {:.1}% prefill, {:.1}% decode{mixed_note}",
            m.prefill.len(),
            m.decode.len(),
            prefill_fit.rms_rel_error * 100.0,
            decode_fit.rms_rel_error * 100.0
        ),
    );
    sources.insert(
        "link".to_string(),
        "given to calibrate (--link-bandwidth-bytes-per-s, --link-latency-s); `fission bench kvtransfer` measures them".to_string(),
    );
    sources.insert(
        "node.kv_blocks".to_string(),
        "given to calibrate (--kv-blocks): match the nodes' --num-kv-blocks".to_string(),
    );
    let profile = CostModel {
        name: name.to_string(),
        description: format!("Calibrated from {origin}."),
        model: shape,
        step: StepCost::Linear(step),
        link,
        node,
        decode_step_cores: None,
        sources,
    };
    profile
        .validate(name)
        .map_err(|e| LoadError::External(Box::new(e)))?;
    Ok(Calibration {
        profile,
        prefill_fit,
        decode_fit,
        mixed_rms_rel_error,
        measurements: m,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_json_becomes_step_times() {
        let json = r#"{
            "engine": "fission", "model": "m",
            "prefill_tok_s": {"128": 1280.0, "512": 2560.0},
            "decode_single_tok_s": 50.0,
            "decode_batch_tok_s": {"1": 40.0, "8": 160.0},
            "notes": "median of 3"
        }"#;
        let m = from_bench_json(json).expect("parses");
        assert_eq!(m.prefill, vec![(128, 0.1), (512, 0.2)]);
        assert_eq!(m.decode[0], (1, 32 + 1 + 63, 0.02));
        assert!(m.decode.contains(&(8, 8 * (32 + 1 + 31), 0.05)));
        assert!(from_bench_json("{}").is_err());
    }
}
