//! The architecture references (`tests/reference/arch_refs.json`) and the checks every
//! architecture test runs against them: the variant's model regenerated from its spec, its
//! greedy ids alone and batched with chunked prefill, and its first-position logits, on the host
//! or the tensor path. `architectures.rs` tests the dense variants, `architectures_moe.rs` the
//! mixtures of experts (their entries' `suite`).

use candle_core::{DType, Device};
use engine::engine::EngineConfig;
use engine::loader::ModelSource;
use engine::model::{ForwardBatch, LoadedModel};
use random_model::{fingerprint, write_model, ModelSpec};
use serde::Deserialize;

use super::{engine, greedy, TopLogit};

/// Absolute tolerance on f32 logits: both sides compute in f32, and the sums differ only in
/// order.
pub const F32_LOGIT_TOL: f32 = 1e-4;

#[derive(Debug, Deserialize)]
pub struct ArchRefs {
    pub max_new_tokens: usize,
    pub variants: Vec<Variant>,
}

#[derive(Debug, Deserialize)]
pub struct Variant {
    pub name: String,
    /// Tokens per reference when not the file's `max_new_tokens` (the windowed variants).
    #[serde(default)]
    pub max_new_tokens: Option<usize>,
    pub spec: ModelSpec,
    /// Which test file checks it: `None` architectures.rs, `"moe"` architectures_moe.rs.
    #[serde(default)]
    pub suite: Option<String>,
    pub fingerprint: String,
    pub references: Vec<ArchReference>,
}

#[derive(Debug, Deserialize)]
pub struct ArchReference {
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub first_position_top5: Vec<TopLogit>,
    /// `rope_rule` variants: what transformers' own rope gives, where it differs.
    #[serde(default)]
    pub transformers_output_ids: Option<Vec<u32>>,
}

pub fn arch_refs() -> ArchRefs {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/arch_refs.json"
    );
    let text = std::fs::read_to_string(path).expect("arch_refs.json readable");
    serde_json::from_str(&text).expect("arch_refs.json parses")
}

pub fn variant(name: &str) -> Variant {
    arch_refs()
        .variants
        .into_iter()
        .find(|v| v.name == name)
        .unwrap_or_else(|| panic!("arch_refs.json has no variant {name:?}"))
}

pub fn stories_tokenizer() -> std::path::PathBuf {
    let dir = testkit::shared_model("stories260K");
    assert!(dir.is_dir(), "shared model missing: {}", dir.display());
    dir
}

/// Writes the variant's model into a fresh directory and checks it is the one the references
/// were computed from.
pub fn materialize(v: &Variant) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    write_model(dir.path(), &v.spec, &stories_tokenizer()).expect("testkit writes the model");
    let got = fingerprint(dir.path()).expect("fingerprint");
    assert_eq!(
        got, v.fingerprint,
        "testkit now writes a different model for {:?} than the references were made from; \
         rerun engine/tests/reference/make_refs.py",
        v.name
    );
    dir
}

pub fn load(dir: &std::path::Path, dtype: Option<DType>) -> LoadedModel {
    LoadedModel::load(&ModelSource::Local(dir.to_path_buf()), dtype, &Device::Cpu)
        .expect("model loads")
}

pub fn small(cfg: EngineConfig) -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(128),
        ..cfg
    }
}

/// f32 logits at the last prompt position, from one raw forward over the whole prompt.
pub fn first_position_logits(model: &LoadedModel, ids: &[u32]) -> Vec<f32> {
    let mut e = engine(model, small(EngineConfig::default()));
    let mut fb = ForwardBatch::default();
    fb.push_seq(
        ids,
        0,
        (0..ids.len().div_ceil(16) as u32).collect(),
        16,
        true,
    );
    let logits = model.model.forward(&fb, e.cache_mut()).expect("forward");
    logits
        .flatten_all()
        .expect("flat")
        .to_vec1()
        .expect("f32 logits")
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .expect("non-empty logits")
}

/// Which forward pass a check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Host,
    Tensor,
}

/// Greedy tokens alone and batched with chunked prefill, and first-position logits, all equal
/// to transformers', on `path`.
pub fn check_variant(name: &str, path: Path) {
    let refs = arch_refs();
    let v = variant(name);
    let dir = materialize(&v);
    let model = match path {
        Path::Host => load(dir.path(), None),
        Path::Tensor => load(dir.path(), None).with_tensor_path(),
    };
    let engine::model::Model::Llama(llama) = &*model.model else {
        panic!("{name} loads as a Llama");
    };
    assert_eq!(
        llama.runs_host_path(),
        path == Path::Host,
        "{name}: not on the {path:?} path"
    );
    let name = &format!("{name} ({path:?} path)");
    for (i, r) in v.references.iter().enumerate() {
        assert_eq!(
            r.output_ids.len(),
            v.max_new_tokens.unwrap_or(refs.max_new_tokens)
        );
        let mut e = engine(&model, small(EngineConfig::default()));
        // The tensor path's cache is a device tensor a layer, read through the device ops.
        assert_eq!(e.cache().is_on_device(), path == Path::Tensor, "{name}");
        let out = e
            .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
            .expect("generates");
        assert_eq!(out[0].output_ids, r.output_ids, "{name} prompt {i} alone");

        let row = first_position_logits(&model, &r.input_ids);
        for t in &r.first_position_top5 {
            let got = row[t.id as usize];
            assert!(
                (got - t.logit).abs() <= F32_LOGIT_TOL,
                "{name} prompt {i} token {}: logit {got} vs transformers {}",
                t.id,
                t.logit
            );
        }
    }
    // Both prompts in one batch, prefilled 16 tokens at a time into 4-token blocks, so the long
    // prompt's rope positions arrive in chunks.
    let mut e = engine(
        &model,
        small(EngineConfig {
            block_size: 4,
            max_prefill_chunk_tokens: 16,
            max_batch_prefill_tokens: 24,
            ..Default::default()
        }),
    );
    let reqs = v
        .references
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, r.input_ids.clone(), r.output_ids.len()))
        .collect();
    let out = e.generate(reqs).expect("generates");
    for (i, r) in v.references.iter().enumerate() {
        assert_eq!(
            out[i].output_ids, r.output_ids,
            "{name} prompt {i} batched with chunked prefill"
        );
    }
}

/// Every variant of `suite` in arch_refs.json (`None`: the dense ones) is in `tested`, and
/// nothing else.
pub fn assert_suite_tested(suite: Option<&str>, tested: &[&str]) {
    let mut in_file: Vec<String> = arch_refs()
        .variants
        .into_iter()
        .filter(|v| v.suite.as_deref() == suite)
        .map(|v| v.name)
        .collect();
    let mut tested: Vec<String> = tested.iter().map(|s| s.to_string()).collect();
    in_file.sort();
    tested.sort();
    assert_eq!(in_file, tested);
}

/// One test per named variant on the host path, and one in `mod tensor_path` on the tensor
/// path; `TESTED_VARIANTS` lists them.
#[macro_export]
macro_rules! variant_tests {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $crate::common::arch_refs::check_variant(
                    stringify!($name),
                    $crate::common::arch_refs::Path::Host,
                );
            }
        )*
        mod tensor_path {
            $(
                #[test]
                fn $name() {
                    $crate::common::arch_refs::check_variant(
                        stringify!($name),
                        $crate::common::arch_refs::Path::Tensor,
                    );
                }
            )*
        }
        const TESTED_VARIANTS: &[&str] = &[$(stringify!($name)),*];
    };
}
