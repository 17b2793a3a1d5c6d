//! The metadata keys llama.cpp's converter writes for each architecture, in its order, and
//! where llama-quantize moves the quantisation keys.

use anyhow::{bail, Context};
use gguf::Arch;
use serde_json::Value as Json;

use super::container::{OutTensor, Value};
use super::vocab::Vocab;
use super::{GgufOptions, GgufType, Quantizer};

/// GGML_FTYPE: all F32, mostly Q8_0.
const FILE_TYPE_F32: u32 = 0;
const FILE_TYPE_Q8_0: u32 = 7;
const QUANTIZATION_VERSION: u32 = 2;

/// What the converter reads from config.json.
pub(crate) struct Hparams {
    pub arch: Arch,
    pub cfg: Json,
    pub layers: u32,
    pub hidden: u32,
    pub ffn: u32,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: u32,
    pub vocab: u32,
    pub max_pos: u32,
    pub eps: f32,
    pub experts: Option<usize>,
}

fn arch_of(class: &str) -> anyhow::Result<Arch> {
    if class == "MistralForCausalLM" {
        return Ok(Arch::Llama);
    }
    [
        Arch::Llama,
        Arch::Mixtral,
        Arch::Qwen3Moe,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::Phi3,
    ]
    .into_iter()
    .find(|a| a.hf_class() == class)
    .with_context(|| format!("the GGUF writer does not write {class}"))
}

impl Hparams {
    pub(crate) fn from_config(cfg: &Json) -> anyhow::Result<Self> {
        let class = cfg["architectures"][0]
            .as_str()
            .context("config.json names no architecture")?;
        let u = |k: &str| -> anyhow::Result<u32> {
            cfg[k]
                .as_u64()
                .map(|v| v as u32)
                .with_context(|| format!("config.json has no {k}"))
        };
        let (hidden, heads) = (u("hidden_size")?, u("num_attention_heads")?);
        Ok(Self {
            arch: arch_of(class)?,
            layers: u("num_hidden_layers")?,
            ffn: u("intermediate_size")?,
            kv_heads: cfg["num_key_value_heads"].as_u64().unwrap_or(heads as u64) as usize,
            head_dim: cfg["head_dim"]
                .as_u64()
                .map_or(hidden / heads, |v| v as u32),
            vocab: u("vocab_size")?,
            max_pos: u("max_position_embeddings")?,
            eps: cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
            experts: cfg["num_local_experts"]
                .as_u64()
                .or(cfg["num_experts"].as_u64())
                .map(|v| v as usize),
            hidden,
            heads: heads as usize,
            cfg: cfg.clone(),
        })
    }

    pub(crate) fn longrope(&self) -> bool {
        self.arch == Arch::Phi3
            && matches!(
                self.cfg["rope_scaling"]["type"]
                    .as_str()
                    .or(self.cfg["rope_scaling"]["rope_type"].as_str()),
                Some("longrope")
            )
    }

    fn f32(&self, k: &str) -> Option<f32> {
        self.cfg[k].as_f64().map(|v| v as f32)
    }

    fn u32(&self, k: &str) -> Option<u32> {
        self.cfg[k].as_u64().map(|v| v as u32)
    }
}

/// `general.name` and friends from the model directory's name, as the converter derives
/// them: `tiny-random-2` is `Tiny Random 2`, version `2`, basename `tiny-random`; a name
/// without a trailing version is kept as it is.
fn naming(dir_name: &str) -> Vec<(String, Value)> {
    let s = |v: &str| Value::Str(v.to_string());
    match dir_name.rsplit_once('-') {
        Some((base, version))
            if !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit()) =>
        {
            let words: Vec<String> = base
                .split('-')
                .map(|w| {
                    let mut c = w.chars();
                    c.next()
                        .map(|f| f.to_uppercase().chain(c).collect())
                        .unwrap_or_default()
                })
                .collect();
            vec![
                (
                    "general.name".into(),
                    s(&format!("{} {version}", words.join(" "))),
                ),
                ("general.version".into(), s(version)),
                ("general.basename".into(), s(base)),
            ]
        }
        _ => vec![("general.name".into(), s(dir_name))],
    }
}

/// gguf-py's `size_label`: parameters in thousands (or M, B), at least two digits; a
/// mixture's as `{experts}x{one expert's model}`.
fn size_label(tensors: &[OutTensor]) -> String {
    let (mut total, mut shared, mut expert) = (0u64, 0u64, 0u64);
    let (mut expert_sum, mut expert_tensors) = (0u64, 0u64);
    for t in tensors {
        let size: u64 = t.shape.iter().map(|&d| d as u64).product();
        if t.name.contains("_exps.") && t.shape.len() >= 3 {
            let e = t.shape[0] as u64;
            expert += size / e;
            expert_sum += e;
            expert_tensors += 1;
        } else {
            shared += size;
        }
        total += size;
    }
    let rounded = |n: u64| {
        let n = n as f64;
        let (scaled, suffix) = match n {
            n if n > 1e12 => (n * 1e-12, "T"),
            n if n > 1e9 => (n * 1e-9, "B"),
            n if n > 1e6 => (n * 1e-6, "M"),
            n => (n * 1e-3, "K"),
        };
        let digits = format!("{}", scaled.round_ties_even() as u64)
            .trim_start_matches('0')
            .len();
        format!("{scaled:.*}{suffix}", 2usize.saturating_sub(digits))
    };
    match expert_sum.checked_div(expert_tensors) {
        Some(experts) => format!("{experts}x{}", rounded(shared + expert)),
        None => rounded(total),
    }
}

/// Every key, in the order the file holds them.
pub(crate) fn metadata(
    hp: &Hparams,
    opts: &GgufOptions,
    tensors: &[OutTensor],
    vocab: &Vocab,
) -> anyhow::Result<Vec<(String, Value)>> {
    let a = hp.arch.gguf_name();
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: Value| kv.push((k.replace("{a}", a), v));
    let file_type = match (opts.ty, opts.quantizer) {
        (GgufType::Q8_0, Quantizer::Converter) => FILE_TYPE_Q8_0,
        _ => FILE_TYPE_F32,
    };
    put("general.architecture", Value::Str(a.to_string()));
    let longrope = hp.longrope();
    if longrope {
        let orig = hp.u32("original_max_position_embeddings").unwrap_or(4096) as f64;
        let scale = hp.max_pos as f64 / orig;
        let factor = if scale <= 1.0 {
            1.0
        } else {
            (1.0 + scale.ln() / orig.ln()).sqrt()
        };
        put("{a}.rope.scaling.attn_factor", Value::F32(factor as f32));
    }
    put("general.type", Value::Str("model".into()));
    for (k, v) in naming(&opts.dir_name) {
        put(&k, v);
    }
    put("general.size_label", Value::Str(size_label(tensors)));
    let u = Value::U32;
    let head_dim = u(hp.head_dim);
    let rope_theta = hp.f32("rope_theta");
    match hp.arch {
        Arch::Llama | Arch::Mixtral | Arch::Qwen3Moe => {
            put("{a}.block_count", u(hp.layers));
            put("{a}.context_length", u(hp.max_pos));
            put("{a}.embedding_length", u(hp.hidden));
            put("{a}.feed_forward_length", u(hp.ffn));
            put("{a}.attention.head_count", u(hp.heads as u32));
            put("{a}.attention.head_count_kv", u(hp.kv_heads as u32));
            if let Some(t) = rope_theta {
                put("{a}.rope.freq_base", Value::F32(t));
            }
            put("{a}.attention.layer_norm_rms_epsilon", Value::F32(hp.eps));
            if let Some(e) = hp.experts {
                put("{a}.expert_count", u(e as u32));
                let used = hp
                    .u32("num_experts_per_tok")
                    .context("num_experts_per_tok")?;
                put("{a}.expert_used_count", u(used));
            }
            put("{a}.attention.key_length", head_dim.clone());
            put("{a}.attention.value_length", head_dim.clone());
            put("general.file_type", u(file_type));
            if hp.arch == Arch::Qwen3Moe {
                let f = hp
                    .u32("moe_intermediate_size")
                    .context("moe_intermediate_size")?;
                put("{a}.expert_feed_forward_length", u(f));
            } else {
                put("{a}.vocab_size", u(hp.vocab));
                put("{a}.rope.dimension_count", head_dim);
            }
        }
        Arch::Gemma2 => {
            put("{a}.context_length", u(hp.max_pos));
            put("{a}.embedding_length", u(hp.hidden));
            put("{a}.block_count", u(hp.layers));
            put("{a}.feed_forward_length", u(hp.ffn));
            put("{a}.attention.head_count", u(hp.heads as u32));
            put("{a}.attention.head_count_kv", u(hp.kv_heads as u32));
            put("{a}.attention.layer_norm_rms_epsilon", Value::F32(hp.eps));
            put("{a}.attention.key_length", head_dim.clone());
            put("{a}.attention.value_length", head_dim);
            put("general.file_type", u(file_type));
            for k in ["attn_logit_softcapping", "final_logit_softcapping"] {
                let v = hp
                    .f32(k)
                    .with_context(|| format!("config.json has no {k}"))?;
                put(&format!("{{a}}.{k}"), Value::F32(v));
            }
            let w = hp.u32("sliding_window").context("sliding_window")?;
            put("{a}.attention.sliding_window", u(w));
        }
        Arch::Gemma3 => {
            put("{a}.block_count", u(hp.layers));
            put("{a}.context_length", u(hp.max_pos));
            put("{a}.embedding_length", u(hp.hidden));
            put("{a}.feed_forward_length", u(hp.ffn));
            put("{a}.attention.head_count", u(hp.heads as u32));
            put("{a}.attention.head_count_kv", u(hp.kv_heads as u32));
            put("{a}.rope.freq_base", Value::F32(rope_theta.unwrap_or(1e6)));
            if let Some(f) = hp.f32("rope_local_base_freq") {
                put("{a}.rope.freq_base_swa", Value::F32(f));
            }
            put("{a}.attention.layer_norm_rms_epsilon", Value::F32(hp.eps));
            put("{a}.attention.key_length", head_dim.clone());
            put("{a}.attention.value_length", head_dim);
            put("general.file_type", u(file_type));
            let w = hp.u32("sliding_window").context("sliding_window")?;
            put("{a}.attention.sliding_window", u(w));
        }
        Arch::Phi3 => {
            put("{a}.context_length", u(hp.max_pos));
            // Phi3Config's default when config.json has none.
            let orig = hp.u32("original_max_position_embeddings").unwrap_or(4096);
            put("{a}.rope.scaling.original_context_length", u(orig));
            put("{a}.embedding_length", u(hp.hidden));
            put("{a}.feed_forward_length", u(hp.ffn));
            put("{a}.block_count", u(hp.layers));
            put("{a}.attention.head_count", u(hp.heads as u32));
            put("{a}.attention.head_count_kv", u(hp.kv_heads as u32));
            put("{a}.attention.layer_norm_rms_epsilon", Value::F32(hp.eps));
            let partial = hp.cfg["partial_rotary_factor"].as_f64().unwrap_or(1.0);
            let rot = (hp.head_dim as f64 * partial) as u32;
            put("{a}.rope.dimension_count", u(rot));
            put("{a}.rope.freq_base", Value::F32(rope_theta.unwrap_or(1e4)));
            put("general.file_type", u(file_type));
            put(
                "{a}.attention.sliding_window",
                u(hp.u32("sliding_window").unwrap_or(0)),
            );
        }
        other => bail!("the GGUF writer does not write {other:?}"),
    }
    put("general.quantization_version", u(QUANTIZATION_VERSION));
    put("tokenizer.ggml.model", Value::Str("llama".into()));
    put("tokenizer.ggml.pre", Value::Str("default".into()));
    put("tokenizer.ggml.tokens", Value::Strs(vocab.tokens.clone()));
    put("tokenizer.ggml.scores", Value::F32s(vocab.scores.clone()));
    put(
        "tokenizer.ggml.token_type",
        Value::I32s(vocab.types.clone()),
    );
    for (k, id) in [
        ("bos_token_id", vocab.bos),
        ("eos_token_id", vocab.eos),
        ("unknown_token_id", vocab.unk),
    ] {
        if let Some(id) = id {
            put(&format!("tokenizer.ggml.{k}"), u(id));
        }
    }
    put("tokenizer.ggml.add_bos_token", Value::Bool(vocab.add_bos));
    // The tokenizer's template adds no separator.
    put("tokenizer.ggml.add_sep_token", Value::Bool(false));
    put("tokenizer.ggml.add_eos_token", Value::Bool(vocab.add_eos));
    if let Some(t) = &vocab.chat_template {
        put("tokenizer.chat_template", Value::Str(t.clone()));
        if matches!(hp.arch, Arch::Gemma2 | Arch::Gemma3) {
            put("tokenizer.ggml.add_space_prefix", Value::Bool(false));
        }
    }
    if (opts.ty, opts.quantizer) == (GgufType::Q8_0, Quantizer::LlamaQuantize) {
        // llama-quantize copies the keys, then sets these two again: last.
        kv.retain(|(k, _)| k != "general.quantization_version" && k != "general.file_type");
        kv.push((
            "general.quantization_version".into(),
            Value::U32(QUANTIZATION_VERSION),
        ));
        kv.push(("general.file_type".into(), Value::U32(FILE_TYPE_Q8_0)));
    }
    Ok(kv)
}
