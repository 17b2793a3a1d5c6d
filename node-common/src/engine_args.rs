//! Engine flags both node binaries take, with TGI's names where the concept is the same.

use std::sync::Arc;

use clap::Args;
use engine::cost::CostModel;
use engine::device::{DeviceSpec, ForwardPath};
use engine::engine::EngineConfig;
use engine::loader::ModelSource;
use engine::model::{parse_dtype, LoadedModel, MockSpec};
use engine::quantize::Quantize;

use crate::error::NodeError;

/// Every default but the input and total limits is [`EngineConfig::default`]'s, the one source
/// (held to it by a test below).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// A model directory, a GGUF file (`model.gguf`: weights, config, tokenizer and chat
    /// template from its metadata), a hub repo id (`org/name[@revision]`), or `stories260K`,
    /// the embedded default model.
    #[arg(long, env = "FISSION_MODEL")]
    pub model: String,
    /// f32 (CPU default), bf16 or f16.
    #[arg(long, env = "FISSION_DTYPE")]
    pub dtype: Option<String>,
    /// none, or int8: projections and lm_head in int8 with a scale per 32 inputs (llama.cpp's
    /// Q8_0), quantised at load from the f32 or bf16 checkpoint.
    #[arg(long, env = "FISSION_QUANTIZE", default_value = "none")]
    pub quantize: Quantize,
    /// Where the model runs: cpu, or cuda[:N] (a binary built with `--features cuda`; others
    /// refuse it before loading weights, with NotCompiledWithCuda).
    #[arg(long, env = "FISSION_DEVICE", default_value = "cpu")]
    pub device: DeviceSpec,
    /// The forward pass: auto (the host path where the model can take it), host, or tensor
    /// (the device-generic path, on the CPU too).
    #[arg(long = "path", env = "FISSION_PATH", default_value = "auto")]
    pub forward_path: ForwardPath,
    /// On CUDA, the share of the GPU's total memory this process may use (vLLM's meaning): the
    /// KV cache gets that share less what the process already holds (its weights), and never
    /// more than is free, so two nodes at 0.45 each share one GPU. Ignored on the CPU
    /// (`--kv-memory-fraction`) and when `--num-kv-blocks` is given.
    #[arg(long, env = "FISSION_GPU_MEMORY_UTILIZATION", default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// The KV cache's element type: f32, bf16, f16, or int8 (a byte per element and an f32
    /// scale per token row and kv head: half of bf16's bytes, scales aside). By default the
    /// model's dtype. A prefill and a decode node exchange KV only when theirs agree.
    #[arg(long, env = "FISSION_KV_CACHE_DTYPE")]
    pub kv_cache_dtype: Option<kv_types::KvDtype>,
    #[arg(long, env = "FISSION_BLOCK_SIZE", default_value_t = EngineConfig::default().block_size)]
    pub block_size: usize,
    /// KV blocks; by default a fraction of available memory (`--kv-memory-fraction`).
    #[arg(long, env = "FISSION_NUM_KV_BLOCKS")]
    pub num_kv_blocks: Option<usize>,
    #[arg(long, env = "FISSION_KV_MEMORY_FRACTION", default_value_t = EngineConfig::default().kv_memory_fraction)]
    pub kv_memory_fraction: f64,
    #[arg(long, env = "MAX_BATCH_PREFILL_TOKENS", default_value_t = EngineConfig::default().max_batch_prefill_tokens)]
    pub max_batch_prefill_tokens: usize,
    #[arg(long, env = "MAX_BATCH_TOTAL_TOKENS")]
    pub max_batch_total_tokens: Option<usize>,
    /// TGI's limits, as the gateway's (`gateway::GatewayConfig::default`, which deploy's
    /// tests hold these to); the engine's own default is the model's context.
    #[arg(long, env = "MAX_INPUT_TOKENS", default_value_t = 4095)]
    pub max_input_tokens: usize,
    #[arg(long, env = "MAX_TOTAL_TOKENS", default_value_t = 4096)]
    pub max_total_tokens: usize,
    #[arg(long, env = "FISSION_MAX_NUM_SEQS", default_value_t = EngineConfig::default().max_num_seqs)]
    pub max_num_seqs: usize,
    /// Chunked prefill: the most prompt tokens of one sequence per step.
    #[arg(long, env = "FISSION_MAX_PREFILL_CHUNK_TOKENS", default_value_t = EngineConfig::default().max_prefill_chunk_tokens)]
    pub max_prefill_chunk_tokens: usize,
    #[arg(long, env = "FISSION_DISABLE_PREFIX_CACHING")]
    pub disable_prefix_caching: bool,
    /// `real` runs the model; `mock` spends the time `--cost-profile` predicts for each step
    /// and produces deterministic tokens, keeping the scheduler, the KV accounting and the KV
    /// transfer real (to emulate a large cluster on one machine).
    #[arg(long, env = "FISSION_ENGINE", value_enum, default_value_t = EngineKind::Real)]
    pub engine: EngineKind,
    /// The mock's cost profile: a built-in name (`h100-llama8b`) or a JSON file, as
    /// `fission-loadtest simulate --profile` takes.
    #[arg(long, env = "FISSION_COST_PROFILE", required_if_eq("engine", "mock"))]
    pub cost_profile: Option<String>,
    /// The share of the profiled model's KV bytes a mock node really stores and sends
    /// (its `head_dim` scaled down), so dozens of mock nodes fit in one machine's memory.
    #[arg(long, env = "FISSION_MOCK_KV_SCALE", default_value_t = 1.0 / 32.0)]
    pub mock_kv_scale: f64,
}

/// Which forward pass a node runs.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Real,
    Mock,
}

impl EngineArgs {
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_kv_blocks: self.num_kv_blocks,
            kv_memory_fraction: self.kv_memory_fraction,
            max_batch_prefill_tokens: self.max_batch_prefill_tokens,
            max_batch_total_tokens: self.max_batch_total_tokens,
            max_num_seqs: self.max_num_seqs,
            max_prefill_chunk_tokens: self.max_prefill_chunk_tokens,
            enable_prefix_caching: !self.disable_prefix_caching,
            max_input_tokens: Some(self.max_input_tokens),
            max_total_tokens: Some(self.max_total_tokens),
            kv_cache_dtype: self.kv_cache_dtype,
            ..Default::default()
        }
    }

    /// Where `--model` points: the embedded default model by its name (see
    /// [`crate::default_model`]), else a directory or a hub id. Every binary that runs a node
    /// loads through here, so they all read `--model` alike.
    pub fn model_source(&self) -> Result<ModelSource, NodeError> {
        Ok(ModelSource::parse(&crate::default_model::resolve(
            &self.model,
        )?))
    }

    pub fn load_model(&self) -> Result<LoadedModel, NodeError> {
        // The device first: a CUDA request in a CPU build fails before anything is read.
        self.device.open()?;
        let source = self.model_source()?;
        if let Some(spec) = self.mock_spec()? {
            return Ok(LoadedModel::load_mock(&source, &spec)?);
        }
        let dtype = self.dtype.as_deref().map(parse_dtype).transpose()?;
        Ok(engine::device::load_model(
            &source,
            dtype,
            self.quantize,
            self.device,
            self.forward_path,
        )?)
    }
}

impl EngineArgs {
    /// The mock's spec under `--engine mock`; `None` for the real engine.
    pub fn mock_spec(&self) -> Result<Option<MockSpec>, NodeError> {
        if self.engine == EngineKind::Real {
            return Ok(None);
        }
        let profile = self.cost_profile.as_deref().ok_or_else(|| {
            NodeError::Config("--engine mock needs --cost-profile NAME_OR_FILE".into())
        })?;
        Ok(Some(MockSpec {
            cost: CostModel::load(profile)?,
            kv_scale: self.mock_kv_scale,
        }))
    }
}

/// The identity of the served weights (see [`cluster::model_fingerprint`]); nodes whose
/// fingerprints differ must never exchange KV. The dtype is not in it: the KV layout says that.
///
/// A model that cannot be fingerprinted is an error, not a placeholder: two such nodes would
/// share a placeholder and be paired although their weights may differ.
pub fn model_fingerprint(model: &LoadedModel) -> Result<String, NodeError> {
    let dir = model
        .files
        .config
        .parent()
        .unwrap_or(std::path::Path::new("."));
    // A mock node shares its tokenizer's fingerprint, so the gateway (which reads only the
    // tokenizer's directory) admits it; its KV layout (the profile's layers, a scaled
    // head_dim) differs from the real model's, and transfers check layouts before any byte.
    cluster::model_fingerprint(dir).map_err(|e| {
        NodeError::Config(format!(
            "cannot fingerprint the model files in {}: {e}",
            dir.display()
        ))
    })
}

/// Shared model handle type.
pub type SharedModel = Arc<LoadedModel>;

/// An engine ready to serve, with what a node reports about it in `Info`.
pub struct StartedEngine {
    pub engine: engine::engine::Engine,
    pub info: proto::v1::NodeInfo,
}

impl EngineArgs {
    /// Loads the model and builds the engine off the async runtime (loading takes seconds), and
    /// fills the node's `Info` (role, identity, layout, capacity).
    pub async fn start_engine(
        &self,
        node_id: &str,
        role: &str,
    ) -> Result<StartedEngine, NodeError> {
        let args = self.clone();
        let (node_id, role) = (node_id.to_string(), role.to_string());
        tokio::task::spawn_blocking(move || {
            let model = args.load_model()?;
            let fingerprint = model_fingerprint(&model)?;
            let model_id = model.model_id.clone();
            let max_context = model.config().max_context as u32;
            let architecture = crate::model_types::architecture(&model);
            let weight_dtype = crate::model_types::weight_dtype(&model, args.quantize);
            let mut config = args.engine_config();
            if config.num_kv_blocks.is_none() && model.model.as_mock().is_none() {
                config.num_kv_blocks = engine::device::device_kv_blocks(
                    args.device,
                    &model,
                    &config,
                    args.gpu_memory_utilization,
                )?;
            }
            if let Some(m) = model.model.as_mock() {
                // The profiled node's KV capacity, unless given: its cache is only touched
                // where sequences write, so it costs the blocks in use, not the whole.
                config.num_kv_blocks = config.num_kv_blocks.or(Some(m.cost().node.kv_blocks));
            }
            // Every role's sliding-window layers hold only their windows: a prefill node pushes
            // just those, and a decode node imports just those (issue 32); the layout's
            // `windows` makes both ends agree on them.
            let engine = engine::engine::Engine::new(model, config)?;
            let info = proto::v1::NodeInfo {
                node_id,
                role,
                model_id,
                model_fingerprint: fingerprint,
                layout: Some(engine.cache().layout().into()),
                total_kv_blocks: engine.stats().num_blocks_total as u32,
                kv_endpoint: String::new(),
                max_context,
                // The role sets it when it has a KV identity (prefill-node's `build`).
                kv_identity: Vec::new(),
                architecture,
                weight_dtype,
            };
            Ok(StartedEngine { engine, info })
        })
        .await
        .map_err(|e| NodeError::Config(format!("model loading panicked: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn parse(flags: &[&str]) -> EngineArgs {
        Flags::try_parse_from(std::iter::once("node").chain(flags.iter().copied()))
            .unwrap()
            .engine
    }

    #[test]
    fn the_flags_default_to_the_engine_configs_defaults() {
        let args = parse(&["--model", "m"]);
        // The one pair the flags set on their own: TGI's limits, not the model's context.
        let expected = EngineConfig {
            max_input_tokens: Some(args.max_input_tokens),
            max_total_tokens: Some(args.max_total_tokens),
            ..EngineConfig::default()
        };
        assert_eq!(
            format!("{:?}", args.engine_config()),
            format!("{expected:?}")
        );
    }

    /// What `fission-prefill`, `fission-decode` and `fission node` all load through.
    #[test]
    fn the_embedded_model_loads_by_its_name() {
        let model = parse(&["--model", crate::default_model::NAME])
            .load_model()
            .unwrap();
        assert_eq!(model.model_id, crate::default_model::NAME);
        assert!(model
            .files
            .config
            .starts_with(crate::default_model::resolve(crate::default_model::NAME).unwrap()));
    }
}
