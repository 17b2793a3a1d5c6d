//! Delta pushes in one process (issue 34): a decode engine that holds a conversation's earlier
//! turns in its prefix cache links those blocks into the next turn's reservation
//! ([`Engine::reserve_linking`]), the prefill engine exports only the blocks after them, and
//! the tokens equal a full push's. A prefix evicted before the reservation links nothing, and
//! the whole prompt is pushed.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use common::{engine, greedy, references, stories};
use engine::engine::{Engine, EngineConfig, LayerDone, Request};
use engine::ids::SeqId;
use engine::model::LoadedModel;

const BS: usize = 4;

fn cfg(num_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(num_blocks),
        block_size: BS,
        ..Default::default()
    }
}

/// What one pushed turn did.
struct Turn {
    ids: Vec<u32>,
    /// Prompt blocks the decode engine linked from its prefix cache.
    cached: usize,
    /// Bytes the prefill engine exported, over every layer.
    pushed: usize,
}

/// Serves `req` with `prefill` computing the prompt and `decode` generating: linked
/// (`link`) or a full push.
fn turn(decode: &mut Engine, prefill: &mut Engine, req: Request, link: bool) -> Turn {
    let (blocks, cached) = match link {
        true => decode.reserve_linking(req.clone()).unwrap(),
        false => (decode.reserve(req.clone()).unwrap(), 0),
    };
    assert_eq!(blocks.len(), req.prompt_ids.len().div_ceil(BS));
    prefill.add_prefill_request(req.clone()).unwrap();
    let mut layers: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut first = None;
    while first.is_none() {
        let events = prefill
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                for (_seq, table) in done.completing {
                    // The prefill engine's table covers the whole prompt; the decode engine
                    // holds its first `cached` blocks already.
                    let table = &table[cached..];
                    let mut buf = vec![0u8; done.cache.export_len(table.len())];
                    done.cache.export_blocks(done.layer, table, &mut buf)?;
                    layers.push((done.layer, buf));
                }
                Ok(())
            })
            .unwrap();
        first = events.into_iter().next();
    }
    let first = first.unwrap();
    let pushed = layers.iter().map(|(_, b)| b.len()).sum();
    for (layer, bytes) in &layers {
        decode.import_layer(req.seq_id, *layer, bytes).unwrap();
    }
    let mut ids = vec![first.token.token_id];
    if decode.activate(req.seq_id, first.token).unwrap().is_none() {
        while decode.has_work() {
            for ev in decode.step().unwrap() {
                ids.push(ev.token.token_id);
            }
        }
    }
    assert_eq!(decode.stats().num_blocks_used, 0, "every block given back");
    assert_eq!(decode.num_reserved_blocks(), 0);
    Turn {
        ids,
        cached,
        pushed,
    }
}

/// Bytes of `blocks` blocks over every layer, as the push exports them.
fn push_bytes(engine: &Engine, blocks: usize) -> usize {
    engine.cache().export_len(blocks) * engine.cache().num_layers()
}

/// Turn 2 of a chat: turn 1's prompt and answer, then `more` new tokens.
fn next_turn(prompt: &[u32], answer: &[u32], more: usize) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    ids.extend_from_slice(answer);
    ids.extend((0..more as u32).map(|i| 300 + (i * 37) % 200));
    ids
}

fn model_and_prompt() -> (LoadedModel, Vec<u32>) {
    let r = references().remove(1);
    (stories(), r.input_ids)
}

#[test]
fn a_second_turn_pushes_only_the_blocks_the_decode_engine_lacks() {
    let (model, p1) = model_and_prompt();
    let mut prefill = engine(&model, cfg(256));
    let mut decode = engine(&model, cfg(256));
    let t1 = turn(&mut decode, &mut prefill, greedy(1, p1.clone(), 20), true);
    assert_eq!(t1.cached, 0, "nothing cached yet");
    assert_eq!(t1.pushed, push_bytes(&decode, p1.len().div_ceil(BS)));

    let p2 = next_turn(&p1, &t1.ids, 13);
    let linked = turn(&mut decode, &mut prefill, greedy(2, p2.clone(), 20), true);
    // The decode engine computed the KV of turn 1's prompt and of every answer token but the
    // last (sampled, never fed): its full blocks are what it holds.
    let held = (p1.len() + t1.ids.len() - 1) / BS;
    assert_eq!(linked.cached, held);
    let blocks = p2.len().div_ceil(BS);
    assert_eq!(linked.pushed, push_bytes(&decode, blocks - held));

    // The same turn as a full push into a fresh decode engine.
    let mut fresh = engine(&model, cfg(256));
    let full = turn(&mut fresh, &mut prefill, greedy(3, p2.clone(), 20), false);
    assert_eq!(full.pushed, push_bytes(&decode, blocks));
    assert_eq!(linked.ids, full.ids, "delta and full push agree");
    let colocated = engine(&model, cfg(256))
        .generate(vec![greedy(4, p2, 20)])
        .unwrap()
        .remove(0);
    assert_eq!(linked.ids, colocated.output_ids);
}

#[test]
fn an_evicted_prefix_falls_back_to_a_full_push() {
    let (model, p1) = model_and_prompt();
    let mut prefill = engine(&model, cfg(256));
    // A small cache: the other conversations below evict turn 1's blocks, the least
    // recently used, before turn 2 comes.
    let mut decode = engine(&model, cfg(64));
    let t1 = turn(&mut decode, &mut prefill, greedy(1, p1.clone(), 8), true);
    let p2 = next_turn(&p1, &t1.ids, 5);
    for other in 0..3u32 {
        let filler: Vec<u32> = (0..80).map(|i| 20 + other * 150 + i).collect();
        turn(
            &mut decode,
            &mut prefill,
            greedy(10 + u64::from(other), filler, 8),
            true,
        );
    }
    let evicted = turn(&mut decode, &mut prefill, greedy(3, p2.clone(), 12), true);
    assert_eq!(evicted.cached, 0, "turn 1's blocks were evicted");
    assert_eq!(evicted.pushed, push_bytes(&decode, p2.len().div_ceil(BS)));
    let colocated = engine(&model, cfg(256))
        .generate(vec![greedy(4, p2, 12)])
        .unwrap()
        .remove(0);
    assert_eq!(evicted.ids, colocated.output_ids);
}

#[test]
fn a_released_linked_reservation_keeps_the_prefix_cached() {
    let (model, p1) = model_and_prompt();
    let mut prefill = engine(&model, cfg(256));
    let mut decode = engine(&model, cfg(256));
    let t1 = turn(&mut decode, &mut prefill, greedy(1, p1.clone(), 12), true);
    let p2 = next_turn(&p1, &t1.ids, 9);
    let (blocks, cached) = decode.reserve_linking(greedy(2, p2.clone(), 8)).unwrap();
    assert!(cached > 0);
    assert_eq!(decode.stats().num_blocks_used, blocks.len());
    // A payload over every block of the prompt is refused: the push covers the rest only.
    let whole = vec![0u8; push_bytes(&decode, blocks.len()) / decode.cache().num_layers()];
    assert!(decode.import_layer(SeqId(2), 0, &whole).is_err());
    assert!(decode.release_reservation(SeqId(2)));
    assert_eq!(decode.stats().num_blocks_used, 0);
    // Cancelled (the gateway gave up), the linked blocks went back to the cache, not away.
    let (again, cached_again) = decode.reserve_linking(greedy(3, p2, 8)).unwrap();
    assert_eq!(cached_again, cached);
    assert_eq!(again[..cached], blocks[..cached]);
    assert!(decode.cancel(SeqId(3)));
    assert_eq!(decode.stats().num_blocks_used, 0);
}
