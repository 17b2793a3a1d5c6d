//! A request resumed elsewhere (migration): given its prompt plus the tokens it already
//! generated (`num_generated` of them), the engine continues exactly where it stopped: the same
//! tokens for a seeded or greedy request, the same text, and a stop string that spans the
//! migration point still matches at the same token.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, stories};
use engine::engine::{Engine, EngineConfig, Request};
use engine::ids::SeqId;
use engine::sampling::SamplingParams;
use engine::stopping::{FinishReason, StoppingCriteria};

const MAX_NEW: usize = 40;

fn request(prompt: Vec<u32>, num_generated: usize, stop: Vec<String>, seed: u64) -> Request {
    Request {
        seq_id: SeqId(1),
        prompt_ids: prompt,
        num_generated,
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed,
            top_n_logprobs: 0,
        },
        stopping: StoppingCriteria {
            max_new_tokens: MAX_NEW,
            stop_token_ids: Vec::new(),
            stop_strings: stop,
            ignore_eos: true,
        },
        grammar: None,
        prompt_logprobs: false,
    }
}

/// Each token's id, index, text and finish, in order.
fn run(e: &mut Engine, r: Request) -> Vec<(u32, usize, String, Option<FinishReason>)> {
    e.add_request(r).unwrap();
    let mut out = Vec::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            out.push((ev.token.token_id, ev.index, ev.text, ev.finish));
        }
    }
    out
}

fn fresh() -> Engine {
    engine(
        &stories(),
        EngineConfig {
            num_kv_blocks: Some(256),
            block_size: 4,
            ..Default::default()
        },
    )
}

fn prompt() -> Vec<u32> {
    stories()
        .tokenizer
        .encode("Once upon a time", true)
        .unwrap()
        .get_ids()
        .to_vec()
}

fn text(events: &[(u32, usize, String, Option<FinishReason>)]) -> String {
    events.iter().map(|e| e.2.as_str()).collect()
}

#[test]
fn a_resumed_request_continues_with_the_same_tokens_and_text() {
    let prompt = prompt();
    let whole = run(&mut fresh(), request(prompt.clone(), 0, Vec::new(), 77));
    assert_eq!(whole.len(), MAX_NEW);
    for k in [1, 7, 23, MAX_NEW - 1] {
        let mut resumed_prompt = prompt.clone();
        resumed_prompt.extend(whole[..k].iter().map(|e| e.0));
        let rest = run(&mut fresh(), request(resumed_prompt, k, Vec::new(), 77));
        assert_eq!(rest, whole[k..], "resumed after {k} tokens");
    }
}

#[test]
fn a_stop_string_across_the_migration_point_still_matches() {
    let prompt = prompt();
    let whole = run(&mut fresh(), request(prompt.clone(), 0, Vec::new(), 5));
    // A stop string made of the text just before token k and just after it.
    let k = 12;
    let before = text(&whole[..k]);
    let after = text(&whole[k..k + 3]);
    let stop = format!(
        "{}{}",
        &before[before.len() - 3..],
        &after[..after.len().min(3)]
    );
    assert!(
        !before[..before.len() - 3].contains(&stop),
        "{stop:?} first matches at k"
    );
    let stopped = run(
        &mut fresh(),
        request(prompt.clone(), 0, vec![stop.clone()], 5),
    );
    let last = stopped.last().unwrap();
    assert_eq!(last.3, Some(FinishReason::Stop), "{stop:?}");
    assert!(
        last.1 >= k,
        "the stop string ends after the migration point"
    );

    let mut resumed_prompt = prompt;
    resumed_prompt.extend(whole[..k].iter().map(|e| e.0));
    let resumed = run(&mut fresh(), request(resumed_prompt, k, vec![stop], 5));
    // The same tokens, the same finish, and the same text released after the point.
    assert_eq!(resumed, stopped[k..]);
}
