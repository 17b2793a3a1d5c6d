//! `fission make-random-model`: a random-weight Llama in a known shape, with a tokenizer padded to
//! its vocab so every id decodes. Benchmarks use it; it is never committed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::{Device, Tensor};
use clap::{Args, ValueEnum};
use serde_json::json;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Shape {
    /// 30 layers, hidden 576, 9/3 heads, FFN 1536, vocab 49152, tied embeddings.
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    /// 16 layers, hidden 2048, 32/8 heads, FFN 8192, vocab 128256, tied, bf16 (GPU benchmarks).
    #[value(name = "llama-3.2-1b")]
    Llama32_1b,
    /// 2 layers, hidden 64, 4/2 heads: fast tests.
    #[value(name = "tiny")]
    Tiny,
}

#[derive(Args, Debug)]
pub struct RandomModelArgs {
    #[arg(long, value_enum)]
    pub shape: Shape,
    #[arg(long)]
    pub out: PathBuf,
    /// Directory whose tokenizer is copied and padded to the model's vocab.
    #[arg(
        long,
        env = "FISSION_TOKENIZER_FROM",
        default_value = "../shared/models/stories260K"
    )]
    pub tokenizer_from: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

struct Dims {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
    vocab: usize,
    max_pos: usize,
    rope_theta: f64,
    dtype: &'static str,
}

fn dims(shape: Shape) -> Dims {
    match shape {
        Shape::Smollm2_135m => Dims {
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            ffn: 1536,
            vocab: 49152,
            max_pos: 8192,
            rope_theta: 100_000.0,
            dtype: "float32",
        },
        Shape::Llama32_1b => Dims {
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            ffn: 8192,
            vocab: 128_256,
            max_pos: 131_072,
            rope_theta: 500_000.0,
            dtype: "bfloat16",
        },
        Shape::Tiny => Dims {
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            vocab: 512,
            max_pos: 1024,
            rope_theta: 10_000.0,
            dtype: "float32",
        },
    }
}

pub fn run(args: RandomModelArgs) -> anyhow::Result<()> {
    let d = dims(args.shape);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    write_config(&args.out, &d)?;
    write_weights(&args.out, &d, args.seed)?;
    pad_tokenizer(&args.tokenizer_from, &args.out, d.vocab)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

fn write_config(out: &Path, d: &Dims) -> anyhow::Result<()> {
    let cfg = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.ffn,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "head_dim": d.hidden / d.heads,
        "max_position_embeddings": d.max_pos,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": d.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": d.dtype,
    });
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    std::fs::write(
        out.join("generation_config.json"),
        serde_json::to_string_pretty(
            &json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false}),
        )?,
    )?;
    Ok(())
}

/// splitmix64: a seeded stream, so the same seed always writes the same model.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Approximately normal (Irwin-Hall of 4 uniforms), which is plenty for benchmark weights.
    fn normal(&mut self, std: f32) -> f32 {
        let mut s = 0.0f32;
        for _ in 0..2 {
            let r = self.next_u64();
            s += (r as u32) as f32 / u32::MAX as f32;
            s += ((r >> 32) as u32) as f32 / u32::MAX as f32;
        }
        (s - 2.0) * std * 1.732
    }
}

fn write_weights(out: &Path, d: &Dims, seed: u64) -> anyhow::Result<()> {
    let mut rng = Rng(seed ^ 0x5EED);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let dtype = if d.dtype == "bfloat16" {
        candle_core::DType::BF16
    } else {
        candle_core::DType::F32
    };
    let mut randn = |shape: (usize, usize)| -> anyhow::Result<Tensor> {
        let v: Vec<f32> = (0..shape.0 * shape.1).map(|_| rng.normal(0.02)).collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
    };
    let ones = |n: usize| -> anyhow::Result<Tensor> {
        Ok(Tensor::ones(n, candle_core::DType::F32, &Device::Cpu)?.to_dtype(dtype)?)
    };
    let hd = d.hidden / d.heads;
    tensors.insert(
        "model.embed_tokens.weight".into(),
        randn((d.vocab, d.hidden))?,
    );
    tensors.insert("model.norm.weight".into(), ones(d.hidden)?);
    for i in 0..d.layers {
        let p = format!("model.layers.{i}");
        tensors.insert(format!("{p}.input_layernorm.weight"), ones(d.hidden)?);
        tensors.insert(
            format!("{p}.post_attention_layernorm.weight"),
            ones(d.hidden)?,
        );
        tensors.insert(
            format!("{p}.self_attn.q_proj.weight"),
            randn((d.heads * hd, d.hidden))?,
        );
        tensors.insert(
            format!("{p}.self_attn.k_proj.weight"),
            randn((d.kv_heads * hd, d.hidden))?,
        );
        tensors.insert(
            format!("{p}.self_attn.v_proj.weight"),
            randn((d.kv_heads * hd, d.hidden))?,
        );
        tensors.insert(
            format!("{p}.self_attn.o_proj.weight"),
            randn((d.hidden, d.heads * hd))?,
        );
        tensors.insert(
            format!("{p}.mlp.gate_proj.weight"),
            randn((d.ffn, d.hidden))?,
        );
        tensors.insert(format!("{p}.mlp.up_proj.weight"), randn((d.ffn, d.hidden))?);
        tensors.insert(
            format!("{p}.mlp.down_proj.weight"),
            randn((d.hidden, d.ffn))?,
        );
    }
    candle_core::safetensors::save(&tensors, out.join("model.safetensors"))?;
    Ok(())
}

/// Copies the source tokenizer and adds `<extra_N>` tokens up to `vocab`, so any id decodes.
fn pad_tokenizer(from: &Path, out: &Path, vocab: usize) -> anyhow::Result<()> {
    let src = from.join("tokenizer.json");
    let text =
        std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
    let mut tok: serde_json::Value = serde_json::from_str(&text)?;
    let base = tok["model"]["vocab"]
        .as_object()
        .map(|v| v.len())
        .context("tokenizer.json has no model.vocab")?;
    let added = tok["added_tokens"]
        .as_array_mut()
        .context("tokenizer.json has no added_tokens")?;
    let mut next = base.max(
        added
            .iter()
            .filter_map(|t| t["id"].as_u64())
            .max()
            .map_or(0, |m| m as usize + 1),
    );
    while next < vocab {
        added.push(json!({
            "id": next, "content": format!("<extra_{next}>"), "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false
        }));
        next += 1;
    }
    std::fs::write(out.join("tokenizer.json"), serde_json::to_string(&tok)?)?;
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
    ] {
        if from.join(f).is_file() {
            std::fs::copy(from.join(f), out.join(f))?;
        }
    }
    Ok(())
}
