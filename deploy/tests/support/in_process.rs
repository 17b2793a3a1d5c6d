//! One engine in the test's own process on a model directory: the reference a real cluster's
//! greedy ids are held against (the same model and KV cache dtype, no network, no second
//! node). Included with `#[path]` by the cluster tests that need it.

use std::path::Path;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use kvtransfer::KvDtype;

pub struct InProcess {
    pub model: LoadedModel,
    pub engine: Engine,
    next_seq: u64,
}

impl InProcess {
    /// The model in `dir` on the CPU, 512 KV blocks of `kv_cache_dtype` (the model's own when
    /// `None`), as the cluster tests' nodes have.
    pub fn load(dir: &Path, kv_cache_dtype: Option<KvDtype>) -> InProcess {
        let model = LoadedModel::load(
            &ModelSource::Local(dir.to_path_buf()),
            None,
            &candle_core::Device::Cpu,
        )
        .expect("the model loads");
        let engine = Engine::new(
            model.clone(),
            EngineConfig {
                num_kv_blocks: Some(512),
                kv_cache_dtype,
                ..Default::default()
            },
        )
        .expect("an engine");
        InProcess {
            model,
            engine,
            next_seq: 0,
        }
    }

    /// `text`'s ids, as the gateway tokenizes a prompt.
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        self.model
            .tokenizer
            .encode(text, true)
            .expect("encodes")
            .get_ids()
            .to_vec()
    }

    /// Exactly `n` greedy ids after `prompt` (no stop at end of text).
    pub fn greedy(&mut self, prompt: Vec<u32>, n: usize) -> Vec<u32> {
        self.next_seq += 1;
        let req = Request::greedy_fixed_length(SeqId(self.next_seq), prompt, n);
        let out = self.engine.generate(vec![req]).expect("generates");
        out[0].output_ids.clone()
    }

    /// [`Self::greedy`] after `text`, as the ids `/generate` reports.
    pub fn greedy_text(&mut self, text: &str, n: usize) -> Vec<u64> {
        let prompt = self.tokenize(text);
        self.greedy(prompt, n).into_iter().map(u64::from).collect()
    }
}
