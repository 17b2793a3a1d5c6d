//! Random-weight Llama-family models: a [`ModelSpec`] in, a model directory out (config.json,
//! generation_config.json, model.safetensors and a tokenizer padded to the vocab), in the layout
//! transformers loads. Weights come from a seeded splitmix64 stream, so one spec always writes
//! bit-identical files; the engine's architecture tests rely on that to regenerate the models
//! their committed transformers references were computed from.
//!
//! `fission make-random-model` writes benchmark models with it, and the engine's tests build
//! the models they load with it; it depends on nothing of Fission's, so the engine's tests do
//! not check the loader against itself, except [`gguf_out`], which writes GGUF files with the
//! `gguf` crate's name table read backwards and is held to llama.cpp's own files byte for byte.
//! Tooling, not a serving path: its errors are `anyhow`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{ensure, Context};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub mod gguf_out;
mod moe;
mod tokenizer;

pub use moe::MoeSpec;
use tokenizer::pad_tokenizer;

/// RMSNorm epsilon written to every config.
pub const RMS_NORM_EPS: f64 = 1e-5;
/// Standard deviation of q/k/v biases: large enough that a model which drops them gives visibly
/// different logits.
pub const BIAS_STD: f32 = 0.5;

/// Standard deviation of Qwen3's per-head q/k norm weights around 1: wider than the layer
/// norms' so that the per-head scaling visibly shapes attention, and a model that skips it
/// greedily picks different tokens.
pub const QK_NORM_STD: f32 = 0.3;

/// Which transformers class the config names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    #[serde(rename = "LlamaForCausalLM")]
    Llama,
    #[serde(rename = "MistralForCausalLM")]
    Mistral,
    #[serde(rename = "Qwen2ForCausalLM")]
    Qwen2,
    /// Dense Qwen3: per-head RMSNorm on q and k, biases only if `attention_bias` says.
    #[serde(rename = "Qwen3ForCausalLM")]
    Qwen3,
    /// Gemma 2: `(1 + w)` norms, four norms a layer, tanh-GELU, scaled embeddings,
    /// soft-capping, sliding layers alternating with global ones.
    #[serde(rename = "Gemma2ForCausalLM")]
    Gemma2,
    /// Gemma 3 text: Gemma 2's layer with q/k norms, a local rope base for its sliding layers
    /// and `sliding_window_pattern`.
    #[serde(rename = "Gemma3ForCausalLM")]
    Gemma3,
    /// Phi-3 / Phi-4-mini: Llama's layer, its q/k/v and gate/up stored fused
    /// (`qkv_proj`, `gate_up_proj`), optionally partial rotary and LongRoPE.
    #[serde(rename = "Phi3ForCausalLM")]
    Phi3,
    /// Mistral's layer with a mixture of experts for its MLP (`moe` in the spec).
    #[serde(rename = "MixtralForCausalLM")]
    Mixtral,
    /// Qwen3's layer with a mixture of experts in its sparse layers (`moe` in the spec).
    #[serde(rename = "Qwen3MoeForCausalLM")]
    Qwen3Moe,
}

impl Architecture {
    pub fn class_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Phi3 => "phi3",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }

    fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }
}

/// The dtype the weights are stored in (and that config.json's `torch_dtype` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightDtype {
    #[serde(rename = "float32")]
    F32,
    #[serde(rename = "bfloat16")]
    BF16,
    #[serde(rename = "float16")]
    F16,
}

impl WeightDtype {
    pub fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::BF16 => "bfloat16",
            WeightDtype::F16 => "float16",
        }
    }

    fn candle(self) -> DType {
        match self {
            WeightDtype::F32 => DType::F32,
            WeightDtype::BF16 => DType::BF16,
            WeightDtype::F16 => DType::F16,
        }
    }
}

/// Where config.json keeps the rotary settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeLayout {
    /// Top-level `rope_theta` and `rope_scaling` (transformers 4).
    #[default]
    TopLevel,
    /// One `rope_parameters` object holding `rope_theta` and the scaling, with no top-level
    /// `rope_theta` (transformers 5).
    RopeParameters,
}

/// Everything that decides a random model's files. Serializes to the JSON that
/// `fission make-random-model --spec-json` reads and that `engine/tests/reference/arch_refs.json`
/// records per variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub architecture: Architecture,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// Per-head size; may differ from `hidden / heads`.
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub max_pos: usize,
    pub rope_theta: f64,
    /// transformers' scaling object, for example `{"rope_type": "linear", "factor": 2.0}`.
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub rope_layout: RopeLayout,
    /// q/k/v biases. Qwen2 always has them and Mistral never; Llama's and Qwen3's configs say.
    pub attention_bias: bool,
    /// When false the model gets its own random `lm_head.weight`.
    pub tie_word_embeddings: bool,
    /// Mistral (every layer) and Gemma (its sliding layers); `None` means full attention.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Gemma: the attention scale is this to the power -0.5.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<u64>,
    /// Gemma: attention-logit soft-capping (written as null when `None`).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma: final-logit soft-capping (written as null when `None`).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 3: every n-th layer is global (config.json's `sliding_window_pattern`).
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3: the sliding layers' rope base.
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    /// Phi-3: the fraction of each head that rope rotates (config.json's
    /// `partial_rotary_factor`).
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Phi-3: the pretraining context LongRoPE switches factors at, written top-level as
    /// Phi-3's configs do.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// Mixtral and Qwen3-MoE: the experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeSpec>,
    pub dtype: WeightDtype,
    /// Standard deviation of embedding and projection weights. Norm weights are
    /// `1 + N(0, init_std)`.
    pub init_std: f32,
    pub seed: u64,
}

impl ModelSpec {
    /// 30 layers, hidden 576, 9/3 heads, FFN 1536, vocab 49152, tied embeddings, f32.
    pub fn smollm2_135m() -> Self {
        ModelSpec {
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            ffn: 1536,
            vocab: 49152,
            max_pos: 8192,
            rope_theta: 100_000.0,
            ..Self::tiny()
        }
    }

    /// 16 layers, hidden 2048, 32/8 heads, FFN 8192, vocab 128256, tied, bf16 (GPU benchmarks).
    /// Plain rope: benchmarks do not need Llama 3's frequency scaling.
    pub fn llama32_1b() -> Self {
        ModelSpec {
            hidden: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            vocab: 128_256,
            max_pos: 131_072,
            rope_theta: 500_000.0,
            dtype: WeightDtype::BF16,
            ..Self::tiny()
        }
    }

    /// 2 layers, hidden 64, 4/2 heads, FFN 128, vocab 512 (stories260K's tokenizer), f32.
    pub fn tiny() -> Self {
        ModelSpec {
            architecture: Architecture::Llama,
            hidden: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 512,
            max_pos: 1024,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_layout: RopeLayout::TopLevel,
            attention_bias: false,
            tie_word_embeddings: true,
            sliding_window: None,
            query_pre_attn_scalar: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            sliding_window_pattern: None,
            rope_local_base_freq: None,
            partial_rotary_factor: None,
            original_max_position_embeddings: None,
            moe: None,
            dtype: WeightDtype::F32,
            init_std: 0.02,
            seed: 0,
        }
    }

    /// Rejects specs transformers would load differently from what the files say.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (name, v) in [
            ("hidden", self.hidden),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
            ("vocab", self.vocab),
            ("max_pos", self.max_pos),
        ] {
            ensure!(v > 0, "{name} must be > 0, given {v}");
        }
        ensure!(
            self.heads.is_multiple_of(self.kv_heads),
            "heads {} is not a multiple of kv_heads {}",
            self.heads,
            self.kv_heads
        );
        ensure!(
            self.head_dim > 0 && self.head_dim.is_multiple_of(2),
            "head_dim must be even and > 0, given {}",
            self.head_dim
        );
        match self.architecture {
            Architecture::Qwen2 => ensure!(
                self.attention_bias,
                "Qwen2ForCausalLM always has q/k/v biases: attention_bias must be true"
            ),
            Architecture::Mistral => ensure!(
                !self.attention_bias,
                "MistralForCausalLM has no attention biases: attention_bias must be false"
            ),
            Architecture::Llama | Architecture::Qwen3 => {}
            Architecture::Mixtral | Architecture::Qwen3Moe => ensure!(
                self.moe.is_some(),
                "{} specs give moe",
                self.architecture.class_name()
            ),
            Architecture::Phi3 => ensure!(
                !self.attention_bias,
                "Phi3ForCausalLM has no attention biases: attention_bias must be false"
            ),
            Architecture::Gemma2 | Architecture::Gemma3 => {
                ensure!(
                    !self.attention_bias,
                    "Gemma has no attention biases: attention_bias must be false"
                );
                ensure!(
                    self.hidden.is_multiple_of(self.heads),
                    "Gemma's config needs hidden {} to be a multiple of heads {}",
                    self.hidden,
                    self.heads
                );
                ensure!(
                    self.sliding_window.is_some() && self.query_pre_attn_scalar.is_some(),
                    "Gemma specs give sliding_window and query_pre_attn_scalar"
                );
            }
        }
        if let Some(w) = self.sliding_window {
            ensure!(
                matches!(
                    self.architecture,
                    Architecture::Mistral
                        | Architecture::Gemma2
                        | Architecture::Gemma3
                        | Architecture::Phi3
                        | Architecture::Mixtral
                ),
                "sliding_window {w} is only written for Mistral, Mixtral, Gemma and Phi-3"
            );
        }
        let gemma_only = [
            (
                "query_pre_attn_scalar",
                self.query_pre_attn_scalar.is_some(),
            ),
            (
                "attn_logit_softcapping",
                self.attn_logit_softcapping.is_some(),
            ),
            (
                "final_logit_softcapping",
                self.final_logit_softcapping.is_some(),
            ),
        ];
        for (field, given) in gemma_only {
            ensure!(
                !given || self.architecture.is_gemma(),
                "{field} is only written for Gemma"
            );
        }
        for (field, given) in [
            (
                "sliding_window_pattern",
                self.sliding_window_pattern.is_some(),
            ),
            ("rope_local_base_freq", self.rope_local_base_freq.is_some()),
        ] {
            ensure!(
                !given || self.architecture == Architecture::Gemma3,
                "{field} is only written for Gemma3ForCausalLM"
            );
        }
        for (field, given) in [
            (
                "partial_rotary_factor",
                self.partial_rotary_factor.is_some(),
            ),
            (
                "original_max_position_embeddings",
                self.original_max_position_embeddings.is_some(),
            ),
        ] {
            ensure!(
                !given || self.architecture == Architecture::Phi3,
                "{field} is only written for Phi3ForCausalLM"
            );
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.architecture)?;
        }
        if let Some(s) = &self.rope_scaling {
            ensure!(
                s.is_object(),
                "rope_scaling must be a JSON object, given {s}"
            );
        }
        ensure!(
            self.init_std.is_finite() && self.init_std > 0.0,
            "init_std must be > 0, given {}",
            self.init_std
        );
        Ok(())
    }
}

/// Writes the model `spec` describes into `dir` (created if needed), with the tokenizer from
/// `tokenizer_from` padded with `<extra_N>` tokens up to the vocab so every id decodes.
pub fn write_model(dir: &Path, spec: &ModelSpec, tokenizer_from: &Path) -> anyhow::Result<()> {
    spec.validate()?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // The tokenizer first: a bad --tokenizer-from fails before minutes of weight writing.
    pad_tokenizer(tokenizer_from, dir, spec.vocab)?;
    write_json(&dir.join("config.json"), &config_json(spec))?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"bos_token_id": 1, "eos_token_id": 2, "do_sample": false}),
    )?;
    write_weights(dir, spec)
}

/// The config.json for `spec`, in the shape the named transformers class expects.
pub fn config_json(spec: &ModelSpec) -> Value {
    let mut cfg = json!({
        "architectures": [spec.architecture.class_name()],
        "model_type": spec.architecture.model_type(),
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_pos,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_NORM_EPS,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": spec.dtype.torch_name(),
    });
    let obj = cfg
        .as_object_mut()
        .expect("a json! object literal is an object");
    match spec.rope_layout {
        RopeLayout::TopLevel => {
            obj.insert("rope_theta".into(), json!(spec.rope_theta));
            obj.insert(
                "rope_scaling".into(),
                spec.rope_scaling.clone().unwrap_or(Value::Null),
            );
        }
        RopeLayout::RopeParameters => {
            let mut params = spec
                .rope_scaling
                .clone()
                .unwrap_or_else(|| json!({"rope_type": "default"}));
            params["rope_theta"] = json!(spec.rope_theta);
            obj.insert("rope_parameters".into(), params);
        }
    }
    match spec.architecture {
        Architecture::Llama => {
            obj.insert("attention_bias".into(), json!(spec.attention_bias));
            obj.insert("mlp_bias".into(), json!(false));
        }
        Architecture::Mistral => {
            obj.insert("sliding_window".into(), json!(spec.sliding_window));
        }
        Architecture::Qwen2 => {
            obj.insert("use_sliding_window".into(), json!(false));
            obj.insert("sliding_window".into(), Value::Null);
            obj.insert("max_window_layers".into(), json!(spec.layers));
        }
        Architecture::Qwen3 => {
            obj.insert("attention_bias".into(), json!(spec.attention_bias));
            obj.insert("use_sliding_window".into(), json!(false));
            obj.insert("sliding_window".into(), Value::Null);
            obj.insert("max_window_layers".into(), json!(spec.layers));
        }
        Architecture::Gemma2 | Architecture::Gemma3 => {
            obj.remove("hidden_act");
            obj.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            obj.insert("attention_bias".into(), json!(false));
            obj.insert("sliding_window".into(), json!(spec.sliding_window));
            obj.insert(
                "query_pre_attn_scalar".into(),
                json!(spec.query_pre_attn_scalar),
            );
            // Written even when null: Gemma 2 caps at 50 and 30 when they are missing.
            obj.insert(
                "attn_logit_softcapping".into(),
                json!(spec.attn_logit_softcapping),
            );
            obj.insert(
                "final_logit_softcapping".into(),
                json!(spec.final_logit_softcapping),
            );
            if let Some(p) = spec.sliding_window_pattern {
                obj.insert("sliding_window_pattern".into(), json!(p));
            }
            if let Some(f) = spec.rope_local_base_freq {
                obj.insert("rope_local_base_freq".into(), json!(f));
            }
        }
        Architecture::Mixtral => {
            obj.insert("sliding_window".into(), json!(spec.sliding_window));
        }
        Architecture::Qwen3Moe => {
            obj.insert("attention_bias".into(), json!(spec.attention_bias));
            obj.insert("use_sliding_window".into(), json!(false));
            obj.insert("sliding_window".into(), Value::Null);
            obj.insert("max_window_layers".into(), json!(spec.layers));
        }
        Architecture::Phi3 => {
            obj.insert("sliding_window".into(), json!(spec.sliding_window));
            // Phi3Config's default pad id, 32000, is outside a small vocab.
            obj.insert("pad_token_id".into(), Value::Null);
            if let Some(f) = spec.partial_rotary_factor {
                obj.insert("partial_rotary_factor".into(), json!(f));
            }
            if let Some(n) = spec.original_max_position_embeddings {
                obj.insert("original_max_position_embeddings".into(), json!(n));
            }
        }
    }
    if let Some(moe) = &spec.moe {
        moe.config(spec.architecture, spec.ffn, obj);
    }
    cfg
}

/// FNV-1a (64-bit) over config.json then model.safetensors, as 16 hex digits: equal
/// fingerprints mean the same model. `engine/tests/reference/make_refs.py` computes the same.
pub fn fingerprint(dir: &Path) -> anyhow::Result<String> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for name in ["config.json", "model.safetensors"] {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        for b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    Ok(format!("{hash:016x}"))
}

/// Writes `value` with every object's keys sorted, whatever serde_json's `preserve_order`
/// feature says (a dependency elsewhere in the workspace can turn it on): the same spec must
/// write the same bytes, or fingerprints and the committed references drift.
fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    let mut value = value.clone();
    value.sort_all_objects();
    std::fs::write(path, serde_json::to_string_pretty(&value)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
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

    /// Approximately normal (Irwin-Hall of 4 uniforms, rescaled to unit variance).
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

/// Draws tensors from one stream in a fixed order and collects them by name.
struct WeightWriter {
    rng: Rng,
    dtype: DType,
    tensors: HashMap<String, Tensor>,
}

impl WeightWriter {
    fn put(&mut self, name: String, shape: &[usize], mean: f32, std: f32) -> anyhow::Result<()> {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| mean + self.rng.normal(std)).collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(self.dtype)?;
        self.tensors.insert(name, t);
        Ok(())
    }
}

fn write_weights(dir: &Path, spec: &ModelSpec) -> anyhow::Result<()> {
    let mut w = WeightWriter {
        rng: Rng(spec.seed ^ 0x5EED),
        dtype: spec.dtype.candle(),
        tensors: HashMap::new(),
    };
    let (hid, q_out, kv_out, std) = (
        spec.hidden,
        spec.heads * spec.head_dim,
        spec.kv_heads * spec.head_dim,
        spec.init_std,
    );
    w.put(
        "model.embed_tokens.weight".into(),
        &[spec.vocab, hid],
        0.0,
        std,
    )?;
    // Gemma's norms scale by `1 + w`: their weights centre on 0, the others' on 1.
    let gemma = spec.architecture.is_gemma();
    let norm_mean = if gemma { 0.0 } else { 1.0 };
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        w.put(
            format!("{p}.self_attn.q_proj.weight"),
            &[q_out, hid],
            0.0,
            std,
        )?;
        w.put(
            format!("{p}.self_attn.k_proj.weight"),
            &[kv_out, hid],
            0.0,
            std,
        )?;
        w.put(
            format!("{p}.self_attn.v_proj.weight"),
            &[kv_out, hid],
            0.0,
            std,
        )?;
        w.put(
            format!("{p}.self_attn.o_proj.weight"),
            &[hid, q_out],
            0.0,
            std,
        )?;
        match spec
            .moe
            .as_ref()
            .filter(|m| m.is_sparse(spec.architecture, i))
        {
            None => {
                for (name, shape) in [
                    ("gate_proj", [spec.ffn, hid]),
                    ("up_proj", [spec.ffn, hid]),
                    ("down_proj", [hid, spec.ffn]),
                ] {
                    w.put(format!("{p}.mlp.{name}.weight"), &shape, 0.0, std)?;
                }
            }
            Some(moe) => {
                let f = moe.expert_ffn(spec.ffn);
                let (router, _) = MoeSpec::names(spec.architecture, &p, 0);
                w.put(router, &[moe.experts, hid], 0.0, moe.router_std)?;
                for e in 0..moe.experts {
                    let (_, [gate, up, down]) = MoeSpec::names(spec.architecture, &p, e);
                    w.put(gate, &[f, hid], 0.0, std)?;
                    w.put(up, &[f, hid], 0.0, std)?;
                    w.put(down, &[hid, f], 0.0, std)?;
                }
            }
        }
        if spec.attention_bias {
            w.put(
                format!("{p}.self_attn.q_proj.bias"),
                &[q_out],
                0.0,
                BIAS_STD,
            )?;
            w.put(
                format!("{p}.self_attn.k_proj.bias"),
                &[kv_out],
                0.0,
                BIAS_STD,
            )?;
            w.put(
                format!("{p}.self_attn.v_proj.bias"),
                &[kv_out],
                0.0,
                BIAS_STD,
            )?;
        }
        w.put(
            format!("{p}.input_layernorm.weight"),
            &[hid],
            norm_mean,
            std,
        )?;
        w.put(
            format!("{p}.post_attention_layernorm.weight"),
            &[hid],
            norm_mean,
            std,
        )?;
        if gemma {
            // Drawn after the layer's Llama tensors, as Qwen3's q/k norms are.
            for name in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                w.put(format!("{p}.{name}.weight"), &[hid], norm_mean, std)?;
            }
        }
        if matches!(
            spec.architecture,
            Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe
        ) {
            // Drawn last in the layer, so the other architectures' streams are unchanged.
            for name in ["q_norm", "k_norm"] {
                w.put(
                    format!("{p}.self_attn.{name}.weight"),
                    &[spec.head_dim],
                    norm_mean,
                    QK_NORM_STD,
                )?;
            }
        }
    }
    if spec.architecture == Architecture::Phi3 {
        fuse_phi3(&mut w.tensors, spec.layers)?;
    }
    w.put("model.norm.weight".into(), &[hid], norm_mean, std)?;
    if !spec.tie_word_embeddings {
        w.put("lm_head.weight".into(), &[spec.vocab, hid], 0.0, std)?;
    }
    let path = dir.join("model.safetensors");
    // safetensors orders tensors by dtype and name, so the HashMap's order does not leak into
    // the file.
    candle_core::safetensors::save(&w.tensors, &path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Phi-3's checkpoint layout: each layer's q, k, v (drawn as Llama's) concatenated into
/// `self_attn.qkv_proj` and gate, up into `mlp.gate_up_proj`, so a Phi-3 spec is its Llama
/// twin's weights, stored as transformers' Phi3 classes hold them.
fn fuse_phi3(tensors: &mut HashMap<String, Tensor>, layers: usize) -> anyhow::Result<()> {
    for i in 0..layers {
        for (parts, fused) in [
            (
                ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"].as_slice(),
                "self_attn.qkv_proj",
            ),
            (
                ["mlp.gate_proj", "mlp.up_proj"].as_slice(),
                "mlp.gate_up_proj",
            ),
        ] {
            let parts = parts
                .iter()
                .map(|p| {
                    let name = format!("model.layers.{i}.{p}.weight");
                    tensors.remove(&name).context(name)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            tensors.insert(
                format!("model.layers.{i}.{fused}.weight"),
                Tensor::cat(&parts, 0)?,
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
