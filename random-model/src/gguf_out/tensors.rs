//! The checkpoint's tensors as the converter writes them: in the safetensors file's (sorted)
//! order, under llama.cpp's names, with its per-architecture changes.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use gguf::{Arch, ExpertPart, Target};

use super::container::{OutTensor, Stored};
use super::meta::Hparams;

/// llama.cpp's names of a layer's tensors, `blk.N.<part>.weight`, for the `gguf` crate's
/// table ([`Arch::target`]) to be read backwards.
const LAYER_PARTS: &[&str] = &[
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_qkv",
    "attn_output",
    "attn_q_norm",
    "attn_k_norm",
    "post_attention_norm",
    "ffn_norm",
    "post_ffw_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_gate_inp",
];
const WHOLE: &[&str] = &["token_embd.weight", "output_norm.weight", "output.weight"];
const EXPERT_PARTS: [(ExpertPart, &str); 3] = [
    (ExpertPart::Gate, "ffn_gate_exps"),
    (ExpertPart::Up, "ffn_up_exps"),
    (ExpertPart::Down, "ffn_down_exps"),
];

/// llama.cpp's name for the transformers tensor `hf`; `None` for one the converter drops
/// (Gemma 2's `lm_head`: llama.cpp ties it).
fn gguf_name(arch: Arch, hf: &str) -> Option<String> {
    let is = |cand: &str| arch.target(cand) == Some(Target::One(hf.to_string()));
    if let Some(w) = WHOLE.iter().find(|w| is(w)) {
        return Some(w.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let suffix = rest.rsplit_once('.')?.1;
    LAYER_PARTS
        .iter()
        .map(|p| format!("blk.{layer}.{p}.{suffix}"))
        .find(|cand| is(cand))
}

/// `(layer, expert, part)` when `hf` is one expert's projection.
fn expert_of(arch: Arch, hf: &str, experts: usize) -> Option<(usize, usize, ExpertPart)> {
    let layer: usize = hf
        .strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()?;
    (0..experts).find_map(|e| {
        EXPERT_PARTS
            .iter()
            .find(|(p, _)| arch.expert_name(layer, *p, e) == hf)
            .map(|(p, _)| (layer, e, *p))
    })
}

/// llama.cpp's rope layout for Llama-family q and k rows: within each head, the two halves
/// interleaved (`LlamaModel.permute` in the converter).
fn permute(t: &Tensor, n_head: usize) -> anyhow::Result<Tensor> {
    let (rows, cols) = t.dims2()?;
    Ok(t.reshape((n_head, 2, rows / n_head / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

fn out(name: String, t: &Tensor) -> anyhow::Result<OutTensor> {
    Ok(OutTensor {
        name,
        shape: t.dims().to_vec(),
        values: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
        stored: Stored::F32,
    })
}

fn factors(hp: &Hparams, key: &str) -> anyhow::Result<Vec<f32>> {
    hp.cfg["rope_scaling"][key]
        .as_array()
        .with_context(|| format!("rope_scaling.{key}"))?
        .iter()
        .map(|x| x.as_f64().map(|x| x as f32).context("a rope factor"))
        .collect()
}

pub(crate) fn convert(dir: &Path, hp: &Hparams) -> anyhow::Result<Vec<OutTensor>> {
    let path = dir.join("model.safetensors");
    let tensors: BTreeMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)
        .with_context(|| format!("reading {}", path.display()))?
        .into_iter()
        .collect();
    let arch = hp.arch;
    let mut result = Vec::new();
    if hp.longrope() {
        // The converter's extra tensors come first.
        for (name, key) in [
            ("rope_factors_long.weight", "long_factor"),
            ("rope_factors_short.weight", "short_factor"),
        ] {
            let v = factors(hp, key)?;
            result.push(OutTensor {
                name: name.to_string(),
                shape: vec![v.len()],
                values: v,
                stored: Stored::F32,
            });
        }
    }
    let experts = hp.experts.unwrap_or(0);
    let mut pending: BTreeMap<(usize, usize, String), Tensor> = BTreeMap::new();
    for (hf, t) in &tensors {
        if let Some((layer, e, part)) = expert_of(arch, hf, experts) {
            let p = EXPERT_PARTS
                .iter()
                .position(|(q, _)| *q == part)
                .unwrap_or(0);
            pending.insert((layer, p, format!("{e:09}")), t.clone());
            let done = pending.keys().filter(|k| k.0 == layer).count();
            if done == 3 * experts {
                // Stacked as each comes complete, the projections in the checkpoint's name
                // order (Mixtral's w1, w2, w3; Qwen's down, gate, up).
                let mut parts: Vec<(String, usize)> = (0..3)
                    .map(|p| (arch.expert_name(layer, EXPERT_PARTS[p].0, 0), p))
                    .collect();
                parts.sort();
                for (_, p) in parts {
                    let stack: Vec<Tensor> = pending
                        .iter()
                        .filter(|(k, _)| k.0 == layer && k.1 == p)
                        .map(|(_, t)| t.clone())
                        .collect();
                    let name = format!("blk.{layer}.{}.weight", EXPERT_PARTS[p].1);
                    let want = Target::Experts {
                        layer,
                        part: EXPERT_PARTS[p].0,
                    };
                    if arch.target(&name) != Some(want) {
                        bail!("{name}: not an expert tensor of {arch:?}");
                    }
                    result.push(out(name, &Tensor::stack(&stack, 0)?)?);
                }
                pending.retain(|k, _| k.0 != layer);
            }
            continue;
        }
        let Some(name) = gguf_name(arch, hf) else {
            if hf == "lm_head.weight" && arch == Arch::Gemma2 {
                continue;
            }
            bail!("{hf}: no llama.cpp name for {arch:?}");
        };
        let mut t = t.to_dtype(DType::F32)?;
        if arch.permutes_qk() && hf.ends_with("self_attn.q_proj.weight") {
            t = permute(&t, hp.heads)?;
        } else if arch.permutes_qk() && hf.ends_with("self_attn.k_proj.weight") {
            t = permute(&t, hp.kv_heads)?;
        }
        if arch.norms_store_one_plus() && hf.ends_with("norm.weight") {
            t = (t + 1.0)?;
        }
        result.push(out(name, &t)?);
    }
    if !pending.is_empty() {
        bail!("{}: a layer's experts are incomplete", path.display());
    }
    Ok(result)
}
