//! A seeded request yields the same tokens alone and in any batch, because its random stream
//! depends only on (seed, position).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, stories};
use engine::engine::{EngineConfig, Request};
use engine::ids::SeqId;
use engine::sampling::SamplingParams;
use engine::stopping::{FinishReason, StoppingCriteria};

fn seeded(id: u64, prompt: Vec<u32>, seed: u64) -> Request {
    Request {
        num_generated: 0,
        seq_id: SeqId(id),
        prompt_ids: prompt,
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed,
            top_n_logprobs: 3,
        },
        stopping: StoppingCriteria {
            max_new_tokens: 48,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: true,
        },
        grammar: None,
        prompt_logprobs: false,
    }
}

#[test]
fn seeded_request_is_identical_alone_and_batched() {
    let model = stories();
    let prompt = model
        .tokenizer
        .encode("Once upon a time", true)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let cfg = EngineConfig {
        num_kv_blocks: Some(512),
        block_size: 4,
        ..Default::default()
    };
    let alone = engine(&model, cfg.clone())
        .generate(vec![seeded(0, prompt.clone(), 1234)])
        .expect("alone")
        .remove(0);
    // The same request amid others with other seeds, lengths, chunking and a prefix hit.
    let mut e = engine(
        &model,
        EngineConfig {
            max_prefill_chunk_tokens: 3,
            ..cfg.clone()
        },
    );
    let mut reqs = vec![greedy(10, prompt.clone(), 7)];
    for j in 0..6u64 {
        let p: Vec<u32> = std::iter::once(1)
            .chain((0..(3 + 5 * j)).map(|k| 300 + ((k * 13 + j) % 150) as u32))
            .collect();
        reqs.push(seeded(20 + j, p, 99 + j));
    }
    reqs.insert(3, seeded(1, prompt.clone(), 1234));
    let batched = e.generate(reqs).expect("batched");
    let in_batch = batched
        .into_iter()
        .find(|c| c.tokens.len() == 48 && c.prompt_ids == prompt)
        .expect("found");
    assert_eq!(alone.output_ids, in_batch.output_ids);
    // Rows of a batch are sampled on several threads: the log-probabilities match too.
    let logprobs = |c: &engine::engine::Completion| -> Vec<_> {
        c.tokens
            .iter()
            .map(|t| (t.logprob.to_bits(), t.top_logprobs.clone()))
            .collect()
    };
    assert_eq!(logprobs(&alone), logprobs(&in_batch));
    // Sampling really is random: another seed gives another sequence.
    let other = engine(&model, cfg)
        .generate(vec![seeded(0, prompt, 4321)])
        .expect("other seed")
        .remove(0);
    assert_ne!(alone.output_ids, other.output_ids);
    assert_eq!(alone.tokens[0].top_logprobs.len(), 3);
}

#[test]
fn stop_strings_and_eos_end_sequences() {
    let model = stories();
    let prompt = model
        .tokenizer
        .encode("Once upon a time", true)
        .expect("encodes")
        .get_ids()
        .to_vec();
    let mut e = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(64),
            ..Default::default()
        },
    );
    // Greedy text is ", there was a little girl named Lily. ..." (reference_greedy.json).
    let mut r = greedy(0, prompt.clone(), 32);
    r.stopping.stop_strings = vec!["little girl".into()];
    let out = e.generate(vec![r]).expect("stop string").remove(0);
    assert_eq!(out.finish_reason, Some(FinishReason::Stop));
    assert_eq!(out.text, ", there was a ");
    // Token 383 ("▁there") is the second greedy token: as a stop id it ends with eos.
    let mut r = greedy(1, prompt, 32);
    r.stopping.stop_token_ids = vec![383];
    r.stopping.ignore_eos = false;
    let out = e.generate(vec![r]).expect("eos").remove(0);
    assert_eq!(out.finish_reason, Some(FinishReason::Eos));
    assert_eq!(out.output_ids, vec![432, 383]);
    assert_eq!(out.text, ",");
    assert_eq!(e.stats().num_blocks_used, 0);
}
