//! What structured output costs per generated token. `cargo bench -p engine --bench grammar_mask`.
//!
//! 1. End to end on stories260K (a real model, vocabulary 512): the same seeded decode of 8
//!    sequences with and without a JSON schema, alternating A/B rounds in one run so that
//!    machine noise hits both alike. The schema keeps every sequence inside one long JSON
//!    string, so both sides generate the same number of tokens.
//! 2. The mask alone at a realistic vocabulary size: 49,152 synthetic word-like tokens
//!    (SmolLM2's vocabulary size), mask + sample per token against sample alone.
//!
//! Prints the CPU (lscpu's model name), then medians with p10-p90 spreads.

use std::time::Instant;

use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::loader::ModelSource;
use engine::model::LoadedModel;
use engine::sampling::{sample, SamplingParams};
use engine::stopping::StoppingCriteria;
use grammar::{GrammarSpec, Vocabulary};

const ROUNDS: usize = 15;
const SEQS: u64 = 8;
const NEW_TOKENS: usize = 48;

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn report(label: &str, us: &[f64]) -> f64 {
    let median = percentile(us, 0.5);
    println!(
        "{label:<34} median {median:>8.2} us/token   p10-p90 {:>8.2} - {:>8.2}",
        percentile(us, 0.1),
        percentile(us, 0.9)
    );
    median
}

fn schema() -> GrammarSpec {
    GrammarSpec::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 4000}},
        "required": ["story"]
    }))
}

fn requests(prompt: &[u32], grammar: Option<GrammarSpec>) -> Vec<Request> {
    (0..SEQS)
        .map(|i| Request {
            seq_id: SeqId(i),
            prompt_ids: prompt.to_vec(),
            num_generated: 0,
            sampling: SamplingParams {
                temperature: 0.8,
                top_p: 0.95,
                seed: 100 + i,
                ..SamplingParams::greedy()
            },
            stopping: StoppingCriteria {
                max_new_tokens: NEW_TOKENS,
                stop_token_ids: Vec::new(),
                stop_strings: Vec::new(),
                ignore_eos: true,
            },
            grammar: grammar.clone(),
            prompt_logprobs: false,
        })
        .collect()
}

fn end_to_end() {
    let dir = std::env::var_os("FISSION_SHARED_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared").into())
        .join("models/stories260K");
    let model = LoadedModel::load(&ModelSource::Local(dir), None, &candle_core::Device::Cpu)
        .expect("stories260K loads");
    let prompt = model
        .tokenizer
        .encode("Once upon a time", true)
        .expect("encodes");
    let prompt = prompt.get_ids();
    let cfg = EngineConfig {
        num_kv_blocks: Some(1024),
        block_size: 16,
        ..Default::default()
    };
    let mut engine = Engine::new(model, cfg).expect("engine");
    let mut run = |grammar: Option<GrammarSpec>| -> f64 {
        let t = Instant::now();
        let out = engine
            .generate(requests(prompt, grammar))
            .expect("generates");
        let tokens: usize = out.iter().map(|c| c.output_ids.len()).sum();
        assert_eq!(
            tokens,
            SEQS as usize * NEW_TOKENS,
            "both sides generate alike"
        );
        t.elapsed().as_secs_f64() * 1e6 / tokens as f64
    };
    // Warm-up, which also builds the vocabulary grammars compile against (once per engine).
    run(Some(schema()));
    run(None);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        with.push(run(Some(schema())));
        without.push(run(None));
    }
    println!("end to end, stories260K, {SEQS} seqs x {NEW_TOKENS} tokens, {ROUNDS} A/B rounds");
    let a = report("  with a JSON schema", &with);
    let b = report("  without", &without);
    println!("  ratio {:.3}, overhead {:.2} us/token", a / b, a - b);
}

/// 49,152 tokens: the 256 bytes, then word-like pieces, half with a leading space.
fn synthetic_vocab() -> Vec<Vec<u8>> {
    const SYLLABLES: [&str; 24] = [
        "th", "er", "an", "in", "on", "at", "es", "ed", "or", "re", "ing", "st", "al", "en", "ou",
        "it", "is", "ar", "le", "ve", "co", "de", "ly", "ti",
    ];
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen = std::collections::HashSet::new();
    let mut i = 0u64;
    while words.len() < 49_151 {
        i += 1;
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut w = String::new();
        if x & 1 == 0 {
            w.push(' ');
        }
        for _ in 0..(1 + (x >> 1) % 4) {
            x = x.rotate_left(13).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            w.push_str(SYLLABLES[(x % 24) as usize]);
        }
        if x.is_multiple_of(7) {
            w.push_str(["\"", ",", ".", "\":", "\n"][(x % 5) as usize]);
        }
        if seen.insert(w.clone()) {
            words.push(w.into_bytes());
        }
    }
    words.push(b"\xff</s>".to_vec());
    words
}

fn mask_alone() {
    let words = synthetic_vocab();
    let n = words.len();
    let vocab = Vocabulary::from_token_bytes(words, n, &[(n - 1) as u32]).expect("vocab");
    let logits: Vec<Vec<f32>> = (0..64)
        .map(|s| {
            (0..n)
                .map(|i| ((i as u64 * 2654435761 + s * 97) % 1000) as f32 / 100.0)
                .collect()
        })
        .collect();
    let params = SamplingParams {
        temperature: 0.8,
        seed: 5,
        ..SamplingParams::greedy()
    };
    let steps = 200;
    let mut scratch = Vec::with_capacity(n);
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let mut constraint = vocab.compile(&schema()).expect("compiles");
        let t = Instant::now();
        for step in 0..steps {
            scratch.clear();
            scratch.extend_from_slice(&logits[step % 64]);
            constraint.mask_logits(&mut scratch, &[]).expect("mask");
            let token = sample(&scratch, &params, &[], step as u64).token_id;
            constraint.accept(token).expect("admitted");
        }
        with.push(t.elapsed().as_secs_f64() * 1e6 / steps as f64);
        let t = Instant::now();
        for step in 0..steps {
            std::hint::black_box(sample(&logits[step % 64], &params, &[], step as u64));
        }
        without.push(t.elapsed().as_secs_f64() * 1e6 / steps as f64);
    }
    println!("mask alone, {n}-token synthetic vocabulary, {steps} tokens x {ROUNDS} A/B rounds");
    let a = report("  mask + accept + sample", &with);
    let b = report("  sample alone", &without);
    println!("  ratio {:.3}, overhead {:.2} us/token", a / b, a - b);
}

fn main() {
    let cpu = std::process::Command::new("lscpu")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("cpu: {cpu} ({threads} threads available)");
    end_to_end();
    mask_alone();
}
