//! The engine's disaggregation path in one process: a prefill engine exports each layer's KV
//! as bytes right after computing it, a decode engine imports them into reserved blocks and
//! continues. Tokens must equal the colocated run's (greedy: the reference; seeded: the same).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, references, stories};
use engine::engine::{Engine, EngineConfig, LayerDone, Request};
use engine::ids::SeqId;
use engine::model::LoadedModel;
use engine::sampling::SamplingParams;
use engine::stopping::FinishReason;

fn cfg(block_size: usize) -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(128),
        block_size,
        ..Default::default()
    }
}

/// Runs `req` split across two engines; returns all generated ids.
fn disaggregated(model: &LoadedModel, req: Request, prefill: &mut Engine) -> Vec<u32> {
    let mut decode = engine(model, cfg(4));
    let dest = decode.reserve(req.clone()).expect("reserve");
    assert_eq!(decode.stats().num_blocks_used, dest.len());
    prefill
        .add_prefill_request(req.clone())
        .expect("prefill request");
    let mut layers: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut first = None;
    while first.is_none() {
        let events = prefill
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                for (_seq, blocks) in done.completing {
                    let mut buf = vec![0u8; done.cache.export_len(blocks.len())];
                    done.cache.export_blocks(done.layer, blocks, &mut buf)?;
                    layers.push((done.layer, buf));
                }
                Ok(())
            })
            .expect("prefill step");
        first = events.into_iter().next();
    }
    let first = first.expect("first token");
    assert_eq!(
        layers.len(),
        model.config().num_layers,
        "one push per layer"
    );
    assert_eq!(
        prefill.stats().num_running,
        0,
        "prefill engine is done with it"
    );
    for (layer, bytes) in &layers {
        decode
            .cache_mut()
            .import_blocks(*layer, &dest, bytes)
            .expect("import");
    }
    let mut ids = vec![first.token.token_id];
    if decode
        .activate(req.seq_id, first.token)
        .expect("activate")
        .is_some()
    {
        return ids;
    }
    while decode.has_work() {
        for ev in decode.step().expect("decode step") {
            ids.push(ev.token.token_id);
        }
    }
    assert_eq!(
        decode.stats().num_blocks_used,
        0,
        "decode freed every block"
    );
    ids
}

#[test]
fn greedy_disaggregated_matches_reference() {
    let model = stories();
    let mut prefill = engine(&model, cfg(4));
    for (i, r) in references().into_iter().enumerate() {
        let ids = disaggregated(
            &model,
            greedy(i as u64, r.input_ids.clone(), r.output_ids.len()),
            &mut prefill,
        );
        assert_eq!(ids, r.output_ids, "prompt {:?}", r.prompt);
    }
}

#[test]
fn seeded_disaggregated_equals_colocated() {
    let model = stories();
    let r = &references()[1];
    let mut req = greedy(5, r.input_ids.clone(), 40);
    req.sampling = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.9,
        repetition_penalty: 1.0,
        seed: 77,
        top_n_logprobs: 0,
    };
    let colocated = engine(&model, cfg(4))
        .generate(vec![req.clone()])
        .expect("colocated")
        .remove(0);
    let mut prefill = engine(&model, cfg(4));
    assert_eq!(
        disaggregated(&model, req, &mut prefill),
        colocated.output_ids
    );
}

#[test]
fn constrained_disaggregated_equals_colocated() {
    // The prefill node samples the first token under the grammar; the decode node follows the
    // grammar past it and carries on.
    let model = stories();
    let r = &references()[0];
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["word", "n"],
        "additionalProperties": false
    });
    for seed in [1, 2, 3] {
        let mut req = greedy(seed, r.input_ids.clone(), 60);
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed,
            top_n_logprobs: 0,
        };
        req.stopping.ignore_eos = false;
        req.stopping.stop_token_ids = vec![1, 2];
        req.grammar = Some(grammar::GrammarSpec::JsonSchema(schema.clone()));
        let colocated = engine(&model, cfg(4))
            .generate(vec![req.clone()])
            .expect("colocated")
            .remove(0);
        assert_eq!(
            colocated.finish_reason,
            Some(FinishReason::Eos),
            "{colocated:?}"
        );
        let mut prefill = engine(&model, cfg(4));
        assert_eq!(
            disaggregated(&model, req, &mut prefill),
            colocated.output_ids,
            "seed {seed}"
        );
    }
}

#[test]
fn reservations_are_bounded_and_released() {
    let model = stories();
    let mut decode = engine(
        &model,
        EngineConfig {
            num_kv_blocks: Some(16),
            block_size: 4,
            reservation_fraction: 0.5,
            ..Default::default()
        },
    );
    let prompt: Vec<u32> = (0..12).map(|i| 300 + i).collect();
    // 3 blocks each; the pool holds 8 blocks, so the third reservation is refused.
    decode.reserve(greedy(1, prompt.clone(), 4)).expect("first");
    decode
        .reserve(greedy(2, prompt.clone(), 4))
        .expect("second");
    assert!(
        decode.reserve(greedy(3, prompt.clone(), 4)).is_err(),
        "pool exhausted"
    );
    assert_eq!(decode.num_reserved_blocks(), 6);
    assert!(decode.cancel(SeqId(1)));
    assert!(decode.release_reservation(SeqId(2)));
    assert!(!decode.release_reservation(SeqId(2)), "released once");
    assert_eq!(decode.stats().num_blocks_used, 0);
    // A first token that already ends the request frees the reservation at activation.
    let mut r = greedy(4, prompt, 1);
    r.stopping.max_new_tokens = 1;
    decode.reserve(r).expect("reserve");
    let tok = engine::sampling::SampledToken {
        token_id: 300,
        logprob: 0.0,
        top_logprobs: Vec::new(),
    };
    assert_eq!(
        decode.activate(SeqId(4), tok).expect("activate"),
        Some(FinishReason::Length)
    );
    assert_eq!(decode.stats().num_blocks_used, 0);
}

/// Issue 31: a first token (the prefill node's) that the grammar refuses ended the request
/// with a made-up `eos`; a prefill whose mask failed sampled outside the grammar. Now the
/// decode node's activation fails with the grammar's error and frees its blocks, and the
/// prefill engine reports the failure instead of a first token.
#[test]
fn a_first_token_outside_the_grammar_fails_the_request() {
    let model = stories();
    let r = &references()[0];
    let mut req = greedy(7, r.input_ids.clone(), 20);
    req.grammar = Some(grammar::GrammarSpec::Regex("[0-9]+".into()));
    let letter = (3..512)
        .find(|&id| {
            let text = model.tokenizer.decode(&[id], false).unwrap();
            !text.is_empty() && text.chars().all(char::is_alphabetic)
        })
        .expect("a token of letters");
    let mut decode = engine(&model, cfg(4));
    decode.reserve(req.clone()).expect("reserve");
    let first = engine::sampling::SampledToken {
        token_id: letter,
        logprob: 0.0,
        top_logprobs: Vec::new(),
    };
    match decode.activate(req.seq_id, first) {
        Err(engine::error::EngineError::Grammar { seq_id, .. }) => assert_eq!(seq_id, req.seq_id),
        other => panic!("{other:?}"),
    }
    assert_eq!(decode.stats().num_blocks_used, 0, "its blocks are free");
    assert!(!decode.has_work());

    let mut prefill = engine(&model, cfg(4));
    req.grammar = Some(grammar::GrammarSpec::Regex(r"[^\s\S]".into()));
    prefill.add_prefill_request(req.clone()).expect("prefill");
    let mut events = Vec::new();
    while prefill.has_work() {
        events.extend(prefill.step().expect("step"));
    }
    assert!(events.is_empty(), "no first token: {events:?}");
    let failed = prefill.take_failed();
    assert!(
        matches!(failed.as_slice(), [(id, engine::error::EngineError::Grammar { .. })] if *id == req.seq_id),
        "{failed:?}"
    );
}
