//! Logit processing: the repetition penalty, one-pass statistics (max, argmax, log-sum-exp and the
//! top alternatives) and the fixed-point weights the draw is made with.
//!
//! Everything here runs once per generated token over the whole vocabulary (128K entries for
//! Llama 3), so the loops work in blocks of [`BLOCK`] values with [`LANES`] independent
//! accumulators, which lets the compiler vectorise them without reordering any floating-point sum:
//! the results are the same on every machine. `exp` is our own ([`exp_f32`]) for the same reason:
//! libm implementations differ in the last bit between platforms, and it vectorises where libm's
//! does not.

use std::borrow::Cow;
use std::cmp::Ordering;

/// Values per block of the one-pass loops: small enough to stay in L1, large enough to amortise
/// the per-block bookkeeping (the horizontal max and sum, and the f64 update that waits on
/// them): 256 ran the pass over 64 rows of SmolLM2's 49,152 logits 1.27x faster than 64 under
/// AVX2 (2.05-2.08 against 2.62-2.63 ms on one thread), and 128 and 512 were no faster.
const BLOCK: usize = 256;
/// Independent accumulators per reduction.
const LANES: usize = 8;

/// Scale of the fixed-point weights: the most likely token weighs `2^52`. Weights are summed as
/// integers, so the total is exact and independent of summation order, and a running sum in any
/// order ends exactly at the total.
const WEIGHT_ONE: f64 = (1u64 << 52) as f64;

/// Applies the HF/CTRL repetition penalty to every distinct id of `context_ids`: a positive logit
/// is divided by `penalty`, a negative one multiplied. Ids outside the vocabulary are ignored.
///
/// Borrows `logits` untouched when the penalty is off. Penalised values are computed from the
/// original logits, so an id that occurs many times is penalised exactly once.
pub(crate) fn apply_repetition_penalty<'a>(
    logits: &'a [f32],
    context_ids: &[u32],
    penalty: f32,
) -> Cow<'a, [f32]> {
    if penalty == 1.0 || context_ids.is_empty() {
        return Cow::Borrowed(logits);
    }
    let mut penalized = logits.to_vec();
    for &id in context_ids {
        let id = id as usize;
        if let Some(&logit) = logits.get(id) {
            penalized[id] = if logit > 0.0 {
                logit / penalty
            } else {
                logit * penalty
            };
        }
    }
    Cow::Owned(penalized)
}

/// A logit scaled by `1 / temperature`, with NaN mapped to `-inf` (never chosen), `+inf` to
/// `f32::MAX` (so softmax stays finite) and `-0.0` to `+0.0` (so equal values compare equal under
/// [`canonical`]).
#[inline(always)]
pub(crate) fn process(logit: f32, inv_temperature: f32) -> f32 {
    let x = logit * inv_temperature;
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX) + 0.0
    }
}

/// The canonical candidate order: higher value first, then lower id. A total order on processed
/// values (no NaN), so selection and sorting give one result on every platform.
#[inline]
pub(crate) fn canonical(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// `e^x` for `x <= 0` (and up to about 88), with a relative error under 2e-7, and exactly 0 below
/// -87 (where `f32` would go subnormal). The Cephes `expf` polynomial, branch-free so it
/// vectorises, and written with plain IEEE operations so it gives the same bits everywhere.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer, in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    // NaN cannot occur for cleaned inputs; map it to 0 all the same.
    let underflow = x.is_nan() || x < -87.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let n_bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let scale = f32::from_bits((n_bits.wrapping_add(127) as u32) << 23);
    if underflow {
        0.0
    } else {
        e_r * scale
    }
}

/// The fixed-point weight of a processed value `x` in a distribution whose maximum is `max`:
/// `e^(x - max) * 2^52`, rounded. Probabilities below `2^-53` of the top token's become 0.
#[inline(always)]
pub(crate) fn weight(x: f32, max: f32) -> u64 {
    fixed_point(exp_f32(x - max))
}

/// `e * 2^52` rounded to the nearest integer, for `e` in `[0, 1]`: adding `2^52` to a double in
/// `[0, 2^52]` leaves that integer in the low mantissa bits. Plain IEEE arithmetic, the same
/// everywhere, and unlike a float-to-integer cast it vectorises.
#[inline(always)]
fn fixed_point(e: f32) -> u64 {
    (f64::from(e) * WEIGHT_ONE + WEIGHT_ONE).to_bits() - WEIGHT_ONE.to_bits()
}

/// Processes one block of logits into `out`, padding a short block with `-inf`, and returns its
/// maximum. Working on whole fixed-size blocks lets every loop over them vectorise.
#[inline(always)]
fn process_block(block: &[f32], inv_temperature: f32, out: &mut [f32; BLOCK]) -> f32 {
    for (x, &logit) in out.iter_mut().zip(block) {
        *x = process(logit, inv_temperature);
    }
    out[block.len()..].fill(f32::NEG_INFINITY);
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in out.chunks_exact(LANES) {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = lane.max(x);
        }
    }
    lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `e^(x - max)` for a block.
#[inline(always)]
fn exp_block(xs: &[f32; BLOCK], max: f32, out: &mut [f32; BLOCK]) {
    for (e, &x) in out.iter_mut().zip(xs) {
        *e = exp_f32(x - max);
    }
}

/// The sum of a block, in a fixed order.
#[inline(always)]
fn sum_block(es: &[f32; BLOCK]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    for chunk in es.chunks_exact(LANES) {
        for (lane, &e) in lanes.iter_mut().zip(chunk) {
            *lane += e;
        }
    }
    lanes.iter().sum()
}

/// What one pass over the processed logits finds.
#[derive(Debug, Clone)]
pub(crate) struct LogitStats {
    /// The largest processed value; `-inf` when every logit is `-inf` or NaN.
    pub max: f32,
    /// The lowest id holding `max` (0 when everything is `-inf`), as `torch.argmax`.
    pub argmax: u32,
    /// `ln(sum(e^x))`, for log-probabilities.
    pub log_sum_exp: f32,
    /// The `top_n` highest (value, id) pairs, in [`canonical`] order; fewer when fewer values are
    /// above `-inf`.
    pub top: Vec<(f32, u32)>,
}

impl LogitStats {
    /// The log-probability of a processed value.
    pub fn logprob(&self, x: f32) -> f32 {
        if self.log_sum_exp == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            x - self.log_sum_exp
        }
    }
}

/// One pass over `logits` scaled by `inv_temperature`: the maximum, the argmax, the log-sum-exp
/// (the online softmax normaliser, rescaled once per block when the maximum grows) and the `top_n`
/// highest values.
pub(crate) fn logit_stats(logits: &[f32], inv_temperature: f32, top_n: usize) -> LogitStats {
    #[cfg(target_arch = "x86_64")]
    if kernels::avx2_allowed() {
        // SAFETY: `avx2_allowed` found AVX2 on this CPU.
        return unsafe { logit_stats_avx2(logits, inv_temperature, top_n) };
    }
    logit_stats_body(logits, inv_temperature, top_n)
}

/// [`logit_stats`] compiled for AVX2: one 8-lane register per `LANES` accumulators where the
/// baseline build takes two SSE halves (batch 64 spent 2% of its step here). Plain adds,
/// multiplies and compares (Rust never fuses them into FMAs), so the bits are the same.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn logit_stats_avx2(logits: &[f32], inv_temperature: f32, top_n: usize) -> LogitStats {
    logit_stats_body(logits, inv_temperature, top_n)
}

#[inline(always)]
fn logit_stats_body(logits: &[f32], inv_temperature: f32, top_n: usize) -> LogitStats {
    let mut max = f32::NEG_INFINITY;
    let mut argmax = 0u32;
    // sum(e^(x - max)) over the values seen so far.
    let mut sum = 0.0f64;
    let mut top = TopN::new(top_n);
    let mut xs = [0.0f32; BLOCK];
    let mut es = [0.0f32; BLOCK];
    for (block_index, block) in logits.chunks(BLOCK).enumerate() {
        let base = (block_index * BLOCK) as u32;
        let block_max = process_block(block, inv_temperature, &mut xs);
        if block_max == f32::NEG_INFINITY {
            continue;
        }
        if block_max > max {
            let offset = xs.iter().position(|&x| x == block_max).unwrap_or(0);
            argmax = base + offset as u32;
            sum *= f64::from(exp_f32(max - block_max));
            max = block_max;
        }
        exp_block(&xs, max, &mut es);
        sum += f64::from(sum_block(&es));
        if top.admits(block_max) {
            for (offset, &x) in xs[..block.len()].iter().enumerate() {
                top.offer(x, base + offset as u32);
            }
        }
    }
    let log_sum_exp = if max == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        max + sum.ln() as f32
    };
    LogitStats {
        max,
        argmax,
        log_sum_exp,
        top: top.into_sorted(),
    }
}

/// The `n` highest (value, id) pairs offered so far, ids offered in ascending order.
struct TopN {
    n: usize,
    /// Sorted in canonical order.
    items: Vec<(f32, u32)>,
}

impl TopN {
    fn new(n: usize) -> Self {
        Self {
            n,
            items: Vec::with_capacity(n),
        }
    }

    /// Whether a value could enter: cheaper to check once per block than per value.
    fn admits(&self, x: f32) -> bool {
        if self.n == 0 || x == f32::NEG_INFINITY {
            return false;
        }
        self.items.len() < self.n || self.items.last().is_some_and(|&(last, _)| x > last)
    }

    fn offer(&mut self, x: f32, id: u32) {
        if !self.admits(x) {
            return;
        }
        // Ids arrive in ascending order, so an equal value goes after the ones already here.
        let at = self.items.partition_point(|&(y, _)| y >= x);
        self.items.insert(at, (x, id));
        self.items.truncate(self.n);
    }

    fn into_sorted(self) -> Vec<(f32, u32)> {
        self.items
    }
}

/// One pass computing the weight of every token: their total (the top-p denominator when top-k
/// is off), and the `(weight, id)` candidates of weight at least `min_weight` (and above 0). Those
/// form a prefix of the [`by_probability`] order.
pub(crate) fn weigh_and_collect(
    logits: &[f32],
    inv_temperature: f32,
    max: f32,
    min_weight: u64,
) -> (u128, Vec<(u64, u32)>) {
    let min_weight = min_weight.max(1);
    let mut total = 0u128;
    let mut candidates = Vec::new();
    let mut xs = [0.0f32; BLOCK];
    let mut es = [0.0f32; BLOCK];
    let mut ws = [0u64; BLOCK];
    for (block_index, block) in logits.chunks(BLOCK).enumerate() {
        let block_max = process_block(block, inv_temperature, &mut xs);
        if block_max == f32::NEG_INFINITY {
            continue;
        }
        exp_block(&xs, max, &mut es);
        for (w, &e) in ws.iter_mut().zip(&es) {
            *w = fixed_point(e);
        }
        // At most 64 * 2^52: no overflow.
        total += u128::from(ws.iter().sum::<u64>());
        if ws.iter().all(|&w| w < min_weight) {
            continue;
        }
        let base = (block_index * BLOCK) as u32;
        for (offset, &w) in ws[..block.len()].iter().enumerate() {
            if w >= min_weight {
                candidates.push((w, base + offset as u32));
            }
        }
    }
    (total, candidates)
}

/// The draw order: higher weight (probability) first, then lower id. Total, so selection and
/// sorting give one result on every platform.
#[inline]
pub(crate) fn by_probability(a: &(u64, u32), b: &(u64, u32)) -> Ordering {
    b.0.cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The `k` best candidates in canonical order (unsorted), keeping at most `2k` in memory: when the
/// buffer fills it is cut back to the best `k`, and the `k`-th value becomes the bar later values
/// must beat. `-inf` never enters.
pub(crate) fn collect_top_k(logits: &[f32], inv_temperature: f32, k: usize) -> Vec<(f32, u32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let capacity = k.saturating_mul(2).min(logits.len());
    let mut kept: Vec<(f32, u32)> = Vec::with_capacity(capacity);
    // Ids arrive in ascending order, so a value equal to the bar loses to the one holding it.
    let mut bar = f32::NEG_INFINITY;
    let mut xs = [0.0f32; BLOCK];
    for (block_index, block) in logits.chunks(BLOCK).enumerate() {
        let base = (block_index * BLOCK) as u32;
        let block_max = process_block(block, inv_temperature, &mut xs);
        if block_max <= bar {
            continue;
        }
        for (offset, &x) in xs[..block.len()].iter().enumerate() {
            if x <= bar {
                continue;
            }
            kept.push((x, base + offset as u32));
            if kept.len() == capacity && capacity > k {
                kept.select_nth_unstable_by(k - 1, canonical);
                kept.truncate(k);
                bar = kept[k - 1].0;
            }
        }
    }
    if kept.len() > k {
        kept.select_nth_unstable_by(k - 1, canonical);
        kept.truncate(k);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x <= 10.0 {
            let exact = f64::from(x).exp();
            let ours = f64::from(exp_f32(x));
            worst = worst.max(((ours - exact) / exact).abs());
            x += 0.001_7;
        }
        assert!(worst < 2e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-100.0), 0.0);
    }

    #[test]
    fn process_cleans_non_finite_values() {
        assert_eq!(process(f32::NAN, 1.0), f32::NEG_INFINITY);
        assert_eq!(process(f32::INFINITY, 1.0), f32::MAX);
        assert_eq!(process(f32::NEG_INFINITY, 2.0), f32::NEG_INFINITY);
        assert!(process(-0.0, 1.0).is_sign_positive());
        assert_eq!(process(3.0, 0.5), 1.5);
    }

    #[test]
    fn penalty_follows_hf() {
        let logits = [2.0, -2.0, 0.0, 1.0];
        let out = apply_repetition_penalty(&logits, &[0, 1, 2, 0, 0, 99], 2.0);
        assert_eq!(&*out, &[1.0, -4.0, 0.0, 1.0]);
        assert!(matches!(
            apply_repetition_penalty(&logits, &[0], 1.0),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn stats_match_a_direct_computation() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let stats = logit_stats(&logits, 1.0, 5);
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let argmax = logits.iter().position(|&x| x == max).unwrap();
        let lse = f64::from(max)
            + logits
                .iter()
                .map(|&x| f64::from(x - max).exp())
                .sum::<f64>()
                .ln();
        assert_eq!(stats.max, max);
        assert_eq!(stats.argmax as usize, argmax);
        assert!((f64::from(stats.log_sum_exp) - lse).abs() < 1e-5);
        let mut expected: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (x, i as u32))
            .collect();
        expected.sort_by(canonical);
        expected.truncate(5);
        assert_eq!(stats.top, expected);
    }

    /// The AVX2 copy and the baseline build give the same bits: the sampler's results may not
    /// depend on the CPU.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_stats_equal_the_baseline_bit_for_bit() {
        if !kernels::avx2_allowed() {
            return;
        }
        let mut state = 0x9e37_79b9_u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            state
        };
        for len in [1, 7, 64, 65, 1000, 49_152] {
            let logits: Vec<f32> = (0..len)
                .map(|_| match next() % 97 {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => f32::INFINITY,
                    r => (next() >> 8) as f32 / 65_536.0 - 128.0 + r as f32 * 1e-3,
                })
                .collect();
            for (inv_t, top_n) in [(1.0, 0), (1.0, 5), (1.7, 20)] {
                let base = logit_stats_body(&logits, inv_t, top_n);
                // SAFETY: `avx2_allowed` found AVX2.
                let avx2 = unsafe { logit_stats_avx2(&logits, inv_t, top_n) };
                assert_eq!(base.max.to_bits(), avx2.max.to_bits(), "len {len}");
                assert_eq!(base.argmax, avx2.argmax, "len {len}");
                assert_eq!(
                    base.log_sum_exp.to_bits(),
                    avx2.log_sum_exp.to_bits(),
                    "len {len}"
                );
                assert_eq!(base.top, avx2.top, "len {len}");
            }
        }
    }

    #[test]
    fn stats_of_all_masked_logits() {
        let logits = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        let stats = logit_stats(&logits, 1.0, 2);
        assert_eq!(stats.argmax, 0);
        assert_eq!(stats.log_sum_exp, f32::NEG_INFINITY);
        assert_eq!(stats.logprob(stats.max), f32::NEG_INFINITY);
        assert!(stats.top.is_empty());
    }

    #[test]
    fn top_k_collection_matches_a_full_sort() {
        let logits: Vec<f32> = (0..5000).map(|i| ((i * 7919) % 613) as f32 / 7.0).collect();
        for k in [1, 2, 10, 64, 700, 4999, 5000, 9000] {
            let mut got = collect_top_k(&logits, 1.0, k);
            got.sort_by(canonical);
            let mut expected: Vec<(f32, u32)> = logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (x, i as u32))
                .collect();
            expected.sort_by(canonical);
            expected.truncate(k);
            assert_eq!(got, expected, "k = {k}");
        }
    }

    #[test]
    fn weights_sum_exactly() {
        let logits: Vec<f32> = (0..300).map(|i| (i % 17) as f32 * 0.3).collect();
        let stats = logit_stats(&logits, 1.0, 0);
        let (total, candidates) = weigh_and_collect(&logits, 1.0, stats.max, 0);
        assert_eq!(candidates.len(), 300);
        let summed: u128 = candidates.iter().rev().map(|&(w, _)| u128::from(w)).sum();
        assert_eq!(summed, total);
        for &(w, id) in &candidates {
            assert_eq!(w, weight(logits[id as usize], stats.max));
        }
        // The most likely token weighs exactly 2^52.
        assert_eq!(candidates.iter().map(|&(w, _)| w).max(), Some(1 << 52));
        let (same_total, heavy) = weigh_and_collect(&logits, 1.0, stats.max, 1 << 51);
        assert_eq!(same_total, total);
        assert!(heavy.iter().all(|&(w, _)| w >= 1 << 51));
        assert_eq!(
            heavy.len(),
            candidates.iter().filter(|&&(w, _)| w >= 1 << 51).count()
        );
    }

    #[test]
    fn fixed_point_rounds_exactly() {
        assert_eq!(fixed_point(1.0), 1 << 52);
        assert_eq!(fixed_point(0.5), 1 << 51);
        assert_eq!(fixed_point(0.0), 0);
        assert_eq!(fixed_point(2.0f32.powi(-53)), 0);
        assert_eq!(fixed_point(2.0f32.powi(-52)), 1);
        assert_eq!(fixed_point(3.0 * 2.0f32.powi(-53)), 2);
    }
}
