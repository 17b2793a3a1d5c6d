//! Prompt logprobs (TGI's `decoder_input_details`) on stories260K: each prompt token's logprob
//! equals what the decode path reports for the same token when it generates it, whatever the
//! chunking, the batch, the prefix cache or the node (colocated, or a prefill node's first
//! token).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, references, stories};
use engine::engine::{Completion, Engine, EngineConfig, Request};

fn config(chunk: usize) -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(256),
        max_prefill_chunk_tokens: chunk,
        ..EngineConfig::default()
    }
}

fn with_prompt_logprobs(id: u64, prompt: Vec<u32>) -> Request {
    Request {
        prompt_logprobs: true,
        ..greedy(id, prompt, 1)
    }
}

fn run(e: &mut Engine, req: Request) -> Completion {
    e.generate(vec![req]).unwrap().remove(0)
}

fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance,
            "{what}: position {i}: {g} against {w}"
        );
    }
}

/// For each reference, the reference's prompt followed by its greedy output, and the logprob
/// the decode path reported for each output token.
fn decoded() -> Vec<(Vec<u32>, usize, Vec<f32>)> {
    let model = stories();
    references()
        .into_iter()
        .map(|r| {
            let mut e = engine(&model, config(4096));
            let out = run(&mut e, greedy(0, r.input_ids.clone(), r.output_ids.len()));
            assert_eq!(out.output_ids, r.output_ids, "greedy parity first");
            let whole: Vec<u32> = r.input_ids.iter().chain(&r.output_ids).copied().collect();
            let logprobs = out.tokens.iter().map(|t| t.logprob).collect();
            (whole, r.input_ids.len(), logprobs)
        })
        .collect()
}

#[test]
fn prompt_logprobs_equal_the_decode_paths_logprobs_of_the_same_tokens() {
    let model = stories();
    for (whole, input_len, decoded) in decoded() {
        let mut e = engine(&model, config(4096));
        let out = run(&mut e, with_prompt_logprobs(1, whole.clone()));
        assert_eq!(out.prompt_logprobs.len(), whole.len() - 1);
        assert!(out
            .prompt_logprobs
            .iter()
            .all(|l| l.is_finite() && *l <= 0.0));
        // Position i scores token i + 1: the output tokens start at input_len.
        let scored_outputs = &out.prompt_logprobs[input_len - 1..];
        // The last output token is scored in the prompt; its successor is the sampled one.
        assert_close(scored_outputs, &decoded, 1e-3, "prefill against decode");
    }
}

#[test]
fn chunking_batching_and_the_prefix_cache_leave_them_unchanged() {
    let model = stories();
    let (whole, _, _) = decoded().remove(0);
    let mut one_chunk = engine(&model, config(4096));
    let reference = run(&mut one_chunk, with_prompt_logprobs(1, whole.clone())).prompt_logprobs;

    // Chunks of 5 tokens, beside another sequence.
    let mut chunked = engine(&model, config(5));
    let out = chunked
        .generate(vec![
            greedy(9, vec![1, 300, 301, 302, 303, 304, 305], 12),
            with_prompt_logprobs(1, whole.clone()),
        ])
        .unwrap();
    assert!(out[0].prompt_logprobs.is_empty(), "not asked for");
    assert_close(
        &out[1].prompt_logprobs,
        &reference,
        1e-4,
        "chunked, batched",
    );

    // The prompt's blocks are cached by the first request; the second computes them anyway.
    let mut cached = engine(&model, config(4096));
    run(&mut cached, greedy(2, whole.clone(), 1));
    let hits_before = cached.stats().prefix_hit_blocks;
    let out = run(&mut cached, with_prompt_logprobs(3, whole.clone()));
    assert_eq!(
        cached.stats().prefix_hit_blocks,
        hits_before,
        "no cache hit"
    );
    assert_close(&out.prompt_logprobs, &reference, 1e-4, "after caching");
    // A request without them still hits the cache.
    run(&mut cached, greedy(4, whole.clone(), 1));
    assert!(cached.stats().prefix_hit_blocks > hits_before);
}

#[test]
fn a_prefill_nodes_first_token_carries_them_and_a_resume_does_not() {
    let model = stories();
    let (whole, _, _) = decoded().remove(0);
    let mut colocated = engine(&model, config(4096));
    let reference = run(&mut colocated, with_prompt_logprobs(1, whole.clone())).prompt_logprobs;

    let mut prefill = engine(&model, config(4096));
    prefill
        .add_prefill_request(with_prompt_logprobs(1, whole.clone()))
        .unwrap();
    let mut first = None;
    while first.is_none() {
        first = prefill.step().unwrap().into_iter().next();
    }
    let first = first.unwrap();
    assert_eq!(first.index, 0);
    assert_close(&first.prompt_logprobs, &reference, 1e-4, "prefill node");

    // A resumed request (its last tokens already generated) reports none.
    let mut resumed = engine(&model, config(4096));
    let out = run(
        &mut resumed,
        Request {
            num_generated: 2,
            prompt_logprobs: true,
            ..greedy(5, whole.clone(), 4)
        },
    );
    assert!(out.prompt_logprobs.is_empty());
}
