//! The KV cache on the model's device (issue 35), on the CPU: the tensor path with its cache
//! as device tensors, read and written through the device ops, against the same path over host
//! vectors (the route every push took before), bit for bit, in f32 and bf16:
//! - logits of a chunked prefill of two sequences over scattered blocks, then a decode step;
//! - every layer's export (gather to a staging tensor, copied to bytes) against the host
//!   cache's export, the bytes the push sends;
//! - those bytes imported into a fresh device cache under other block ids (scatter from
//!   staging) export again unchanged, and a decode step over them gives the same logits;
//! - a prefill engine and a decode engine both on the device cache, the KV pushed layer by
//!   layer as the nodes push it, generate stories260K's references.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use candle_core::{DType, Device};
use common::{engine, greedy, references, shared_model};
use engine::engine::{EngineConfig, LayerDone};
use engine::ids::BlockId;
use engine::kv::cache::KvCache;
use engine::kv::groups::KvGroups;
use engine::loader::ModelSource;
use engine::model::{ForwardBatch, LoadedModel};
use kv_types::{KvDtype, KvLayout};

const BLOCK: usize = 4;
const NUM_BLOCKS: usize = 32;

fn tensor_model(dtype: DType) -> LoadedModel {
    LoadedModel::load(
        &ModelSource::Local(shared_model("stories260K")),
        Some(dtype),
        &Device::Cpu,
    )
    .unwrap()
    .with_tensor_path()
}

fn layout(model: &LoadedModel, dtype: KvDtype) -> KvLayout {
    let c = model.config();
    KvLayout {
        dtype,
        num_layers: c.num_layers as u32,
        block_size: BLOCK as u32,
        num_kv_heads: c.num_kv_heads as u32,
        head_dim: c.head_dim as u32,
        windows: Default::default(),
    }
}

fn caches(model: &LoadedModel, dtype: KvDtype) -> (KvCache, KvCache) {
    let l = layout(model, dtype);
    let groups = || KvGroups::single(l.num_layers as usize);
    let host = KvCache::with_groups(l, groups(), &[NUM_BLOCKS]);
    let device = KvCache::with_groups_on(l, groups(), &[NUM_BLOCKS], &Device::Cpu).unwrap();
    assert!(!host.is_on_device() && device.is_on_device());
    (host, device)
}

fn logits(model: &LoadedModel, batch: &ForwardBatch, cache: &mut KvCache) -> Vec<u32> {
    let l = model.model.forward(batch, cache).unwrap();
    let v: Vec<f32> = l.flatten_all().unwrap().to_vec1().unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

fn export(cache: &mut KvCache, layer: usize, ids: &[BlockId]) -> Vec<u8> {
    let mut buf = vec![0u8; cache.export_len(ids.len())];
    cache.export_blocks(layer, ids, &mut buf).unwrap();
    buf
}

fn ids(raw: &[u32]) -> Vec<BlockId> {
    raw.iter().copied().map(BlockId).collect()
}

/// Two prompts (11 and 6 tokens) prefilled in chunks of at most 5 over scattered blocks, then
/// one decode step of both; the device cache's logits and exports equal the host cache's.
fn device_cache_is_the_host_cache(dtype: DType, kv: KvDtype) {
    let model = tensor_model(dtype);
    let (mut host, mut device) = caches(&model, kv);
    let refs = references();
    // Each reference's prompt and continuation, as token ids to run.
    let text = |i: usize| [refs[i].input_ids.clone(), refs[i].output_ids.clone()].concat();
    let (a, b) = (text(0), text(1));
    let (a, b) = (&a[..11], &b[..6]);
    let (ta, tb) = (vec![7u32, 2, 19, 5], vec![30u32, 11]);
    let step = |chunks: &[(&[u32], usize, &Vec<u32>)]| {
        let mut batch = ForwardBatch::default();
        for &(toks, start, table) in chunks {
            batch.push_seq(toks, start, table.clone(), BLOCK, true);
        }
        batch
    };
    let steps = [
        step(&[(&a[..5], 0, &ta), (&b[..3], 0, &tb)]),
        step(&[(&a[5..10], 5, &ta), (&b[3..], 3, &tb)]),
        step(&[(&a[10..], 10, &ta)]),
        // a decode row each
        step(&[(&[42], 11, &ta), (&[17], 6, &tb)]),
    ];
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(
            logits(&model, s, &mut host),
            logits(&model, s, &mut device),
            "{dtype:?} step {i}: logits differ"
        );
    }
    let blocks = ids(&ta[..3]);
    let mut fresh = caches(&model, kv).1;
    let to = ids(&[3, 9, 0]);
    for layer in 0..model.config().num_layers {
        let want = export(&mut host, layer, &blocks);
        assert!(want.iter().any(|&x| x != 0), "layer {layer} holds KV");
        assert_eq!(
            export(&mut device, layer, &blocks),
            want,
            "{dtype:?} layer {layer}: gather to staging is not the host export"
        );
        fresh.import_blocks(layer, &to, &want).unwrap();
        assert_eq!(
            export(&mut fresh, layer, &to),
            want,
            "{dtype:?} layer {layer}: scatter from staging then gather is not the bytes"
        );
    }
    // The next token of sequence a over the imported blocks, as over the source ones.
    let mut table = vec![3u32, 9, 0];
    table.push(22);
    let next = step(&[(&[42], 11, &ta)]);
    let next_fresh = step(&[(&[42], 11, &table)]);
    let mut again = caches(&model, kv).0;
    for s in &steps[..3] {
        logits(&model, s, &mut again);
    }
    assert_eq!(
        logits(&model, &next, &mut again),
        logits(&model, &next_fresh, &mut fresh),
        "{dtype:?}: a step over the imported device blocks differs"
    );
}

#[test]
fn the_device_cache_is_the_host_cache_bit_for_bit_f32() {
    device_cache_is_the_host_cache(DType::F32, KvDtype::F32);
}

#[test]
fn the_device_cache_is_the_host_cache_bit_for_bit_bf16() {
    device_cache_is_the_host_cache(DType::BF16, KvDtype::Bf16);
}

/// The tensor path's engines put their cache on the device; pushed layer by layer from a
/// prefill engine to a decode engine (export from one device cache, import into the other),
/// greedy ids are the references, and so are those of one engine batching every reference
/// in 16-token chunks.
#[test]
fn device_caches_push_and_generate_the_references() {
    let model = tensor_model(DType::F32);
    let cfg = || EngineConfig {
        num_kv_blocks: Some(128),
        block_size: BLOCK,
        max_prefill_chunk_tokens: 16,
        max_batch_prefill_tokens: 24,
        ..Default::default()
    };
    let mut prefill = engine(&model, cfg());
    assert!(prefill.cache().is_on_device());
    let refs = references();
    for (i, r) in refs.iter().enumerate() {
        let req = greedy(i as u64, r.input_ids.clone(), r.output_ids.len());
        let mut decode = engine(&model, cfg());
        assert!(decode.cache().is_on_device());
        let dest = decode.reserve(req.clone()).unwrap();
        prefill.add_prefill_request(req.clone()).unwrap();
        let mut layers = Vec::new();
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
                .unwrap();
            first = events.into_iter().next();
        }
        for (layer, bytes) in &layers {
            decode
                .cache_mut()
                .import_blocks(*layer, &dest, bytes)
                .unwrap();
        }
        let first = first.unwrap();
        let mut out = vec![first.token.token_id];
        if decode.activate(req.seq_id, first.token).unwrap().is_none() {
            while decode.has_work() {
                out.extend(decode.step().unwrap().into_iter().map(|e| e.token.token_id));
            }
        }
        assert_eq!(out, r.output_ids, "prompt {i} pushed between device caches");
    }
    let reqs = refs
        .iter()
        .enumerate()
        .map(|(i, r)| greedy(i as u64, r.input_ids.clone(), r.output_ids.len()))
        .collect();
    let out = engine(&model, cfg()).generate(reqs).unwrap();
    for (i, r) in refs.iter().enumerate() {
        assert_eq!(
            out[i].output_ids, r.output_ids,
            "prompt {i} batched, chunked"
        );
    }
}
