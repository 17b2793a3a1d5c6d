//! Writes the model a spec describes, as `fission make-random-model --spec-json` does, without
//! building the whole `fission` binary: what `engine/tests/reference/make_refs.py` runs.
//!
//! `cargo run --release -p random-model --example write_model -- SPEC.json OUT_DIR TOKENIZER_DIR`

use std::path::Path;

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [spec, out, tokenizer] = args.as_slice() else {
        anyhow::bail!("usage: write_model SPEC.json OUT_DIR TOKENIZER_DIR");
    };
    let text = std::fs::read_to_string(spec).with_context(|| format!("reading {spec}"))?;
    let spec: random_model::ModelSpec =
        serde_json::from_str(&text).with_context(|| format!("parsing model spec {spec}"))?;
    random_model::write_model(Path::new(out), &spec, Path::new(tokenizer))?;
    eprintln!("wrote {out}");
    Ok(())
}
