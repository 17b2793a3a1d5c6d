//! Greedy parity with HF transformers on stories260K (`reference_greedy.json`): alone, batched
//! with other sequences, with 4-token chunked prefill, and with prefix-cache hits.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, references, stories};
use engine::engine::EngineConfig;
use engine::model::ForwardBatch;

fn small(cfg: EngineConfig) -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(256),
        ..cfg
    }
}

#[test]
fn each_prompt_alone_matches_reference() {
    let model = stories();
    for r in references() {
        let enc = model
            .tokenizer
            .encode(r.prompt.as_str(), true)
            .expect("encodes");
        assert_eq!(
            enc.get_ids(),
            r.input_ids.as_slice(),
            "tokenization of {:?}",
            r.prompt
        );
        let mut e = engine(&model, small(EngineConfig::default()));
        let out = e
            .generate(vec![greedy(0, r.input_ids.clone(), r.output_ids.len())])
            .expect("generates");
        assert_eq!(out[0].output_ids, r.output_ids, "prompt {:?}", r.prompt);
    }
}

#[test]
fn batched_with_other_lengths_matches_reference() {
    let model = stories();
    let refs = references();
    let mut e = engine(&model, small(EngineConfig::default()));
    let mut reqs = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        reqs.push(greedy(i as u64, r.input_ids.clone(), r.output_ids.len()));
    }
    // Unrelated sequences of other prompt and output lengths share every step.
    for (j, len) in [1usize, 3, 17, 40, 9].into_iter().enumerate() {
        let ids: Vec<u32> = std::iter::once(1)
            .chain((0..len).map(|k| 260 + ((k * 7 + j) % 200) as u32))
            .collect();
        reqs.push(greedy(100 + j as u64, ids, 5 + 9 * j));
    }
    let out = e.generate(reqs).expect("generates");
    for (i, r) in refs.iter().enumerate() {
        assert_eq!(
            out[i].output_ids, r.output_ids,
            "prompt {:?} in a batch",
            r.prompt
        );
    }
    assert_eq!(
        e.stats().num_blocks_used,
        0,
        "every block is freed after completion"
    );
}

#[test]
fn chunked_prefill_of_four_tokens_matches_reference() {
    let model = stories();
    let refs = references();
    let mut e = engine(
        &model,
        small(EngineConfig {
            max_prefill_chunk_tokens: 4,
            max_batch_prefill_tokens: 6,
            block_size: 4,
            ..Default::default()
        }),
    );
    let reqs = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, r.input_ids.clone(), r.output_ids.len()))
        .collect();
    let out = e.generate(reqs).expect("generates");
    for (i, r) in refs.iter().enumerate() {
        assert_eq!(
            out[i].output_ids, r.output_ids,
            "prompt {:?} chunked",
            r.prompt
        );
    }
}

#[test]
fn prefix_cache_hits_give_the_same_tokens() {
    let model = stories();
    let refs = references();
    let mut e = engine(
        &model,
        small(EngineConfig {
            block_size: 2,
            ..Default::default()
        }),
    );
    for r in &refs {
        let first = e
            .generate(vec![greedy(1, r.input_ids.clone(), r.output_ids.len())])
            .expect("first run");
        let before = e.stats().prefix_hit_blocks;
        let second = e
            .generate(vec![greedy(2, r.input_ids.clone(), r.output_ids.len())])
            .expect("second run");
        assert!(
            e.stats().prefix_hit_blocks > before,
            "the second run reused cached blocks"
        );
        assert_eq!(first[0].output_ids, r.output_ids);
        assert_eq!(
            second[0].output_ids, r.output_ids,
            "prompt {:?} from cache",
            r.prompt
        );
    }
    // A prompt that extends a cached one (prompt + its own output) hits and stays consistent.
    let r = &refs[0];
    let extended: Vec<u32> = r
        .input_ids
        .iter()
        .chain(&r.output_ids[..10])
        .copied()
        .collect();
    let out = e
        .generate(vec![greedy(3, extended, 5)])
        .expect("extended run");
    assert_eq!(out[0].output_ids, r.output_ids[10..15]);
}

#[test]
fn first_position_logits_match_reference_top5() {
    let model = stories();
    for r in references() {
        let mut e = engine(&model, small(EngineConfig::default()));
        let mut fb = ForwardBatch::default();
        let n = r.input_ids.len();
        fb.push_seq(
            &r.input_ids,
            0,
            (0..n.div_ceil(16) as u32).collect(),
            16,
            true,
        );
        let logits = model.model.forward(&fb, e.cache_mut()).expect("forward");
        let row: Vec<f32> = logits
            .flatten_all()
            .expect("flat")
            .to_vec1()
            .expect("f32 logits");
        for t in &r.first_position_top5 {
            let got = row[t.id as usize];
            assert!(
                (got - t.logit).abs() <= 1e-4,
                "prompt {:?} token {}: logit {got} vs reference {}",
                r.prompt,
                t.id,
                t.logit
            );
        }
    }
}

#[test]
fn preemption_and_recompute_keep_reference_tokens() {
    let model = stories();
    let refs = references();
    // 3 sequences of ~40 tokens each need ~30 blocks of 4; 16 blocks force preemption.
    let mut e = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(16),
            block_size: 4,
            // Admission by what fits now, so that growth preempts.
            reserve_output: false,
            ..Default::default()
        },
    );
    let reqs = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, r.input_ids.clone(), r.output_ids.len()))
        .collect();
    let out = e.generate(reqs).expect("generates");
    assert!(
        e.stats().preemptions > 0,
        "the cache was small enough to preempt"
    );
    for (i, r) in refs.iter().enumerate() {
        assert_eq!(
            out[i].output_ids, r.output_ids,
            "prompt {:?} after preemption",
            r.prompt
        );
    }
    assert_eq!(e.stats().num_blocks_used, 0);
}
