use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;
use crate::reference::paged_attention_reference;
use crate::simd::Isa;

/// A random int8 cache, its f32 dequantisation, queries and shuffled block tables.
struct Case {
    layout: CacheShape,
    num_heads: usize,
    k: (Vec<i8>, Vec<f32>),
    v: (Vec<i8>, Vec<f32>),
    q: Vec<f32>,
    seqs: Vec<(usize, usize, usize, Vec<u32>)>,
    scale: f32,
}

impl Case {
    fn new(
        seed: u64,
        num_kv_heads: usize,
        group: usize,
        head_dim: usize,
        block_size: usize,
        shapes: &[(usize, usize)],
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let needed: usize = shapes.iter().map(|s| s.1.div_ceil(block_size)).sum();
        let layout = CacheShape {
            num_blocks: needed + 2,
            block_size,
            num_kv_heads,
            head_dim,
        };
        let mut ids: Vec<u32> = (0..layout.num_blocks as u32).collect();
        ids.shuffle(&mut rng);
        let mut ids = ids.into_iter();
        let mut seqs = Vec::new();
        let mut q_start = 0;
        for &(q_len, context_len) in shapes {
            let table = ids
                .by_ref()
                .take(context_len.div_ceil(block_size))
                .collect();
            seqs.push((q_start, q_len, context_len, table));
            q_start += q_len;
        }
        let num_heads = group * num_kv_heads;
        let cache = |rng: &mut StdRng| {
            let data: Vec<i8> = (0..layout.layer_elems())
                .map(|_| rng.random_range(-127..=127))
                .collect();
            let scales: Vec<f32> = (0..layout.num_slots() * num_kv_heads)
                .map(|_| rng.random_range(0.001f32..0.02))
                .collect();
            (data, scales)
        };
        let k = cache(&mut rng);
        let v = cache(&mut rng);
        let q = (0..q_start * num_heads * head_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        Case {
            layout,
            num_heads,
            k,
            v,
            q,
            seqs,
            scale: if seed.is_multiple_of(2) { 1.5 } else { 0.125 },
        }
    }

    fn seq_attn(&self) -> Vec<SeqAttn<'_>> {
        self.seqs
            .iter()
            .map(|(q_start, q_len, context_len, t)| SeqAttn {
                q_start: *q_start,
                q_len: *q_len,
                context_len: *context_len,
                block_table: t,
            })
            .collect()
    }

    fn dequant(&self, (data, scales): &(Vec<i8>, Vec<f32>)) -> Vec<f32> {
        let d = self.layout.head_dim;
        data.iter()
            .enumerate()
            .map(|(i, &x)| f32::from(x) * scales[i / d])
            .collect()
    }

    fn kv(&self) -> (Int8Kv<'_>, Int8Kv<'_>) {
        (view(&self.k), view(&self.v))
    }

    /// The scalar reference on the dequantised cache.
    fn reference(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.q.len()];
        paged_attention_reference(
            &self.layout,
            &self.dequant(&self.k),
            &self.dequant(&self.v),
            &self.q,
            &mut out,
            self.num_heads,
            &self.seq_attn(),
            self.scale,
        )
        .expect("valid");
        out
    }

    /// The tiled kernel on `isa` reading the int8 cache, planned for four cores so that every
    /// machine runs the same work items (split-K included).
    fn tiled(&self, isa: Isa) -> Vec<f32> {
        let seqs = self.seq_attn();
        let (k, v) = self.kv();
        let args = AttentionArgs {
            layout: &self.layout,
            k_cache: k.rows(self.layout.head_dim),
            v_cache: v.rows(self.layout.head_dim),
            q: &self.q,
            num_heads: self.num_heads,
            seqs: &seqs,
            scale: self.scale,
        };
        let mut out = vec![0f32; self.q.len()];
        args.validate(out.len()).expect("valid");
        args.run_tiles(isa, 4, None, &mut out);
        out
    }

    fn check(&self) {
        let want = self.reference();
        for isa in Isa::available() {
            assert_close(&self.tiled(isa), &want, &format!("{isa:?}"));
        }
    }
}

fn view(c: &(Vec<i8>, Vec<f32>)) -> Int8Kv<'_> {
    Int8Kv {
        data: &c.0,
        scales: &c.1,
    }
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what} element {i}: got {g}, want {w}"
        );
    }
}

#[test]
fn quantized_rows_are_within_half_a_step() {
    let mut rng = StdRng::seed_from_u64(1);
    for d in [1, 8, 64, 72] {
        let src: Vec<f32> = (0..d).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let mut q = vec![0i8; d];
        let s = quantize_row_int8(&src, &mut q);
        let amax = src.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert_eq!(s, amax / 127.0);
        assert!(q.iter().any(|x| x.unsigned_abs() == 127), "{q:?}");
        for (x, y) in src.iter().zip(&q) {
            assert!(
                (x - f32::from(*y) * s).abs() <= s * 0.5 + 1e-6,
                "{x} vs {y}*{s}"
            );
        }
    }
    let mut q = vec![5i8; 4];
    assert_eq!(quantize_row_int8(&[0.0; 4], &mut q), 0.0);
    assert_eq!(q, [0; 4]);
}

#[test]
fn decode_batches_match_reference_on_every_isa() {
    let shapes: Vec<(usize, usize)> = (0..9).map(|i| (1, 1 + i * 23)).collect();
    for group in 1..=4 {
        Case::new(group as u64, 2, group, 64, 16, &shapes).check();
    }
    // More than four sequences per planned core: narrow tiles over every kv head, odd head
    // dims, and a long context cut by split-K.
    let mut shapes: Vec<(usize, usize)> = (0..18).map(|i| (1 + i % 3, 3 + i * 17)).collect();
    shapes.push((1, 3000));
    for (group, head_dim) in [(1, 64), (3, 40), (4, 72)] {
        Case::new(group as u64 + 10, 3, group, head_dim, 16, &shapes).check();
    }
    Case::new(20, 1, 3, 64, 16, &[(1, 2500)]).check();
}

#[test]
fn prefill_matches_reference_on_every_isa() {
    for group in [1, 3] {
        Case::new(30 + group as u64, 2, group, 64, 16, &[(300, 300)]).check();
    }
    Case::new(40, 2, 2, 64, 16, &[(70, 200), (5, 40), (33, 33)]).check();
    Case::new(41, 3, 3, 8, 4, &[(40, 41), (1, 90), (17, 64)]).check();
}

#[test]
fn windows_and_softcap_match_the_float_entry_point() {
    let case = Case::new(50, 2, 2, 32, 8, &[(40, 100), (1, 77), (3, 3)]);
    let (k, v) = case.kv();
    let (kf, vf) = (case.dequant(&case.k), case.dequant(&case.v));
    let seqs = case.seq_attn();
    for (window, softcap) in [
        (None, None),
        (Some(16), None),
        (None, Some(5.0)),
        (Some(9), Some(2.0)),
    ] {
        let opts = AttnOptions {
            scale: case.scale,
            window,
            softcap,
        };
        let mut got = vec![0f32; case.q.len()];
        paged_attention_int8(
            &case.layout,
            k,
            v,
            &case.q,
            &mut got,
            case.num_heads,
            &seqs,
            opts,
        )
        .expect("int8");
        let mut want = vec![0f32; case.q.len()];
        crate::paged_attention_with(
            &case.layout,
            &kf,
            &vf,
            &case.q,
            &mut want,
            case.num_heads,
            &seqs,
            opts,
        )
        .expect("f32");
        assert_close(&got, &want, &format!("{window:?} {softcap:?}"));
    }
    // Scales of the wrong length are refused before anything is read.
    let short = Int8Kv {
        data: k.data,
        scales: &k.scales[1..],
    };
    let mut out = vec![0f32; case.q.len()];
    let opts = AttnOptions {
        scale: 1.0,
        window: None,
        softcap: None,
    };
    let err = paged_attention_int8(
        &case.layout,
        short,
        v,
        &case.q,
        &mut out,
        case.num_heads,
        &seqs,
        opts,
    );
    assert!(matches!(err, Err(KernelError::BadLength { .. })), "{err:?}");
}

#[test]
fn rows_quantise_alike_however_the_block_is_filled() {
    let layout = CacheShape {
        num_blocks: 6,
        block_size: 8,
        num_kv_heads: 2,
        head_dim: 16,
    };
    let row = layout.row_elems();
    let mut rng = StdRng::seed_from_u64(7);
    let tokens = 40;
    let k: Vec<f32> = (0..tokens * row)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let v: Vec<f32> = (0..tokens * row)
        .map(|_| rng.random_range(-2.0f32..2.0))
        .collect();
    let slots: Vec<u32> = (0..tokens as u32).map(|t| (t + 5) % 48).collect();
    let new = || {
        (
            vec![0i8; layout.layer_elems()],
            vec![0f32; scale_len(&layout)],
            vec![0i8; layout.layer_elems()],
            vec![0f32; scale_len(&layout)],
        )
    };
    let write = |c: &mut (Vec<i8>, Vec<f32>, Vec<i8>, Vec<f32>), range: std::ops::Range<usize>| {
        let kc = Int8KvMut {
            data: &mut c.0,
            scales: &mut c.1,
        };
        let vc = Int8KvMut {
            data: &mut c.2,
            scales: &mut c.3,
        };
        reshape_and_cache_int8(
            &layout,
            kc,
            vc,
            &k[range.start * row..range.end * row],
            &v[range.start * row..range.end * row],
            &slots[range],
        )
        .expect("write");
    };
    // All at once (the parallel path), against one token per step (a decode filling blocks).
    let (mut all, mut steps) = (new(), new());
    write(&mut all, 0..tokens);
    for t in 0..tokens {
        write(&mut steps, t..t + 1);
    }
    assert_eq!(all, steps);
    // Every element reads back within half a step of its row's scale.
    for (t, &slot) in slots.iter().enumerate() {
        for h in 0..2 {
            let s = all.1[slot as usize * 2 + h];
            for j in 0..16 {
                let at = slot as usize * row + h * 16 + j;
                let x = k[t * row + h * 16 + j];
                assert!((f32::from(all.0[at]) * s - x).abs() <= s * 0.5 + 1e-6);
            }
        }
    }
}

#[test]
fn gather_scatter_round_trip_is_bit_exact() {
    let case = Case::new(60, 2, 1, 8, 4, &[(1, 20)]);
    let (k, v) = case.kv();
    let ids = [3u32, 0, 5];
    let mut bytes = vec![0u8; int8_payload_bytes(&case.layout, ids.len())];
    gather_blocks_int8(&case.layout, k, v, &ids, &mut bytes).expect("gather");
    let (mut k2, mut v2) = (
        (vec![0i8; k.data.len()], vec![0f32; k.scales.len()]),
        (vec![0i8; v.data.len()], vec![0f32; v.scales.len()]),
    );
    let dst = [1u32, 2, 4];
    let scatter = |k2: &mut (Vec<i8>, Vec<f32>), v2: &mut (Vec<i8>, Vec<f32>), src: &[u8]| {
        scatter_blocks_int8(
            &case.layout,
            Int8KvMut {
                data: &mut k2.0,
                scales: &mut k2.1,
            },
            Int8KvMut {
                data: &mut v2.0,
                scales: &mut v2.1,
            },
            &dst,
            src,
        )
    };
    scatter(&mut k2, &mut v2, &bytes).expect("scatter");
    let mut again = vec![0u8; bytes.len()];
    gather_blocks_int8(&case.layout, view(&k2), view(&v2), &dst, &mut again).expect("gather");
    assert_eq!(bytes, again);
    // 3 blocks of 4 rows of 2 heads of 8, plus a 4-byte scale per row and head, K and V.
    assert_eq!(bytes.len(), 2 * 3 * (4 * 2 * 8 + 4 * 4 * 2));
    assert!(scatter(&mut k2, &mut v2, &bytes[1..]).is_err());
}
