//! Sliding-window KV memory (issue 32): on a Gemma-3-shaped model (five sliding layers of a
//! 512-token window to one global layer), a 4,096-token prompt holds a window of blocks in
//! each sliding layer instead of the whole prompt, generates the same ids as an engine that
//! keeps every block, reuses its prefix exactly, and gives every block back. A prefill engine
//! pushes a sliding layer's window only, and a decode engine decodes the same ids from it.
//!
//! The block counts come from the engine's counters ([`Engine::kv_usage`]); the expected
//! counts from the window arithmetic of `kv::groups`. `--nocapture` prints the figures that
//! `benchmarks/history/2026-11-29-window-kv.md` records.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::Device;
use common::arch_refs::{stories_tokenizer, variant};
use common::greedy;
use engine::engine::{Engine, EngineConfig, LayerDone, Request, TokenEvent};
use engine::ids::SeqId;
use engine::kv::groups::{first_live_block, first_pushed_block, KvGroups};
use engine::loader::ModelSource;
use engine::model::LoadedModel;

const WINDOW: usize = 512;
const BS: usize = 16;
const PROMPT: usize = 4096;
const CHUNK: usize = 512;
const NEW_TOKENS: usize = 8;

/// Gemma 3's shape at test size: 6 layers, every sixth global, a 512-token window.
fn gemma3_shaped() -> (tempfile::TempDir, LoadedModel) {
    let mut spec = variant("gemma3").spec;
    spec.layers = 6;
    spec.sliding_window = Some(WINDOW);
    spec.sliding_window_pattern = Some(6);
    spec.max_pos = 8192;
    let dir = tempfile::tempdir().unwrap();
    random_model::write_model(dir.path(), &spec, &stories_tokenizer()).unwrap();
    let model = LoadedModel::load(
        &ModelSource::Local(dir.path().to_path_buf()),
        None,
        &Device::Cpu,
    )
    .unwrap();
    (dir, model)
}

fn config() -> EngineConfig {
    EngineConfig {
        block_size: BS,
        num_kv_blocks: Some(2 * PROMPT / BS + 8),
        max_prefill_chunk_tokens: CHUNK,
        max_batch_prefill_tokens: CHUNK,
        max_num_seqs: 4,
        ..Default::default()
    }
}

fn prompt(vocab: usize) -> Vec<u32> {
    (0..PROMPT)
        .map(|i| ((i * 7919 + 13) % (vocab - 3) + 3) as u32)
        .collect()
}

/// What one run held, per layer group, in blocks and in bytes over all layers.
struct Held {
    ids: Vec<u32>,
    /// When the first token is out: the prompt's KV, as a decode carries it on.
    after_prefill: Vec<usize>,
    after_prefill_bytes: usize,
    /// The most at once since the engine started, prefill chunks included.
    peak: Vec<usize>,
    peak_bytes: usize,
}

/// Bytes over every layer of `blocks[g]` blocks in each group `g`.
fn bytes(engine: &Engine, blocks: &[usize]) -> usize {
    let layer_block = 2 * engine.cache().layout().block_bytes() as usize;
    let groups = engine.cache().groups();
    blocks
        .iter()
        .enumerate()
        .map(|(g, n)| n * groups.num_layers_in(g) * layer_block)
        .sum()
}

fn run(engine: &mut Engine, id: u64, prompt: &[u32]) -> Held {
    engine
        .add_request(greedy(id, prompt.to_vec(), NEW_TOKENS))
        .unwrap();
    let used =
        |e: &Engine| -> Vec<usize> { e.kv_usage().iter().map(|u| u.num_blocks_used).collect() };
    let groups = engine.kv_usage().len();
    let mut held = Held {
        ids: Vec::new(),
        after_prefill: Vec::new(),
        after_prefill_bytes: 0,
        peak: vec![0; groups],
        peak_bytes: 0,
    };
    while engine.has_work() {
        for ev in engine.step().unwrap() {
            if ev.index == 0 {
                held.after_prefill = used(engine);
                held.after_prefill_bytes = engine.kv_bytes_in_use();
            }
            held.ids.push(ev.token.token_id);
        }
    }
    // The engine's high-water marks, counted as each step was planned (its blocks grown,
    // before its end freed those the window passed).
    held.peak = engine
        .kv_usage()
        .iter()
        .map(|u| u.peak_blocks_used)
        .collect();
    held.peak_bytes = bytes(engine, &held.peak);
    // Every block is back (cached blocks are free to take).
    assert!(
        used(engine).iter().all(|&n| n == 0),
        "{:?}",
        engine.kv_usage()
    );
    assert_eq!(engine.kv_bytes_in_use(), 0);
    held
}

#[test]
fn a_4096_token_prompt_holds_one_window_per_sliding_layer() {
    let (_dir, model) = gemma3_shaped();
    let tokens = prompt(model.config().vocab_size);
    let mut windowed = Engine::new(model.clone(), config()).unwrap();
    let mut full = Engine::with_full_kv(model, config()).unwrap();
    let groups = windowed.cache().groups().clone();
    assert_eq!(groups.windows(), &[WINDOW]);
    assert_eq!((groups.num_layers_in(0), groups.num_layers_in(1)), (1, 5));
    assert_eq!(full.cache().groups().num_groups(), 1);

    let w = run(&mut windowed, 1, &tokens);
    let f = run(&mut full, 1, &tokens);
    assert_eq!(w.ids, f.ids, "freeing the window's past changes no token");
    assert_eq!(w.ids.len(), NEW_TOKENS);

    // After the prompt, the next query (at 4096) reads keys 3585..: blocks 224..256.
    let blocks = PROMPT / BS;
    let live = blocks - first_live_block(PROMPT, WINDOW, BS);
    assert_eq!(live, 32);
    assert_eq!(w.after_prefill, vec![blocks, live]);
    assert_eq!(f.after_prefill, vec![blocks]);
    // At the peak a 512-token chunk's table runs from its first query's window to its end.
    let chunk_peak = (0..PROMPT)
        .step_by(CHUNK)
        .map(|s| (s + CHUNK).div_ceil(BS) - first_live_block(s, WINDOW, BS))
        .max()
        .unwrap();
    assert_eq!(w.peak[1], chunk_peak);
    assert!(w.peak[1] <= KvGroups::window_blocks_per_seq(WINDOW, CHUNK, BS));
    assert!(w.peak[0] <= blocks + 1 && f.peak[0] <= blocks + 1);

    let held = w.after_prefill_bytes as f64 / f.after_prefill_bytes as f64;
    let peak = w.peak_bytes as f64 / f.peak_bytes as f64;
    let layer_block = 2 * windowed.cache().layout().block_bytes() as usize;
    assert_eq!(w.after_prefill_bytes, (blocks + 5 * live) * layer_block);
    assert_eq!(f.after_prefill_bytes, 6 * blocks * layer_block);
    eprintln!(
        "held after prefill: windowed {} B ({:?} blocks) vs full {} B ({:?}): {:.3}",
        w.after_prefill_bytes, w.after_prefill, f.after_prefill_bytes, f.after_prefill, held
    );
    eprintln!(
        "peak during prefill (chunks of {CHUNK}): windowed {} B ({:?}) vs full {} B ({:?}): {:.3}",
        w.peak_bytes, w.peak, f.peak_bytes, f.peak, peak
    );
    eprintln!(
        "allocated pools: windowed {} B ({:?} blocks) vs full {} B",
        windowed.cache().kv_bytes(),
        windowed
            .kv_usage()
            .iter()
            .map(|u| u.num_blocks_total)
            .collect::<Vec<_>>(),
        full.cache().kv_bytes()
    );
    assert!(held <= 0.40, "held {held:.3} of full attention's bytes");
    assert!(peak <= 0.40, "peak {peak:.3} of full attention's bytes");
}

/// The second run of the prompt takes its prefix from the cache, its sliding group included
/// (the window's past was freed but kept its hashes), and generates the same ids.
#[test]
fn a_repeated_prompt_reuses_its_prefix_in_every_group_exactly() {
    let (_dir, model) = gemma3_shaped();
    let tokens = prompt(model.config().vocab_size);
    let mut e = Engine::new(model, config()).unwrap();
    let first = run(&mut e, 1, &tokens);
    let before = e.stats().prefix_hit_blocks;
    let again = run(&mut e, 2, &tokens);
    assert_eq!(again.ids, first.ids);
    // Every full block but the one that holds the last prompt token is reused.
    assert_eq!(
        e.stats().prefix_hit_blocks - before,
        (PROMPT - 1) as u64 / BS as u64
    );
    // The high-water marks are the first run's: the second held no more.
    assert_eq!(again.peak, first.peak);
}

/// Pushes `req`'s prompt from `prefill` into a reservation on `decode` as a prefill node
/// does: each finished layer exports the blocks [`LayerDone::pushed_blocks`] names (a sliding
/// layer's window at the prompt's end), and the decode engine imports them. Returns the bytes
/// pushed, per layer, and the first token.
fn push(prefill: &mut Engine, decode: &mut Engine, req: Request) -> (Vec<usize>, TokenEvent) {
    let seq_id = req.seq_id;
    prefill.add_prefill_request(req).unwrap();
    let mut layers: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut first = None;
    while first.is_none() {
        let events = prefill
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                for index in 0..done.completing.len() {
                    let (_, ids) = done.pushed_blocks(index)?;
                    let mut buf = vec![0u8; done.cache.export_len(ids.len())];
                    done.cache.export_blocks(done.layer, ids, &mut buf)?;
                    layers.push((done.layer, buf));
                }
                Ok(())
            })
            .unwrap();
        first = events.into_iter().next();
    }
    let mut sizes = vec![0; decode.cache().num_layers()];
    for (layer, bytes) in &layers {
        decode.import_layer(seq_id, *layer, bytes).unwrap();
        sizes[*layer] += bytes.len();
    }
    (sizes, first.unwrap())
}

/// Decodes an activated sequence to its end; its ids after `first`.
fn decode_rest(decode: &mut Engine, first: TokenEvent) -> Vec<u32> {
    let mut ids = vec![first.token.token_id];
    assert!(decode
        .activate(first.seq_id, first.token)
        .unwrap()
        .is_none());
    while decode.has_work() {
        for ev in decode.step().unwrap() {
            ids.push(ev.token.token_id);
        }
    }
    ids
}

/// A prefill engine with sliding groups pushes, for each sliding layer, only the blocks of the
/// first decode query's window, which are the blocks a grouped decode engine reserves for it;
/// the ids are the colocated run's. A full-attention push of the same prompt is 1 / 0.271 times
/// as large. Both engines give back every block, a released reservation's included.
#[test]
fn a_prefill_engine_pushes_only_the_window_of_a_sliding_layer() {
    let (_dir, model) = gemma3_shaped();
    let tokens = prompt(model.config().vocab_size);
    let colocated = run(
        &mut Engine::new(model.clone(), config()).unwrap(),
        1,
        &tokens,
    );

    let mut prefill = Engine::new(model.clone(), config()).unwrap();
    let mut decode = Engine::new(model.clone(), config()).unwrap();
    // The nodes agree on the windows; an engine keeping every block does not.
    let full_kv = Engine::with_full_kv(model, config()).unwrap();
    assert_eq!(prefill.cache().layout(), decode.cache().layout());
    assert!(!prefill.cache().layout().windows.is_none());
    assert_ne!(full_kv.cache().layout(), decode.cache().layout());
    assert!(full_kv.cache().layout().windows.is_none());

    let req = greedy(1, tokens.clone(), NEW_TOKENS);
    let dest = decode.reserve(req.clone()).unwrap();
    let blocks = PROMPT / BS;
    let live = blocks - first_pushed_block(PROMPT, WINDOW, BS);
    let used =
        |e: &Engine| -> Vec<usize> { e.kv_usage().iter().map(|u| u.num_blocks_used).collect() };
    assert_eq!((dest.len(), used(&decode)), (blocks, vec![blocks, live]));
    let (sizes, first) = push(&mut prefill, &mut decode, req);
    let layer_block = 2 * decode.cache().layout().block_bytes() as usize;
    let groups = decode.cache().groups().clone();
    for (layer, &size) in sizes.iter().enumerate() {
        let expect = match groups.group_of(layer) {
            0 => blocks,
            _ => live,
        };
        assert_eq!(size, expect * layer_block, "layer {layer}");
    }
    let pushed: usize = sizes.iter().sum();
    let full = 6 * blocks * layer_block;
    assert_eq!(pushed, (blocks + 5 * live) * layer_block);
    let ids = decode_rest(&mut decode, first);
    assert_eq!(ids, colocated.ids, "the same ids as the colocated run");
    assert_eq!(used(&decode), vec![0, 0]);
    assert_eq!(used(&prefill), vec![0, 0], "the prompt's blocks are back");
    eprintln!(
        "pushed for a {PROMPT}-token prompt: windowed {pushed} B vs full attention {full} B: {:.3}",
        pushed as f64 / full as f64
    );
    assert!(pushed as f64 / full as f64 <= 0.40);

    // A reservation released before its KV arrives frees both groups' blocks.
    decode.reserve(greedy(2, tokens, NEW_TOKENS)).unwrap();
    assert_eq!(used(&decode), vec![blocks, live]);
    assert!(decode.release_reservation(SeqId(2)));
    assert_eq!(used(&decode), vec![0, 0]);
}

/// Prompts that end anywhere in a block, shorter and longer than the window, pushed windowed
/// and also whole (every block of every layer, which the decode engine cuts to the window),
/// decode the colocated ids; the prefix cache of both engines serves the second push.
#[test]
fn pushes_of_any_length_decode_the_colocated_ids() {
    let (_dir, model) = gemma3_shaped();
    let vocab = model.config().vocab_size;
    let mut colocated = Engine::new(model.clone(), config()).unwrap();
    let mut prefill = Engine::new(model.clone(), config()).unwrap();
    let mut whole = Engine::with_full_kv(model.clone(), config()).unwrap();
    let mut decode = Engine::new(model, config()).unwrap();
    let mut id = 10;
    for len in [1, 15, 16, 17, 300, 511, 512, 513, 530, 1000, 1031] {
        let tokens: Vec<u32> = prompt(vocab)[PROMPT - len..].to_vec();
        let expected = run(&mut colocated, id, &tokens).ids;
        for round in 0..2 {
            for from in [&mut prefill, &mut whole] {
                id += 1;
                let req = greedy(id, tokens.clone(), NEW_TOKENS);
                decode.reserve(req.clone()).unwrap();
                let (_, first) = push(from, &mut decode, req);
                let ids = decode_rest(&mut decode, first);
                assert_eq!(ids, expected, "{len} tokens, round {round}");
                assert!(decode.kv_usage().iter().all(|u| u.num_blocks_used == 0));
                assert!(from.kv_usage().iter().all(|u| u.num_blocks_used == 0));
            }
        }
    }
}
