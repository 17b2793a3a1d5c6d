//! `fission make-random-model`: a random-weight Llama-family model in a known shape, with a
//! tokenizer padded to its vocab so every id decodes. Benchmarks use it; it is never committed.
//! The writer itself is `random_model`, shared with the engine's tests. `--format gguf` writes
//! the GGUF file llama.cpp's converter (and llama-quantize, for Q8_0) would make of it
//! (`random_model::gguf_out`).

use std::path::{Path, PathBuf};

use ::random_model::gguf_out::{write_gguf, GgufOptions, GgufType, Quantizer, VocabSource};
use ::random_model::{write_model, ModelSpec};
use anyhow::Context;
use clap::{Args, ValueEnum};

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

impl Shape {
    fn spec(self) -> ModelSpec {
        match self {
            Shape::Smollm2_135m => ModelSpec::smollm2_135m(),
            Shape::Llama32_1b => ModelSpec::llama32_1b(),
            Shape::Tiny => ModelSpec::tiny(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// A transformers model directory (config.json, model.safetensors, tokenizer).
    #[default]
    Safetensors,
    /// One GGUF file, as llama.cpp's tools would make it of that directory.
    Gguf,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum GgufTypeArg {
    #[default]
    F32,
    /// As `llama-quantize F32.gguf OUT.gguf Q8_0` makes it from the F32 file.
    #[value(name = "q8_0")]
    Q8_0,
}

#[derive(Args, Debug)]
pub struct RandomModelArgs {
    #[arg(
        long,
        value_enum,
        required_unless_present = "spec_json",
        conflicts_with = "spec_json"
    )]
    pub shape: Option<Shape>,
    /// A `random_model::ModelSpec` as JSON, for shapes the presets do not cover
    /// (architecture, head_dim, rope scaling, biases, ...).
    #[arg(long)]
    pub spec_json: Option<PathBuf>,
    /// The model directory, or with `--format gguf` the `.gguf` file (whose stem the
    /// converter's `general.name` comes from).
    #[arg(long)]
    pub out: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
    #[arg(long, value_enum, default_value_t)]
    pub gguf_type: GgufTypeArg,
    /// Directory whose tokenizer is copied and padded to the model's vocab; `stories260K`
    /// (the default) is the embedded model's, so the command needs no files beside the binary.
    #[arg(
        long,
        env = "FISSION_TOKENIZER_FROM",
        default_value = crate::default_model::NAME
    )]
    pub tokenizer_from: PathBuf,
    /// Overrides the preset's or spec's seed (presets use 0).
    #[arg(long)]
    pub seed: Option<u64>,
}

pub fn run(args: RandomModelArgs) -> anyhow::Result<()> {
    let mut spec = match (args.shape, &args.spec_json) {
        (_, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str::<ModelSpec>(&text)
                .with_context(|| format!("parsing model spec {}", path.display()))?
        }
        (Some(shape), None) => shape.spec(),
        (None, None) => anyhow::bail!("pass --shape or --spec-json"),
    };
    if let Some(seed) = args.seed {
        spec.seed = seed;
    }
    let tokenizer_from = crate::default_model::resolve(&args.tokenizer_from.to_string_lossy())?;
    match args.format {
        Format::Safetensors => write_model(&args.out, &spec, Path::new(&tokenizer_from))?,
        Format::Gguf => {
            let stem = args
                .out
                .file_stem()
                .and_then(|s| s.to_str())
                .context("--out names no file")?
                .to_string();
            let work = tempfile::tempdir()?;
            let dir = work.path().join(&stem);
            write_model(&dir, &spec, Path::new(&tokenizer_from))?;
            let opts = GgufOptions {
                ty: match args.gguf_type {
                    GgufTypeArg::F32 => GgufType::F32,
                    GgufTypeArg::Q8_0 => GgufType::Q8_0,
                },
                quantizer: Quantizer::LlamaQuantize,
                vocab: VocabSource::SentencePiece,
                dir_name: stem,
            };
            write_gguf(&dir, &args.out, &opts)?;
        }
    }
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
