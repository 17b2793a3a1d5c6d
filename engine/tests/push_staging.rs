//! The push's staging on a device cache (issue 35), on the CPU: the same control flow a GPU
//! runs, where staging is a gather into pinned memory on a copy stream.
//! - a finished layer is handed to the push only once the next layer is computed and staged
//!   (the GPU copies layer N while it computes N + 1), in layer order, once each;
//! - every export of the push (all of a prompt's blocks, or a reordered subset, as a decode
//!   node holding a prefix asks) is served from the staging, and its bytes are the direct
//!   gather's after the step: the two buffers never hand over a layer the next one overwrote;
//! - a sliding-window model stages each layer's window, and its push generates the references
//!   of the colocated run;
//! - a host cache hands layers over at once and stages nothing; a plain step stages nothing.
//!
//! `FISSION_TEST_DEVICE=cuda` (a `--features cuda` build on a GPU: `deploy/gpu-check.sh`) runs
//! the device-cache tests on the GPU, through the copy stream, the pinned buffers and the
//! pinned upload; the host-cache test stays on the CPU.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::{DType, Device};
use common::arch_refs::{stories_tokenizer, variant};
use common::{engine, greedy, references, shared_model};
use engine::engine::{Engine, EngineConfig, LayerDone};
use engine::ids::BlockId;
use engine::kv::staging::StagingStats;
use engine::loader::ModelSource;
use engine::model::LoadedModel;

/// The device the device-cache tests run on: the CPU, or the GPU when asked.
fn device() -> Device {
    match std::env::var("FISSION_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            Device::new_cuda(0).expect("FISSION_TEST_DEVICE=cuda: a GPU and --features cuda")
        }
        _ => Device::Cpu,
    }
}

fn stories(tensor: bool) -> LoadedModel {
    let m = LoadedModel::load(
        &ModelSource::Local(shared_model("stories260K")),
        Some(DType::F32),
        &match tensor {
            true => device(),
            false => Device::Cpu,
        },
    )
    .unwrap();
    match tensor {
        true => m.with_tensor_path(),
        false => m,
    }
}

fn config() -> EngineConfig {
    EngineConfig {
        num_kv_blocks: Some(128),
        block_size: 4,
        max_prefill_chunk_tokens: 16,
        max_batch_prefill_tokens: 64,
        ..Default::default()
    }
}

/// One export the hook made: the layer, the blocks, the bytes.
type Export = (usize, Vec<BlockId>, Vec<u8>);

/// Prefills `prompts` on `e` (one batch), exporting in each handed-over layer every pushed
/// block and, for prompts of more than one block, the blocks after the first in reverse
/// order. Returns the exports and the order the layers came in, per step.
fn prefill_and_export(e: &mut Engine, prompts: &[Vec<u32>]) -> (Vec<Export>, Vec<Vec<usize>>) {
    for (i, p) in prompts.iter().enumerate() {
        e.add_prefill_request(greedy(i as u64, p.clone(), 1))
            .unwrap();
    }
    let num_layers = e.cache().num_layers();
    let on_device = e.cache().is_on_device();
    let (mut exports, mut orders) = (Vec::new(), Vec::new());
    let mut done_prompts = 0;
    while done_prompts < prompts.len() {
        let mut order = Vec::new();
        let events = e
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                order.push(done.layer);
                let staged = done.cache.staged_layers();
                match on_device {
                    // This layer and the next are staged: the next one is computed already.
                    true => {
                        assert!(staged.contains(&done.layer), "{staged:?}");
                        if done.layer + 1 < num_layers {
                            assert!(staged.contains(&(done.layer + 1)), "{staged:?}");
                        }
                    }
                    false => assert!(staged.is_empty()),
                }
                for index in 0..done.completing.len() {
                    let (_, ids) = done.pushed_blocks(index)?;
                    let mut sets = vec![ids.to_vec()];
                    if ids.len() > 1 {
                        sets.push(ids[1..].iter().rev().copied().collect());
                    }
                    for ids in sets {
                        let mut buf = vec![0u8; done.cache.export_len(ids.len())];
                        done.cache.export_blocks(done.layer, &ids, &mut buf)?;
                        exports.push((done.layer, ids, buf));
                    }
                }
                Ok(())
            })
            .unwrap();
        done_prompts += events.len();
        if !order.is_empty() {
            orders.push(order);
        }
    }
    (exports, orders)
}

/// After the step: each export again, gathered directly (nothing is staged any more).
fn assert_exports_are_the_cache(e: &mut Engine, exports: &[Export]) {
    assert!(
        e.cache().staged_layers().is_empty(),
        "staging outlived its step"
    );
    for (layer, ids, bytes) in exports {
        let mut again = vec![0u8; bytes.len()];
        e.cache_mut()
            .export_blocks(*layer, ids, &mut again)
            .unwrap();
        assert!(
            &again == bytes,
            "layer {layer} {ids:?}: staged bytes differ"
        );
        assert!(bytes.iter().any(|&b| b != 0));
    }
}

#[test]
fn a_device_cache_hands_over_each_layer_staged_one_layer_late() {
    let model = stories(true);
    let mut e = engine(&model, config());
    assert!(e.cache().is_on_device());
    let num_layers = e.cache().num_layers();
    let refs = references();
    let prompts: Vec<Vec<u32>> = refs.iter().take(3).map(|r| r.input_ids.clone()).collect();
    let (exports, orders) = prefill_and_export(&mut e, &prompts);
    for order in &orders {
        assert_eq!(*order, (0..num_layers).collect::<Vec<_>>());
    }
    let stats = e.cache().staging_stats();
    assert_eq!(
        stats,
        StagingStats {
            staged: (orders.len() * num_layers) as u64,
            served: exports.len() as u64,
            direct: 0,
        }
    );
    assert!(exports.iter().any(|(_, ids, _)| ids.len() > 1));
    assert_exports_are_the_cache(&mut e, &exports);
    assert_eq!(e.cache().staging_stats().direct, exports.len() as u64);
    // A plain step stages nothing, whether or not a prompt completes in it.
    let before = e.cache().staging_stats();
    let out = e.generate(vec![greedy(9, prompts[0].clone(), 3)]).unwrap();
    assert_eq!(out[0].output_ids, refs[0].output_ids[..3]);
    assert_eq!(e.cache().staging_stats(), before);
    println!(
        "push staging on {:?}: {} layers staged, {} exports served from the staging",
        device(),
        stats.staged,
        stats.served
    );
}

/// A push that fails mid-step leaves layers staged; the next step, whatever it computes,
/// drops them before it writes the cache, so no later export can read stale bytes.
#[test]
fn a_failed_push_leaves_no_staging_past_the_next_step() {
    let model = stories(true);
    let mut e = engine(&model, config());
    let prompt = references()[0].input_ids.clone();
    e.add_prefill_request(greedy(0, prompt.clone(), 1)).unwrap();
    let failed = e.step_with_layer_hook(&mut |done: LayerDone<'_>| match done.layer {
        0 => Ok(()),
        _ => Err(engine::error::EngineError::InvalidConfig {
            reason: "the push failed".into(),
        }),
    });
    assert!(failed.is_err());
    assert_eq!(e.cache().staged_layers().len(), 2);
    e.add_prefill_request(greedy(1, prompt, 1)).unwrap();
    let _ = e.step();
    assert!(e.cache().staged_layers().is_empty());
}

#[test]
fn a_host_cache_hands_over_each_layer_at_once_and_stages_nothing() {
    let model = stories(false);
    let mut e = engine(&model, config());
    assert!(!e.cache().is_on_device());
    let prompts: Vec<Vec<u32>> = references()
        .iter()
        .take(2)
        .map(|r| r.input_ids.clone())
        .collect();
    let (exports, orders) = prefill_and_export(&mut e, &prompts);
    let n = e.cache().num_layers();
    assert!(orders.iter().all(|o| *o == (0..n).collect::<Vec<_>>()));
    assert_eq!(e.cache().staging_stats(), StagingStats::default());
    assert_exports_are_the_cache(&mut e, &exports);
}

/// Gemma 3's shape with a 16-token window (every third layer global), on the tensor path: the
/// sliding layers stage and push their window only, and a decode engine fed the push
/// generates what one engine does.
#[test]
fn a_sliding_window_push_is_staged_and_generates_the_colocated_ids() {
    let mut spec = variant("gemma3").spec;
    spec.layers = 3;
    spec.sliding_window = Some(16);
    spec.sliding_window_pattern = Some(3);
    let dir = tempfile::tempdir().unwrap();
    random_model::write_model(dir.path(), &spec, &stories_tokenizer()).unwrap();
    let model = LoadedModel::load(
        &ModelSource::Local(dir.path().to_path_buf()),
        Some(DType::F32),
        &device(),
    )
    .unwrap()
    .with_tensor_path();
    let vocab = model.config().vocab_size;
    let prompt: Vec<u32> = (0..61)
        .map(|i| ((i * 7919 + 13) % (vocab - 3) + 3) as u32)
        .collect();
    let new_tokens = 6;
    let colocated = engine(&model, config())
        .generate(vec![greedy(0, prompt.clone(), new_tokens)])
        .unwrap()
        .remove(0)
        .output_ids;

    let mut prefill = engine(&model, config());
    let mut decode = engine(&model, config());
    let req = greedy(0, prompt.clone(), new_tokens);
    decode.reserve(req.clone()).unwrap();
    prefill.add_prefill_request(req.clone()).unwrap();
    let mut first = None;
    let mut pushed = Vec::new();
    while first.is_none() {
        let events = prefill
            .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                let (_, ids) = done.pushed_blocks(0)?;
                let mut buf = vec![0u8; done.cache.export_len(ids.len())];
                done.cache.export_blocks(done.layer, ids, &mut buf)?;
                pushed.push((done.layer, ids.len(), buf));
                Ok(())
            })
            .unwrap();
        first = events.into_iter().next();
    }
    let stats = prefill.cache().staging_stats();
    assert_eq!((stats.served, stats.direct), (pushed.len() as u64, 0));
    // The sliding layers push fewer blocks than the global one.
    let blocks: Vec<usize> = pushed.iter().map(|p| p.1).collect();
    assert_eq!(blocks.len(), 3);
    assert!(blocks[0] < blocks[2] && blocks[1] < blocks[2], "{blocks:?}");
    for (layer, _, bytes) in &pushed {
        decode.import_layer(req.seq_id, *layer, bytes).unwrap();
    }
    let first = first.unwrap();
    let mut ids = vec![first.token.token_id];
    assert!(decode
        .activate(first.seq_id, first.token)
        .unwrap()
        .is_none());
    while decode.has_work() {
        ids.extend(decode.step().unwrap().into_iter().map(|e| e.token.token_id));
    }
    assert_eq!(ids, colocated);
}

/// What the staging costs a prefill step: the step that completes a prompt, with every layer
/// exported as the push does (A), against the plain step (B), alternated, medians printed.
/// With the copy overlapped, A exceeds B by about one layer's copy plus the host copies.
/// A measurement, not a check: `deploy/gpu-check.sh` runs it (`--ignored`) on the GPU, with
/// a SmolLM2-135M-shaped model in bf16 and a 2048-token prompt (a tiny model on the CPU).
#[test]
#[ignore = "a measurement: deploy/gpu-check.sh runs it"]
fn push_overlap_timing() {
    let dev = device();
    let (spec, dtype, prompt_len) = match dev.is_cuda() {
        true => (random_model::ModelSpec::smollm2_135m(), DType::BF16, 2048),
        false => (random_model::ModelSpec::tiny(), DType::F32, 512),
    };
    let dir = tempfile::tempdir().unwrap();
    random_model::write_model(dir.path(), &spec, &stories_tokenizer()).unwrap();
    let model = LoadedModel::load(
        &ModelSource::Local(dir.path().to_path_buf()),
        Some(dtype),
        &dev,
    )
    .unwrap()
    .with_tensor_path();
    let cfg = EngineConfig {
        num_kv_blocks: Some(4 * prompt_len / 16 + 8),
        block_size: 16,
        max_prefill_chunk_tokens: prompt_len,
        max_batch_prefill_tokens: prompt_len,
        enable_prefix_caching: false,
        ..Default::default()
    };
    let mut e = engine(&model, cfg);
    let vocab = spec.vocab;
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let mut pushed_bytes = 0;
    for round in 0..12 {
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|i| ((i * 7919 + round * 104_729 + 13) % (vocab - 3) + 3) as u32)
            .collect();
        e.add_prefill_request(greedy(round as u64, prompt, 1))
            .unwrap();
        let push = round % 2 == 0;
        let started = std::time::Instant::now();
        let mut bytes = 0;
        let events = match push {
            true => e
                .step_with_layer_hook(&mut |done: LayerDone<'_>| {
                    let (_, ids) = done.pushed_blocks(0)?;
                    let mut buf = vec![0u8; done.cache.export_len(ids.len())];
                    done.cache.export_blocks(done.layer, ids, &mut buf)?;
                    bytes += buf.len();
                    Ok(())
                })
                .unwrap(),
            false => e.step().unwrap(),
        };
        let elapsed = started.elapsed().as_secs_f64();
        assert_eq!(events.len(), 1, "one step prefills the prompt");
        // The first round of each kind warms up (kernel loads, the pinned buffers).
        if round >= 2 {
            times[usize::from(!push)].push(elapsed);
        }
        pushed_bytes = pushed_bytes.max(bytes);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let spread = |v: &Vec<f64>| v[v.len() - 1] - v[0];
    let (a, b) = (median(&mut times[0]), median(&mut times[1]));
    println!(
        "push overlap on {dev:?}: {prompt_len}-token prefill, {} layers, {:.1} MB pushed: \
         with push {:.2} ms (spread {:.2}), plain {:.2} ms (spread {:.2}), ratio {:.3}; \
         the push adds {:.2} ms, {:.2} GB/s of pushed bytes over the whole step",
        spec.layers,
        pushed_bytes as f64 / 1e6,
        a * 1e3,
        spread(&times[0]) * 1e3,
        b * 1e3,
        spread(&times[1]) * 1e3,
        a / b,
        (a - b) * 1e3,
        pushed_bytes as f64 / a / 1e9,
    );
    assert!(pushed_bytes > 0);
}
