//! `generation_config.json` defaults the engine applies to requests. (Chat templates are the
//! gateway's: it renders prompts before they reach an engine.)

use crate::config::{ids, read_json, ModelConfig};
use crate::error::Result;
use crate::loader::ModelFiles;

/// Request defaults that come with the model.
#[derive(Debug, Clone, Default)]
pub struct GenerationConfig {
    /// Token ids that end generation (eos_token_id may be a list).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

impl GenerationConfig {
    pub fn load(files: &ModelFiles, cfg: &ModelConfig) -> Result<Self> {
        let mut out = GenerationConfig {
            eos_token_ids: cfg.eos_token_ids.clone(),
            bos_token_id: cfg.bos_token_id,
        };
        if let Some(path) = &files.generation_config {
            let v: serde_json::Value = read_json(path)?;
            if let Some(e) = v.get("eos_token_id") {
                let from_gen = ids(e);
                if !from_gen.is_empty() {
                    out.eos_token_ids = from_gen;
                }
            }
            if let Some(b) = v.get("bos_token_id").and_then(|b| b.as_u64()) {
                out.bos_token_id = Some(b as u32);
            }
        }
        Ok(out)
    }
}

impl GenerationConfig {
    /// Token ids that end a sequence by default: the eos ids, and the bos id, since a model
    /// that emits bos has started a new document (llama2.c story models end stories that way).
    pub fn stop_token_ids(&self) -> Vec<u32> {
        let mut ids = self.eos_token_ids.clone();
        if let Some(b) = self.bos_token_id {
            if !ids.contains(&b) {
                ids.push(b);
            }
        }
        ids
    }
}
