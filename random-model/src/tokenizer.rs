//! The written model's tokenizer: a real one, padded to the model's vocabulary.

use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};

/// Copies the source tokenizer and adds `<extra_N>` tokens up to `vocab`, so any id decodes.
pub(crate) fn pad_tokenizer(from: &Path, out: &Path, vocab: usize) -> anyhow::Result<()> {
    let src = from.join("tokenizer.json");
    let text =
        std::fs::read_to_string(&src).with_context(|| format!("reading {}", src.display()))?;
    let mut tok: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", src.display()))?;
    let base = tok["model"]["vocab"]
        .as_object()
        .map(|v| v.len())
        .with_context(|| format!("{} has no model.vocab", src.display()))?;
    let added = tok["added_tokens"]
        .as_array_mut()
        .with_context(|| format!("{} has no added_tokens", src.display()))?;
    let mut next = base.max(
        added
            .iter()
            .filter_map(|t| t["id"].as_u64())
            .max()
            .map_or(0, |m| m as usize + 1),
    );
    if next > vocab {
        bail!(
            "{} has {next} tokens, more than the model's vocab of {vocab}",
            src.display()
        );
    }
    while next < vocab {
        added.push(json!({
            "id": next, "content": format!("<extra_{next}>"), "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": false
        }));
        next += 1;
    }
    let dst = out.join("tokenizer.json");
    std::fs::write(&dst, serde_json::to_string(&tok)?)
        .with_context(|| format!("writing {}", dst.display()))?;
    for f in [
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
    ] {
        if from.join(f).is_file() {
            // The copy keeps the source's permissions; a read-only copy left by an earlier run
            // would refuse to be overwritten.
            let _ = std::fs::remove_file(out.join(f));
            std::fs::copy(from.join(f), out.join(f))
                .with_context(|| format!("copying {}", from.join(f).display()))?;
        }
    }
    Ok(())
}
