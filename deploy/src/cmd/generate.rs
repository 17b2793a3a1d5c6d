//! `fission generate`: one prompt through the local engine, as text or as JSON.

use anyhow::Context;
use clap::Args;
use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::parse_dtype;
use engine::quantize::Quantize;
use engine::sampling::SamplingParams;
use engine::stopping::StoppingCriteria;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A model directory, or a hub repo id (`org/name[@revision]`).
    #[arg(long, env = "FISSION_MODEL")]
    pub model: String,
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random when not given.
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// f32 (CPU default), bf16 or f16.
    #[arg(long)]
    pub dtype: Option<String>,
    /// none, or int8 (llama.cpp's Q8_0 layout, quantised at load).
    #[arg(long, default_value = "none")]
    pub quantize: Quantize,
    /// The KV cache's element type: f32, bf16, f16 or int8; by default the model's dtype.
    #[arg(long)]
    pub kv_cache_dtype: Option<kvtransfer::KvDtype>,
    /// Where the model runs: cpu, or cuda[:N] (a binary built with `--features cuda`).
    #[arg(long, env = "FISSION_DEVICE", default_value = "cpu")]
    pub device: engine::device::DeviceSpec,
    /// The forward pass: auto, host, or tensor (the device-generic path, on the CPU too).
    #[arg(long = "path", env = "FISSION_PATH", default_value = "auto")]
    pub forward_path: engine::device::ForwardPath,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    // The device before the model: a CUDA request in a CPU build fails before any file is read.
    args.device.open()?;
    let model = engine::device::load_model(
        &ModelSource::parse(&crate::default_model::resolve(&args.model)?),
        dtype,
        args.quantize,
        args.device,
        args.forward_path,
    )
    .with_context(|| format!("loading model {}", args.model))?;
    let enc = model
        .tokenizer
        .encode(args.prompt.as_str(), true)
        .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
    let prompt_ids = enc.get_ids().to_vec();
    let blocks = (prompt_ids.len() + args.max_new_tokens).div_ceil(16) + 1;
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            num_kv_blocks: Some(blocks.max(4)),
            kv_cache_dtype: args.kv_cache_dtype,
            ..Default::default()
        },
    )?;
    let req = Request {
        num_generated: 0,
        seq_id: SeqId(0),
        prompt_ids,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            repetition_penalty: args.repetition_penalty,
            seed: args.seed.unwrap_or_else(rand::random),
            top_n_logprobs: 0,
        },
        stopping: StoppingCriteria {
            max_new_tokens: args.max_new_tokens,
            stop_token_ids: model.generation.stop_token_ids(),
            stop_strings: args.stop,
            ignore_eos: args.ignore_eos,
        },
        grammar: None,
        prompt_logprobs: false,
    };
    let out = engine.generate(vec![req])?.remove(0);
    let finish = out.finish_reason.map(|f| f.as_str()).unwrap_or("length");
    if args.json {
        let v = serde_json::json!({
            "input_ids": out.prompt_ids,
            "output_ids": out.output_ids,
            "text": out.text,
            "finish_reason": finish,
        });
        println!("{v}");
    } else {
        println!("{}{}", args.prompt, out.text);
    }
    Ok(())
}
