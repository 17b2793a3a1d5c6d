//! Structured output in the engine on a real model (stories260K): the mask keeps every output
//! inside the grammar, the grammar's end ends the sequence, and a seeded constrained request
//! gives the same tokens alone, batched, resumed and beside unconstrained neighbours.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, stories};
use engine::engine::{EngineConfig, Request};
use engine::error::EngineError;
use engine::ids::SeqId;
use engine::model::LoadedModel;
use engine::sampling::SamplingParams;
use engine::stopping::{FinishReason, StoppingCriteria};
use grammar::GrammarSpec;
use serde_json::{json, Value};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "pet": {"enum": ["cat", "dog", "bird"]}
        },
        "required": ["name", "age", "pet"],
        "additionalProperties": false
    })
}

fn prompt(model: &LoadedModel, text: &str) -> Vec<u32> {
    model
        .tokenizer
        .encode(text, true)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn request(id: u64, prompt: Vec<u32>, seed: u64, grammar: Option<GrammarSpec>) -> Request {
    Request {
        seq_id: SeqId(id),
        prompt_ids: prompt,
        num_generated: 0,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            repetition_penalty: 1.0,
            seed,
            top_n_logprobs: 0,
        },
        stopping: StoppingCriteria {
            max_new_tokens: 120,
            stop_token_ids: vec![1, 2],
            stop_strings: Vec::new(),
            ignore_eos: false,
        },
        grammar,
        prompt_logprobs: false,
    }
}

fn cfg() -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(512),
        block_size: 4,
        ..Default::default()
    }
}

fn check_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let name = v["name"].as_str().unwrap_or_else(|| panic!("{text}"));
    assert!((1..=10).contains(&name.chars().count()), "{text}");
    assert!(v["age"].as_u64().is_some_and(|a| a <= 99), "{text}");
    assert!(
        ["cat", "dog", "bird"].contains(&v["pet"].as_str().unwrap()),
        "{text}"
    );
    assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
}

#[test]
fn every_seeded_output_follows_the_schema_and_ends_with_it() {
    let model = stories();
    let mut e = engine(&model, cfg());
    let p = prompt(&model, "Once upon a time");
    let requests: Vec<Request> = (0..20)
        .map(|i| {
            request(
                i,
                p.clone(),
                1000 + i,
                Some(GrammarSpec::JsonSchema(schema())),
            )
        })
        .collect();
    for c in e.generate(requests).unwrap() {
        assert_eq!(c.finish_reason, Some(FinishReason::Eos), "{:?}", c.text);
        check_person(&c.text);
        // The grammar ended the sequence: no stop token was needed.
        assert!(!c.output_ids.iter().any(|t| [1, 2].contains(t)), "{c:?}");
    }
    assert_eq!(e.stats().num_blocks_used, 0);
}

#[test]
fn regex_and_greedy_decoding() {
    let model = stories();
    let mut e = engine(&model, cfg());
    let mut r = request(
        1,
        prompt(&model, "Lily"),
        0,
        Some(GrammarSpec::Regex("(yes|no)\\. [a-z]{2,5}!".into())),
    );
    r.sampling = SamplingParams::greedy();
    let c = e.generate(vec![r]).unwrap().remove(0);
    let text = c.text.trim_start();
    assert!(
        text.starts_with("yes. ") || text.starts_with("no. "),
        "{text:?}"
    );
    assert!(text.ends_with('!'), "{text:?}");
    assert_eq!(c.finish_reason, Some(FinishReason::Eos));
}

#[test]
fn constrained_request_is_identical_alone_batched_and_beside_free_ones() {
    let model = stories();
    let p = prompt(&model, "Once upon a time");
    let constrained = request(0, p.clone(), 4242, Some(GrammarSpec::JsonSchema(schema())));
    let free = request(1, p.clone(), 7, None);
    let alone = engine(&model, cfg())
        .generate(vec![constrained.clone()])
        .unwrap()
        .remove(0);
    let free_alone = engine(&model, cfg())
        .generate(vec![free.clone()])
        .unwrap()
        .remove(0);
    check_person(&alone.text);

    let mut e = engine(
        &model,
        EngineConfig {
            max_prefill_chunk_tokens: 3,
            ..cfg()
        },
    );
    let mut batch = vec![
        request(
            10,
            prompt(&model, "The dog"),
            3,
            Some(GrammarSpec::JsonSchema(schema())),
        ),
        free,
        constrained,
        request(
            11,
            p.clone(),
            99,
            Some(GrammarSpec::Regex("[a-z ]{3,30}\\.".into())),
        ),
    ];
    batch[0].stopping.max_new_tokens = 5;
    let out = e.generate(batch).unwrap();
    assert_eq!(
        out[2].output_ids, alone.output_ids,
        "constrained alone vs batched"
    );
    assert_eq!(out[2].text, alone.text);
    assert_eq!(
        out[1].output_ids, free_alone.output_ids,
        "unconstrained neighbour unchanged"
    );
}

#[test]
fn a_resumed_constrained_request_continues_the_same_way() {
    let model = stories();
    let p = prompt(&model, "Once upon a time");
    let full = engine(&model, cfg())
        .generate(vec![request(
            0,
            p.clone(),
            555,
            Some(GrammarSpec::JsonSchema(schema())),
        )])
        .unwrap()
        .remove(0);
    let k = full.output_ids.len() / 2;
    let mut resumed = request(0, p.clone(), 555, Some(GrammarSpec::JsonSchema(schema())));
    resumed.prompt_ids.extend_from_slice(&full.output_ids[..k]);
    resumed.num_generated = k;
    let rest = engine(&model, cfg())
        .generate(vec![resumed])
        .unwrap()
        .remove(0);
    assert_eq!(rest.output_ids, full.output_ids[k..]);
    assert_eq!(rest.finish_reason, full.finish_reason);
}

#[test]
fn a_bad_grammar_is_refused_and_leaves_nothing_behind() {
    let model = stories();
    let mut e = engine(&model, cfg());
    let bad = request(
        0,
        prompt(&model, "Hi"),
        1,
        Some(GrammarSpec::Regex("(oops".into())),
    );
    match e.add_request(bad.clone()) {
        Err(EngineError::InvalidParameter { field, .. }) => assert_eq!(field, "grammar"),
        other => panic!("{other:?}"),
    }
    assert!(!e.has_work());
    assert!(
        e.reserve(bad).is_err(),
        "a decode node refuses it before taking blocks"
    );
    assert_eq!(e.stats().num_blocks_used, 0);
}

/// Issue 31: a sequence whose grammar fails mid-generation (here `[^\s\S]`, which matches
/// nothing, as a node gets it from a gateway that does not refuse it) emitted a token outside
/// the grammar with finish reason `eos`. It now fails: no event, nothing left running, and
/// [`engine::engine::Engine::take_failed`] says why; its neighbour is untouched.
#[test]
fn a_failing_grammar_fails_its_sequence_without_a_token() {
    let model = stories();
    let empty = Some(GrammarSpec::Regex(r"[^\s\S]".into()));
    let bad = request(0, prompt(&model, "Hi"), 1, empty);
    let mut e = engine(&model, cfg());
    e.add_request(bad.clone()).unwrap();
    e.add_request(request(1, prompt(&model, "Once"), 2, None))
        .unwrap();
    let (mut events, mut failed) = (Vec::new(), Vec::new());
    while e.has_work() {
        events.extend(e.step().unwrap());
        failed.extend(e.take_failed());
    }
    assert!(
        events.iter().all(|ev| ev.seq_id == SeqId(1)),
        "no token of the failed sequence: {:?}",
        events
            .iter()
            .filter(|ev| ev.seq_id == SeqId(0))
            .collect::<Vec<_>>()
    );
    assert!(
        events.last().unwrap().finish.is_some(),
        "the neighbour ends"
    );
    assert!(
        matches!(
            failed.as_slice(),
            [(
                SeqId(0),
                EngineError::Grammar {
                    seq_id: SeqId(0),
                    ..
                }
            )]
        ),
        "{failed:?}"
    );
    assert_eq!(e.stats().num_running, 0);
    assert!(matches!(
        engine(&model, cfg()).generate(vec![bad]),
        Err(EngineError::Grammar { .. })
    ));
}
