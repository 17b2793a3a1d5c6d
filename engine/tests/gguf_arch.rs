//! Every architecture the engine supports, from GGUF files that llama.cpp's own
//! `convert_hf_to_gguf.py` (F32) and `llama-quantize` (Q8_0) made from tiny random models
//! (`gguf/tests/fixtures/arch`: `specs.json`, `make.py`; the files are not committed:
//! `random_model::gguf_out` writes them on first use and checks them byte for byte against
//! llama.cpp's, `gguf/tests/fixtures/manifest.json`): Gemma 2, Gemma 3, Phi-3, Phi-4-mini
//! (partial rotary, LongRoPE), Mixtral and Qwen3-MoE. Llama, Qwen2 and Qwen3 are `gguf.rs`'s
//! stories260K and the bench's files; Mistral is a `llama` file (llama.cpp's converter drops its
//! sliding window, so a windowed Mistral GGUF runs as llama.cpp runs it: without one).
//!
//! For each: the F32 file's config resolves as the safetensors model's, and its greedy ids
//! equal both the safetensors model's (regenerated here from the spec) and llama.cpp's own on
//! the same file (`llama_cpp_greedy.json`, from `../llama_cpp_greedy.c`, with an f32 KV cache
//! as the engine's); on the Q8_0 file, llama.cpp's ids are Fission's teacher-forced argmax up to
//! near ties. The specs keep to what llama.cpp's converter carries (see
//! `make.py` and the notes in `gguf/src/config.rs`): Gemma's attention scale is 1/sqrt(head_dim),
//! Gemma 2 ties its output, Gemma 3's window pattern is 6, Qwen3-MoE renormalises its top-k and
//! has no dense layers, Phi-3's window is wider than the sequences (llama.cpp runs Phi-3 without
//! one).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use engine::engine::EngineConfig;
use engine::loader::{ModelFiles, ModelSource};
use engine::model::LoadedModel;
use engine::quantize::Quantize;
use random_model::{write_model, ModelSpec};
use serde::Deserialize;

use common::arch_refs::{argmax, first_position_logits, stories_tokenizer, F32_LOGIT_TOL};
use common::{engine, greedy};

/// `gguf/tests/fixtures/arch`: the specs and llama.cpp's ids (no weights).
fn fixtures() -> PathBuf {
    random_model::gguf_out::fixtures::sources_dir().join("arch")
}

/// GGUF fixture `file` (`NAME-f32.gguf`, `NAME-q8_0.gguf`), written on first use to be byte for
/// byte the file llama.cpp made (`random_model::gguf_out::fixtures`).
fn gguf_file(file: &str) -> PathBuf {
    random_model::gguf_out::fixtures::path(&format!("arch/{file}"))
}

#[derive(Deserialize)]
struct LlamaCpp {
    new_tokens: usize,
    prompts: Vec<Vec<u32>>,
    models: BTreeMap<String, Model>,
}

#[derive(Deserialize)]
struct Model {
    files: BTreeMap<String, File>,
}

#[derive(Deserialize)]
struct File {
    ids: Vec<Vec<u32>>,
}

fn llama_cpp() -> LlamaCpp {
    let text = std::fs::read_to_string(fixtures().join("llama_cpp_greedy.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn specs() -> BTreeMap<String, ModelSpec> {
    let text = std::fs::read_to_string(fixtures().join("specs.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn load(path: &Path, quantize: Quantize) -> LoadedModel {
    LoadedModel::load_quantized(
        &ModelSource::Local(path.to_path_buf()),
        Some(DType::F32),
        quantize,
        &Device::Cpu,
    )
    .unwrap_or_else(|e| panic!("{} loads: {e}", path.display()))
}

fn greedy_ids(model: &LoadedModel, prompts: &[Vec<u32>], new_tokens: usize) -> Vec<Vec<u32>> {
    let mut e = engine(
        model,
        EngineConfig {
            num_kv_blocks: Some(256),
            ..Default::default()
        },
    );
    let reqs = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(i as u64, p.clone(), new_tokens))
        .collect();
    e.generate(reqs)
        .expect("generate")
        .into_iter()
        .map(|c| c.output_ids)
        .collect()
}

/// The F32 file: the safetensors model's config and greedy ids, and llama.cpp's ids.
fn check_f32(name: &str) {
    let refs = llama_cpp();
    let spec = &specs()[name];
    let dir = tempfile::tempdir().unwrap();
    write_model(dir.path(), spec, &stories_tokenizer()).unwrap();
    let st = load(dir.path(), Quantize::None);
    let gguf = load(&gguf_file(&format!("{name}-f32.gguf")), Quantize::None);
    // The Llama-family converter writes a tied output twice (`token_embd`, `output`).
    let mut want = st.config().clone();
    want.tie_word_embeddings = gguf.config().tie_word_embeddings;
    assert_eq!(gguf.config(), &want, "{name}: config from GGUF metadata");
    if !st.config().tie_word_embeddings {
        assert!(!gguf.config().tie_word_embeddings, "{name}: untied");
    }
    // The logits too: Gemma 2's tied random model echoes its last token whatever its layers
    // compute, so its ids alone would not check them.
    for p in &refs.prompts {
        let (a, b) = (
            first_position_logits(&gguf, p),
            first_position_logits(&st, p),
        );
        let err = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            err <= F32_LOGIT_TOL,
            "{name}: logits differ by {err} after {p:?}"
        );
    }
    let from_gguf = greedy_ids(&gguf, &refs.prompts, refs.new_tokens);
    let from_st = greedy_ids(&st, &refs.prompts, refs.new_tokens);
    assert_eq!(from_gguf, from_st, "{name}: GGUF vs safetensors");
    let theirs = &refs.models[name].files[&format!("{name}-f32.gguf")].ids;
    assert_eq!(
        &from_gguf, theirs,
        "{name}: Fission vs llama.cpp on the F32 file"
    );
    let tensor = greedy_ids(&gguf.with_tensor_path(), &refs.prompts, refs.new_tokens);
    assert_eq!(tensor, from_st, "{name}: the tensor path on the GGUF");
}

/// The Q8_0 file, run as stored (int8 panels) and dequantised, teacher-forced along
/// llama.cpp's greedy ids on it: at each step llama.cpp's token is Fission's argmax, or within
/// Fission's own quantisation error of it. llama.cpp's matmuls round the activations to 8 bits
/// in their own order, so where two logits nearly tie either may win; a wrong weight would put
/// its choice far below. The margin allowed is twice the largest logit change from the F32
/// file to the Q8_0 one at that step, in Fission.
fn check_q8_0(name: &str) {
    let refs = llama_cpp();
    let file = format!("{name}-q8_0.gguf");
    let theirs = &refs.models[name].files[&file].ids;
    let f32_model = load(&gguf_file(&format!("{name}-f32.gguf")), Quantize::None);
    for quantize in [Quantize::None, Quantize::Dequant] {
        let q8 = load(&gguf_file(&file), quantize);
        let (mut steps, mut flips) = (0, 0);
        for (prompt, ids) in refs.prompts.iter().zip(theirs) {
            let mut seq = prompt.clone();
            for &want in ids {
                let q = first_position_logits(&q8, &seq);
                let top = argmax(&q);
                steps += 1;
                if top != want {
                    flips += 1;
                    let f = first_position_logits(&f32_model, &seq);
                    let err = q
                        .iter()
                        .zip(&f)
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    let margin = q[top as usize] - q[want as usize];
                    assert!(
                        margin <= 2.0 * err,
                        "{file} (quantize {quantize}) after {seq:?}: llama.cpp's {want} is \
                         {margin} below our {top}, beyond twice the quantisation error {err}"
                    );
                }
                seq.push(want);
            }
        }
        eprintln!(
            "{file} (quantize {quantize}): llama.cpp's token is our argmax at {} of {steps} \
             teacher-forced steps, a near tie at the others",
            steps - flips
        );
        assert!(flips * 8 <= steps, "{file}: {flips} near ties of {steps}");
    }
}

macro_rules! arch_tests {
    ($($name:ident),* $(,)?) => {
        mod f32_file {
            $(#[test] fn $name() { super::check_f32(stringify!($name)); })*
        }
        mod q8_0_file {
            $(#[test] fn $name() { super::check_q8_0(stringify!($name)); })*
        }
        const TESTED: &[&str] = &[$(stringify!($name)),*];
    };
}

arch_tests!(gemma2, gemma3, phi3, phi4_mini, mixtral, qwen3_moe);

#[test]
fn every_fixture_has_a_test() {
    let names: Vec<String> = specs().into_keys().collect();
    let mut tested: Vec<String> = TESTED.iter().map(|s| s.to_string()).collect();
    tested.sort();
    assert_eq!(names, tested);
    let refs: Vec<String> = llama_cpp().models.into_keys().collect();
    assert_eq!(refs, tested);
}

const TEXTS: &[&str] = &[
    "Once upon a time, there was a little girl named Lily.",
    "  two leading spaces and trailing  ",
    "Tom said: \"It's 3:45pm!\" 12345",
    "line one\nline two\n\n\ttabbed",
    "caf\u{e9} \u{65e5}\u{672c} \u{1f600}",
    "<s>inline special</s>",
    "",
];

/// The GGUF tokenizer of each fixture in `names` encodes and decodes `TEXTS` as `hf` does.
fn tokenizers_agree(names: &[&str], hf: &tokenizers::Tokenizer) {
    for name in names {
        let files =
            ModelFiles::resolve(&ModelSource::Local(gguf_file(&format!("{name}-f32.gguf"))))
                .unwrap();
        let ours = tokenizers::Tokenizer::from_file(&files.tokenizer).unwrap();
        for text in TEXTS {
            for special in [false, true] {
                let a = ours.encode(*text, special).unwrap();
                let b = hf.encode(*text, special).unwrap();
                assert_eq!(a.get_ids(), b.get_ids(), "{name}: {text:?}");
                for skip in [false, true] {
                    assert_eq!(
                        ours.decode(a.get_ids(), skip).unwrap(),
                        hf.decode(b.get_ids(), skip).unwrap(),
                        "{name}: {text:?}"
                    );
                }
            }
        }
    }
}

/// Phi-3's, Mixtral's and Qwen3-MoE's converters keep the SentencePiece tokenizer as the
/// checkpoint has it: the GGUF tokenizer encodes and decodes as the HF one.
#[test]
fn sentencepiece_tokenizers_encode_as_the_hf_tokenizer() {
    let hf = tokenizers::Tokenizer::from_file(stories_tokenizer().join("tokenizer.json")).unwrap();
    tokenizers_agree(&["phi3", "phi4_mini", "mixtral", "qwen3_moe"], &hf);
}

/// Gemma's converter writes `add_space_prefix = false`, Gemma's own rule: the file's tokenizer
/// is the checkpoint's without the leading `▁` (HF's Gemma tokenizer.json has no `Prepend`
/// normalizer and no `Strip` decoder).
#[test]
fn gemma_tokenizers_add_no_space_prefix() {
    let path = stories_tokenizer().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let without = |list: &mut serde_json::Value, ty: &str| {
        list.as_array_mut()
            .unwrap()
            .retain(|n| n["type"].as_str() != Some(ty));
    };
    without(&mut json["normalizer"]["normalizers"], "Prepend");
    without(&mut json["decoder"]["decoders"], "Strip");
    let hf: tokenizers::Tokenizer = json.to_string().parse().unwrap();
    tokenizers_agree(&["gemma2", "gemma3"], &hf);
}

/// Gemma's norms come back as transformers stores them (the converter's `+ 1` undone), and
/// the experts as one `[out, in]` tensor each.
#[test]
fn gemma_norms_and_experts_load_as_the_checkpoint_stores_them() {
    let specs = specs();
    for (name, tensor, check) in [
        ("gemma3", "model.layers.0.self_attn.q_norm.weight", None),
        (
            "gemma2",
            "model.layers.1.pre_feedforward_layernorm.weight",
            None,
        ),
        (
            "mixtral",
            "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            Some((64, 64)),
        ),
        (
            "qwen3_moe",
            "model.layers.0.mlp.experts.2.gate_proj.weight",
            Some((32, 64)),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_model(dir.path(), &specs[name], &stories_tokenizer()).unwrap();
        let st = candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu)
            .unwrap();
        let want = st[tensor].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let file = gguf::GgufFile::open(&gguf_file(&format!("{name}-f32.gguf"))).unwrap();
        let got = gguf::load_tensors(&file, DType::F32, &Device::Cpu).unwrap();
        let got_t = &got[tensor];
        if let Some(dims) = check {
            assert_eq!(got_t.dims2().unwrap(), dims, "{name} {tensor}");
        }
        let got = got_t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (a, b) in got.iter().zip(&want) {
            // (1 + w) - 1 in f32 loses w's bits below 2^-23 of 1: the engine's 1 + w is the
            // same either way.
            assert!((a - b).abs() <= 1e-7, "{name} {tensor}: {a} vs {b}");
            assert_eq!(1.0 + a, 1.0 + b, "{name} {tensor}");
        }
    }
}
