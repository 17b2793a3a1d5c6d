//! Sliding-window KV memory (issue 32): on a Gemma-3-shaped model (five sliding layers of a
//! 512-token window to one global layer), a 4,096-token prompt holds a window of blocks in
//! each sliding layer instead of the whole prompt, generates the same ids as an engine that
//! keeps every block, reuses its prefix exactly, and gives every block back.
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
use engine::engine::{Engine, EngineConfig, LayerDone};
use engine::ids::SeqId;
use engine::kv::groups::{first_live_block, KvGroups};
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

/// A decode engine with sliding groups takes a prefill engine's push: each sliding layer keeps
/// only the first decode query's window of the pushed blocks, and the ids are the colocated
/// run's. A released reservation gives back every group's blocks.
#[test]
fn a_decode_engine_keeps_only_the_window_of_a_pushed_prompt() {
    let (_dir, model) = gemma3_shaped();
    let tokens = prompt(model.config().vocab_size);
    let colocated = run(
        &mut Engine::new(model.clone(), config()).unwrap(),
        1,
        &tokens,
    );

    let mut prefill = Engine::with_full_kv(model.clone(), config()).unwrap();
    let mut decode = Engine::new(model, config()).unwrap();
    let req = greedy(1, tokens.clone(), NEW_TOKENS);
    assert!(
        prefill.add_prefill_request(req.clone()).is_ok()
            && Engine::new(prefill.model().clone(), config())
                .unwrap()
                .add_prefill_request(req.clone())
                .is_err(),
        "only a one-group engine prefills for another node"
    );
    let dest = decode.reserve(req.clone()).unwrap();
    let blocks = PROMPT / BS;
    let live = blocks - first_live_block(PROMPT, WINDOW, BS);
    let used =
        |e: &Engine| -> Vec<usize> { e.kv_usage().iter().map(|u| u.num_blocks_used).collect() };
    assert_eq!((dest.len(), used(&decode)), (blocks, vec![blocks, live]));
    let mut layers: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut first = None;
    while first.is_none() {
        let events = prefill
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                for (_seq, ids) in done.completing {
                    let mut buf = vec![0u8; done.cache.export_len(ids.len())];
                    done.cache.export_blocks(done.layer, ids, &mut buf)?;
                    layers.push((done.layer, buf));
                }
                Ok(())
            })
            .unwrap();
        first = events.into_iter().next();
    }
    assert_eq!(layers.len(), 6);
    for (layer, bytes) in &layers {
        decode.import_layer(SeqId(1), *layer, bytes).unwrap();
    }
    let first = first.unwrap();
    let mut ids = vec![first.token.token_id];
    assert!(decode.activate(SeqId(1), first.token).unwrap().is_none());
    assert_eq!(used(&decode), vec![blocks, live]);
    while decode.has_work() {
        for ev in decode.step().unwrap() {
            ids.push(ev.token.token_id);
        }
    }
    assert_eq!(ids, colocated.ids, "the same ids as the colocated run");
    assert_eq!(used(&decode), vec![0, 0]);

    // A reservation released before its KV arrives frees both groups' blocks.
    decode.reserve(greedy(2, tokens, NEW_TOKENS)).unwrap();
    assert_eq!(used(&decode), vec![blocks, live]);
    assert!(decode.release_reservation(SeqId(2)));
    assert_eq!(used(&decode), vec![0, 0]);
}
