//! The device ops on CPU tensors against the kernels they wrap, called on plain slices:
//! bit-exact, in f32 and bf16, with a window and a soft-cap, over a batch of a prefill chunk
//! that reads earlier blocks and a decode row.

use candle_core::{DType, Device, Tensor};
use kernels::{AttnOptions, CacheShape, KvElem, SeqAttn};

use super::*;

const LAYOUT: CacheShape = CacheShape {
    num_blocks: 6,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
};
const HEADS: usize = 4;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn seqs() -> Vec<SeqRows> {
    vec![
        // A chunk of 5 rows after 6 cached tokens, over blocks 4, 1 and 3.
        SeqRows {
            q_start: 0,
            q_len: 5,
            context_len: 11,
            block_table: vec![4, 1, 3],
        },
        // One decode row at position 2 of block 0.
        SeqRows {
            q_start: 5,
            q_len: 1,
            context_len: 3,
            block_table: vec![0],
        },
    ]
}

fn slots(seqs: &[SeqRows]) -> Vec<u32> {
    let mut out = Vec::new();
    for s in seqs {
        for p in s.context_len - s.q_len..s.context_len {
            let block = s.block_table[p / LAYOUT.block_size];
            out.push(block * LAYOUT.block_size as u32 + (p % LAYOUT.block_size) as u32);
        }
    }
    out
}

fn check<T: KvElem + candle_core::WithDType>(dtype: DType) {
    let dev = Device::Cpu;
    let row = LAYOUT.row_elems();
    let seqs = seqs();
    let slots = slots(&seqs);
    let t = slots.len();
    let conv = |v: Vec<f32>| v.into_iter().map(T::from_f32).collect::<Vec<T>>();
    // A cache already holding earlier tokens, then this step's rows.
    let (mut k_ref, mut v_ref) = (
        conv(values(LAYOUT.layer_elems(), 1)),
        conv(values(LAYOUT.layer_elems(), 2)),
    );
    let (k_new, v_new, q) = (
        conv(values(t * row, 3)),
        conv(values(t * row, 4)),
        conv(values(t * HEADS * LAYOUT.head_dim, 5)),
    );
    let kv = Tensor::from_vec(
        [k_ref.clone(), v_ref.clone()].concat(),
        (2, LAYOUT.layer_elems()),
        &dev,
    )
    .unwrap();
    assert_eq!(kv.dtype(), dtype);
    let tensor = |v: &[T], w: usize| Tensor::from_vec(v.to_vec(), (t, w), &dev).unwrap();

    reshape_and_cache(
        &kv,
        &tensor(&k_new, row),
        &tensor(&v_new, row),
        &LAYOUT,
        &slots,
    )
    .unwrap();
    kernels::reshape_and_cache(&LAYOUT, &mut k_ref, &mut v_ref, &k_new, &v_new, &slots).unwrap();
    let got: Vec<T> = kv.flatten_all().unwrap().to_vec1().unwrap();
    assert!(
        got == [k_ref.clone(), v_ref.clone()].concat(),
        "reshape-and-cache differs"
    );

    let attn: Vec<SeqAttn<'_>> = seqs.iter().map(SeqRows::attn).collect();
    for opts in [
        AttnOptions {
            scale: 0.35,
            window: None,
            softcap: None,
        },
        AttnOptions {
            scale: 0.35,
            window: Some(3),
            softcap: Some(5.0),
        },
    ] {
        let out = paged_attention(
            &tensor(&q, HEADS * LAYOUT.head_dim),
            &kv,
            &LAYOUT,
            HEADS,
            &seqs,
            opts,
        )
        .unwrap();
        let mut want = vec![T::default(); q.len()];
        kernels::paged_attention_with(&LAYOUT, &k_ref, &v_ref, &q, &mut want, HEADS, &attn, opts)
            .unwrap();
        let got: Vec<T> = out.flatten_all().unwrap().to_vec1().unwrap();
        assert!(got == want, "paged attention differs ({opts:?})");
        // and it is attention, not zeros
        assert!(got.iter().any(|x| x.to_f32() != 0.0));
    }

    let ids = [3u32, 0, 4];
    let staging = gather_blocks(&kv, &LAYOUT, &ids).unwrap();
    let mut want = vec![T::default(); 2 * ids.len() * LAYOUT.block_elems()];
    kernels::gather_blocks(&LAYOUT, &k_ref, &v_ref, &ids, &mut want).unwrap();
    let staged: Vec<T> = staging.to_vec1().unwrap();
    assert!(staged == want, "gather differs");

    // Scattered into an empty cache, under other ids: those blocks equal the source blocks.
    let other = layer_cache(&LAYOUT, dtype, &dev).unwrap();
    let to = [5u32, 1, 2];
    scatter_blocks(&other, &staging, &LAYOUT, &to).unwrap();
    let (mut k2, mut v2) = (
        vec![T::default(); LAYOUT.layer_elems()],
        vec![T::default(); LAYOUT.layer_elems()],
    );
    kernels::scatter_blocks(&LAYOUT, &mut k2, &mut v2, &to, &want).unwrap();
    let got: Vec<T> = other.flatten_all().unwrap().to_vec1().unwrap();
    assert!(got == [k2, v2].concat(), "scatter differs");
    let back: Vec<T> = gather_blocks(&other, &LAYOUT, &to)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(back == staged, "gather after scatter is not the staging");
}

#[test]
fn the_cpu_device_ops_are_the_kernels_bit_for_bit_f32() {
    check::<f32>(DType::F32);
}

#[test]
fn the_cpu_device_ops_are_the_kernels_bit_for_bit_bf16() {
    check::<half::bf16>(DType::BF16);
}

#[test]
fn a_cache_of_the_wrong_shape_is_refused() {
    let kv = Tensor::zeros((LAYOUT.layer_elems(),), DType::F32, &Device::Cpu).unwrap();
    assert!(gather_blocks(&kv, &LAYOUT, &[0]).is_err());
    let kv = layer_cache(&LAYOUT, DType::F32, &Device::Cpu).unwrap();
    assert!(gather_blocks(&kv, &LAYOUT, &[LAYOUT.num_blocks as u32]).is_err());
}
