//! Choosing the next token from a row of logits: repetition penalty, temperature, top-k, top-p and
//! a seeded draw, in the order of Hugging Face transformers.
//!
//! Determinism. A seeded request must produce the same tokens alone or in any batch, colocated or
//! split between prefill and decode nodes. So the draw depends only on `(seed, position)` (see
//! [`rng`]), and the token a draw picks depends only on the logits: candidates are visited in one
//! canonical order (probability descending, then id ascending), every set of candidates is defined
//! by values rather than by what a selection algorithm happens to leave where, and probabilities are
//! summed as fixed-point integers, which is exact in any order. Given the same logits, the same
//! parameters and the same position, every machine picks the same token.
//!
//! Visiting the most likely candidates first also makes the choice robust: a draw lands on the same
//! token when the logits move by a rounding error (as they do between batch shapes on a GPU), unless
//! it sits right on a boundary.
//!
//! Cost. Greedy decoding is one pass over the logits (two with a repetition penalty, which copies
//! them). Sampling adds a second pass (two more, rarely, for a flat distribution without top-k)
//! and then works only on the candidates that can matter, found with partial selection rather
//! than a sort of the vocabulary. Nothing is allocated beyond the candidates and, with a
//! repetition penalty, one copy of the logits.

mod logits;
mod params;
mod rng;

pub use params::{SamplingParams, GREEDY_TEMPERATURE_EPS, MAX_TOP_N_LOGPROBS};

use logits::{
    apply_repetition_penalty, by_probability, collect_top_k, logit_stats, process,
    weigh_and_collect, weight, LogitStats,
};

/// The chosen token and its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token_id: u32,
    /// Log-softmax of the processed logits (after the repetition penalty and, unless greedy, the
    /// temperature; before top-k and top-p) at `token_id`.
    pub logprob: f32,
    /// The `top_n_logprobs` most likely `(token_id, logprob)`, most likely first, ties by lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Chooses the token at `position` (prompt length + tokens generated so far) from `logits`.
///
/// `context_ids` is the prompt followed by the tokens generated so far, for the repetition
/// penalty. `params` must have passed [`SamplingParams::validate`]. The random draw depends only on
/// `(params.seed, position)`, never on batch or node state, so a seeded request yields identical
/// tokens alone, in any batch, colocated or disaggregated.
///
/// Every logit being `-inf` or NaN (or `logits` being empty) is degenerate: token 0 is returned
/// with a log-probability of `-inf`, as `torch.argmax` would pick it.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    context_ids: &[u32],
    position: u64,
) -> SampledToken {
    let values = apply_repetition_penalty(logits, context_ids, params.repetition_penalty);
    let inv_temperature = if params.temperature < GREEDY_TEMPERATURE_EPS {
        1.0
    } else {
        1.0 / params.temperature
    };
    let stats = logit_stats(&values, inv_temperature, params.top_n_logprobs);
    let token_id = if params.is_greedy() || stats.max == f32::NEG_INFINITY {
        stats.argmax
    } else {
        let draw = rng::random_u53(params.seed, position, 0);
        choose(&values, inv_temperature, &stats, params, draw)
    };
    let chosen = values
        .get(token_id as usize)
        .map_or(f32::NEG_INFINITY, |&logit| process(logit, inv_temperature));
    SampledToken {
        token_id,
        logprob: stats.logprob(chosen),
        top_logprobs: stats
            .top
            .iter()
            .map(|&(x, id)| (id, stats.logprob(x)))
            .collect(),
    }
}

/// The token a non-greedy draw picks. `draw` is uniform in `[0, 2^53)`.
fn choose(
    values: &[f32],
    inv_temperature: f32,
    stats: &LogitStats,
    params: &SamplingParams,
    draw: u64,
) -> u32 {
    let top_p = (params.top_p < 1.0).then_some(params.top_p);
    if params.top_k > 0 && params.top_k < values.len() {
        let mut candidates: Vec<(u64, u32)> = collect_top_k(values, inv_temperature, params.top_k)
            .into_iter()
            .map(|(x, id)| (weight(x, stats.max), id))
            .collect();
        let total = candidates.iter().map(|&(w, _)| u128::from(w)).sum();
        return draw_from(&mut candidates, total, top_p, draw).unwrap_or(stats.argmax);
    }
    // Without top-k, the nucleus and the draw only ever reach the most likely candidates: the
    // nucleus ends once it holds `top_p` of the mass, and the draw once the mass passed exceeds
    // the draw. So only candidates above a weight floor are collected. The first floor assumes
    // that at most `LIKELY_TAIL` candidates' worth of mass lies below it, which holds for peaked
    // distributions; `draw_from` checks the collected mass exactly and declines when it falls
    // short. The second floor holds for any distribution; the last takes everything.
    let needed = match top_p {
        Some(p) => f64::from(p),
        None => rng::unit_interval(draw),
    };
    let vocab_size = values.len() as f64;
    let floors = [
        weight_floor(stats, needed, LIKELY_TAIL.min(vocab_size)),
        weight_floor(stats, needed, vocab_size),
        0,
    ];
    for min_weight in floors {
        let (total, mut candidates) =
            weigh_and_collect(values, inv_temperature, stats.max, min_weight);
        if let Some(id) = draw_from(&mut candidates, total, top_p, draw) {
            return id;
        }
    }
    stats.argmax
}

/// How many candidates' worth of probability the first floor of [`choose`] assumes below it.
const LIKELY_TAIL: f64 = 1024.0;

/// A weight such that, if at most `tail_count` candidates weigh less, they hold less than half of
/// the probability beyond `needed` (each holds under `(1 - needed) / (2 * tail_count)`), so the
/// candidates at or above it hold more than `needed`. With `tail_count` the vocabulary size this
/// always holds.
fn weight_floor(stats: &LogitStats, needed: f64, tail_count: f64) -> u64 {
    let per_candidate = (1.0 - needed) / (2.0 * tail_count);
    // Probability p is weight p * e^(lse - max) * 2^52.
    let scale = (f64::from(stats.log_sum_exp) - f64::from(stats.max)).exp() * (1u64 << 52) as f64;
    (per_candidate * scale).min((1u64 << 52) as f64) as u64
}

/// Inverse-CDF draw over `(weight, id)` candidates in [`by_probability`] order, after cutting them
/// to the top-p nucleus of `total` (the weight of the whole filtered distribution). `None` when
/// the candidates do not reach far enough: a floor cut them too short.
fn draw_from(
    candidates: &mut [(u64, u32)],
    total: u128,
    top_p: Option<f32>,
    draw: u64,
) -> Option<u32> {
    let mass = match top_p {
        Some(p) => {
            // As HF: keep a candidate while the weight before it is below the bar, and at least
            // one. The last one kept is the first whose running weight reaches the bar.
            let bar = (f64::from(p) * total as f64) as u128;
            let last = first_exceeding(candidates, bar.max(1) - 1)?;
            last.weight_before + u128::from(last.weight)
        }
        None => total,
    };
    if mass == 0 {
        return None;
    }
    first_exceeding(candidates, scale(draw, mass)).map(|found| found.id)
}

/// `floor(draw * mass / 2^53)`, exactly: a uniform point in `[0, mass)`.
fn scale(draw: u64, mass: u128) -> u128 {
    let draw = u128::from(draw);
    let high = mass >> 64;
    let low = mass & u128::from(u64::MAX);
    ((draw * high) << 11) + ((draw * low) >> 53)
}

/// A candidate found by [`first_exceeding`].
#[derive(Debug, Clone, Copy)]
struct Found {
    id: u32,
    weight: u64,
    /// The weight of all candidates before it.
    weight_before: u128,
}

/// The first candidate in [`by_probability`] order at which the running weight exceeds `target`;
/// `None` when the candidates' total weight does not.
///
/// A weighted quickselect rather than a sort: partial selection splits the candidates around a
/// pivot, the side holding the answer is kept, and only the last few are sorted. The first pivot is
/// the 32nd most likely, since the answer usually lies among the most likely candidates. Expected
/// linear time. The answer is unique because the order is total, however selection moves things.
fn first_exceeding(candidates: &mut [(u64, u32)], target: u128) -> Option<Found> {
    const SORT_BELOW: usize = 32;
    let mass = |items: &[(u64, u32)]| -> u128 { items.iter().map(|&(w, _)| u128::from(w)).sum() };
    let mut items = candidates;
    let mut weight_before = 0u128;
    let mut pivot_index = SORT_BELOW - 1;
    while items.len() > SORT_BELOW {
        let (better, &mut (weight, id), worse) =
            items.select_nth_unstable_by(pivot_index, by_probability);
        let better_mass = mass(better);
        if weight_before + better_mass > target {
            items = better;
        } else if weight_before + better_mass + u128::from(weight) > target {
            return Some(Found {
                id,
                weight,
                weight_before: weight_before + better_mass,
            });
        } else {
            weight_before += better_mass + u128::from(weight);
            items = worse;
        }
        pivot_index = items.len() / 2;
    }
    items.sort_unstable_by(by_probability);
    for &(weight, id) in items.iter() {
        if weight_before + u128::from(weight) > target {
            return Some(Found {
                id,
                weight,
                weight_before,
            });
        }
        weight_before += u128::from(weight);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
            ..SamplingParams::greedy()
        }
    }

    fn log_softmax(xs: &[f32]) -> Vec<f64> {
        let max = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + xs.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        xs.iter().map(|&x| x as f64 - lse).collect()
    }

    /// The straightforward version of `choose`: full sorts, truncate, nucleus, draw.
    fn reference_choice(logits: &[f32], params: &SamplingParams, draw: u64) -> u32 {
        let inv_t = 1.0 / params.temperature;
        let mut by_value: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (process(l, inv_t), i as u32))
            .collect();
        by_value.sort_by(logits::canonical);
        let max = by_value[0].0;
        if params.top_k > 0 {
            by_value.truncate(params.top_k);
        }
        let mut all: Vec<(u64, u32)> = by_value
            .iter()
            .map(|&(x, id)| (weight(x, max), id))
            .collect();
        all.sort_by(by_probability);
        let total: u128 = all.iter().map(|&(w, _)| u128::from(w)).sum();
        let mut len = all.len();
        if params.top_p < 1.0 {
            let bar = (f64::from(params.top_p) * total as f64) as u128;
            let mut before = 0u128;
            len = 0;
            while len < all.len() && (len == 0 || before < bar) {
                before += u128::from(all[len].0);
                len += 1;
            }
        }
        let mass: u128 = all[..len].iter().map(|&(w, _)| u128::from(w)).sum();
        let target = scale(draw, mass);
        let mut passed = 0u128;
        for &(w, id) in &all[..len] {
            passed += u128::from(w);
            if passed > target {
                return id;
            }
        }
        unreachable!("passed reaches mass > target")
    }

    /// Logits shaped like a language model's: a few likely tokens over a long flat tail.
    fn lm_like_logits(vocab: usize, salt: u64) -> Vec<f32> {
        (0..vocab)
            .map(|i| {
                let noise = rng::uniform(salt, i as u64, 7) as f32;
                if i % 997 == 3 {
                    8.0 + 4.0 * noise
                } else {
                    6.0 * noise - 3.0
                }
            })
            .collect()
    }

    #[test]
    fn greedy_is_the_argmax_with_its_logprob() {
        let logits = [0.5, 2.0, -1.0, 2.0, 1.5];
        let token = sample(&logits, &SamplingParams::greedy(), &[], 0);
        // Ties go to the lower id, as torch.argmax.
        assert_eq!(token.token_id, 1);
        let expected = log_softmax(&logits)[1];
        assert!((f64::from(token.logprob) - expected).abs() < 1e-5);
    }

    #[test]
    fn greedy_ignores_temperature_below_the_epsilon() {
        let logits = [1.0, 3.0, 2.0];
        let token = sample(&logits, &params(1e-7, 0, 1.0, 0), &[], 0);
        assert_eq!(token.token_id, 1);
        assert!((f64::from(token.logprob) - log_softmax(&logits)[1]).abs() < 1e-5);
    }

    #[test]
    fn top_logprobs_are_sorted_with_ties_by_lower_id() {
        let logits = [1.0, 3.0, 2.0, 3.0, -1.0, 2.0];
        let greedy = SamplingParams {
            top_n_logprobs: 4,
            ..SamplingParams::greedy()
        };
        let token = sample(&logits, &greedy, &[], 0);
        let ids: Vec<u32> = token.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 3, 2, 5]);
        let expected = log_softmax(&logits);
        for &(id, logprob) in &token.top_logprobs {
            assert!((f64::from(logprob) - expected[id as usize]).abs() < 1e-5);
        }
        assert_eq!(token.top_logprobs[0].1, token.logprob);
    }

    #[test]
    fn logprobs_use_the_temperature_when_sampling() {
        let logits = [1.0, 2.0, 0.0];
        let sampling = SamplingParams {
            top_n_logprobs: 3,
            ..params(0.5, 0, 1.0, 9)
        };
        let token = sample(&logits, &sampling, &[], 0);
        let scaled: Vec<f32> = logits.iter().map(|&x| x / 0.5).collect();
        let expected = log_softmax(&scaled);
        assert!((f64::from(token.logprob) - expected[token.token_id as usize]).abs() < 1e-5);
        assert_eq!(token.top_logprobs.len(), 3);
    }

    #[test]
    fn repetition_penalty_matches_hf() {
        // HF RepetitionPenaltyLogitsProcessor(penalty=2.0) on input_ids [0, 1, 0]:
        // 3.0 -> 1.5 (divided), -1.0 -> -2.0 (multiplied), 2.0 untouched: argmax moves to id 2.
        let logits = [3.0, -1.0, 2.0, 0.5];
        let penalized = SamplingParams {
            repetition_penalty: 2.0,
            top_n_logprobs: 4,
            ..SamplingParams::greedy()
        };
        let token = sample(&logits, &penalized, &[0, 1, 0], 0);
        assert_eq!(token.token_id, 2);
        let expected = log_softmax(&[1.5, -2.0, 2.0, 0.5]);
        assert!((f64::from(token.logprob) - expected[2]).abs() < 1e-5);
        let ids: Vec<u32> = token.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![2, 0, 3, 1]);
        for &(id, logprob) in &token.top_logprobs {
            assert!((f64::from(logprob) - expected[id as usize]).abs() < 1e-5);
        }
    }

    #[test]
    fn masked_and_nan_logits_are_never_chosen() {
        let logits = [f32::NEG_INFINITY, f32::NAN, 0.0, f32::NEG_INFINITY, -50.0];
        for position in 0..2000 {
            let token = sample(&logits, &params(5.0, 0, 1.0, 3), &[], position);
            assert!(matches!(token.token_id, 2 | 4), "{}", token.token_id);
        }
        let top_k = sample(&logits, &params(5.0, 4, 1.0, 3), &[], 0);
        assert!(matches!(top_k.token_id, 2 | 4));
    }

    #[test]
    fn all_masked_logits_give_token_zero() {
        let logits = [f32::NEG_INFINITY, f32::NAN];
        for sampling in [SamplingParams::greedy(), params(1.0, 0, 0.9, 1)] {
            let token = sample(&logits, &sampling, &[], 0);
            assert_eq!(token.token_id, 0);
            assert_eq!(token.logprob, f32::NEG_INFINITY);
        }
        assert_eq!(sample(&[], &SamplingParams::greedy(), &[], 0).token_id, 0);
    }

    #[test]
    fn same_seed_and_position_give_the_same_token_in_any_order() {
        let logits = lm_like_logits(4096, 1);
        let sampling = params(1.0, 0, 1.0, 1234);
        let forward: Vec<u32> = (0..300)
            .map(|p| sample(&logits, &sampling, &[], p).token_id)
            .collect();
        // Interleave other requests' draws and go backwards: nothing is carried between calls.
        let backward: Vec<u32> = (0..300)
            .rev()
            .map(|p| {
                sample(&logits, &params(0.7, 40, 0.9, p), &[], p);
                sample(&logits, &sampling, &[], p).token_id
            })
            .collect();
        let mut backward = backward;
        backward.reverse();
        assert_eq!(forward, backward);
    }

    #[test]
    fn different_seeds_differ() {
        let logits = vec![0.0f32; 64];
        let differ = (0..500)
            .filter(|&p| {
                sample(&logits, &params(1.0, 0, 1.0, 1), &[], p).token_id
                    != sample(&logits, &params(1.0, 0, 1.0, 2), &[], p).token_id
            })
            .count();
        // Two independent uniform draws over 64 tokens agree 1/64 of the time.
        assert!(differ > 470, "only {differ} of 500 differ");
    }

    #[test]
    fn empirical_distribution_matches_softmax() {
        let logits = [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -3.0, 0.2];
        let temperature = 0.8;
        let scaled: Vec<f32> = logits.iter().map(|&x| x / temperature).collect();
        let expected: Vec<f64> = log_softmax(&scaled).iter().map(|l| l.exp()).collect();
        check_frequencies(&logits, &params(temperature, 0, 1.0, 77), &expected);
    }

    #[test]
    fn empirical_distribution_with_top_k_and_top_p() {
        let logits = [1.0, 0.0, 2.0, -1.0, 0.5, 1.5, -3.0, 0.2];
        let probs: Vec<f64> = log_softmax(&logits).iter().map(|l| l.exp()).collect();
        // top-k 4 keeps ids 2, 5, 0, 4; renormalised, top-p 0.8 keeps 2, 5, 0 (the mass before
        // id 0 is below 0.8, the mass before id 4 is not).
        let kept = [2usize, 5, 0];
        let kept_mass: f64 = kept.iter().map(|&i| probs[i]).sum();
        let top4: f64 = [2usize, 5, 0, 4].iter().map(|&i| probs[i]).sum();
        assert!((probs[2] + probs[5]) / top4 < 0.8 && kept_mass / top4 >= 0.8);
        let mut expected = vec![0.0; logits.len()];
        for &i in &kept {
            expected[i] = probs[i] / kept_mass;
        }
        check_frequencies(&logits, &params(1.0, 4, 0.8, 5), &expected);
    }

    fn check_frequencies(logits: &[f32], sampling: &SamplingParams, expected: &[f64]) {
        const DRAWS: u64 = 20_000;
        let mut counts = vec![0u64; logits.len()];
        for position in 0..DRAWS {
            counts[sample(logits, sampling, &[], position).token_id as usize] += 1;
        }
        for (id, (&count, &p)) in counts.iter().zip(expected).enumerate() {
            let observed = count as f64 / DRAWS as f64;
            // Five standard deviations of a binomial proportion, and never a token of zero mass.
            let tolerance = 5.0 * (p * (1.0 - p) / DRAWS as f64).sqrt() + 1e-9;
            assert!(
                (observed - p).abs() <= tolerance,
                "id {id}: observed {observed}, expected {p} (counts {counts:?})"
            );
        }
    }

    #[test]
    fn large_vocabulary_tail_mass_is_drawn_correctly() {
        // The floor-based candidate collection must keep the flat tail's share.
        let logits = lm_like_logits(4096, 2);
        let probs: Vec<f64> = log_softmax(&logits).iter().map(|l| l.exp()).collect();
        let is_head = |i: usize| i % 997 == 3;
        let head_mass: f64 = (0..probs.len())
            .filter(|&i| is_head(i))
            .map(|i| probs[i])
            .sum();
        const DRAWS: u64 = 10_000;
        let head_draws = (0..DRAWS)
            .filter(|&p| {
                is_head(sample(&logits, &params(1.0, 0, 1.0, 11), &[], p).token_id as usize)
            })
            .count();
        let observed = head_draws as f64 / DRAWS as f64;
        let tolerance = 5.0 * (head_mass * (1.0 - head_mass) / DRAWS as f64).sqrt();
        assert!(
            (observed - head_mass).abs() <= tolerance,
            "head drawn {observed}, mass {head_mass}"
        );
    }

    #[test]
    fn flat_distributions_fall_back_to_the_safe_floor() {
        // Every token equally likely: the first floor collects nothing and the safe one all.
        let logits = vec![0.25f32; 20_000];
        for (top_p, position) in [(1.0, 0), (1.0, 1), (0.5, 2), (0.999, 3)] {
            let sampling = params(1.0, 0, top_p, 4);
            let draw = rng::random_u53(4, position, 0);
            assert_eq!(
                sample(&logits, &sampling, &[], position).token_id,
                reference_choice(&logits, &sampling, draw)
            );
        }
    }

    #[test]
    fn a_heavy_tail_beyond_the_first_floor_is_still_drawn() {
        // 10 tokens at 10 and 4990 at 5: the tail holds 77% of the mass, in tokens too unlikely
        // for the first floor, which then collects the head only.
        let logits: Vec<f32> = (0..5000)
            .map(|i| if i % 500 == 0 { 10.0 } else { 5.0 })
            .collect();
        let mut tail_draws = 0;
        for position in 0..300 {
            for top_p in [1.0, 0.9] {
                let sampling = params(1.0, 0, top_p, 6);
                let draw = rng::random_u53(6, position, 0);
                let token = sample(&logits, &sampling, &[], position).token_id;
                assert_eq!(token, reference_choice(&logits, &sampling, draw));
                tail_draws += usize::from(logits[token as usize] < 10.0);
            }
        }
        assert!(tail_draws > 300, "{tail_draws}");
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        for salt in 0..20 {
            let logits = lm_like_logits(5000, salt);
            let greedy = sample(&logits, &SamplingParams::greedy(), &[], 0).token_id;
            for position in 0..20 {
                let top_k = sample(&logits, &params(1.3, 1, 1.0, salt), &[], position);
                let top_p = sample(&logits, &params(1.3, 0, 1e-6, salt), &[], position);
                let both = sample(&logits, &params(0.6, 50, 1e-6, salt), &[], position);
                assert_eq!(top_k.token_id, greedy);
                assert_eq!(top_p.token_id, greedy);
                assert_eq!(both.token_id, greedy);
            }
        }
    }

    #[test]
    fn top_k_one_with_tied_maxima_picks_the_lowest_id() {
        let logits = [0.0, 4.0, 1.0, 4.0];
        let token = sample(&logits, &params(1.0, 1, 1.0, 8), &[], 3);
        assert_eq!(token.token_id, 1);
    }

    #[test]
    fn scale_is_exact() {
        let mass = (1u128 << 84) - 12_345;
        assert_eq!(scale(0, mass), 0);
        assert_eq!(
            scale((1 << 53) - 1, mass),
            mass - 1 - (mass - 1) / (1 << 53)
        );
        assert_eq!(scale(1 << 52, 1000), 500);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        #[test]
        fn choice_matches_the_reference(
            logits in prop::collection::vec(-20.0f32..20.0, 1..3000),
            temperature in 0.05f32..3.0,
            top_k in prop_oneof![Just(0usize), 1usize..100, 2000usize..4000],
            top_p in prop_oneof![Just(1.0f32), 0.01f32..1.0],
            seed: u64,
            position in 0u64..1_000_000,
        ) {
            let sampling = params(temperature, top_k, top_p, seed);
            let got = sample(&logits, &sampling, &[], position).token_id;
            let draw = rng::random_u53(seed, position, 0);
            prop_assert_eq!(got, reference_choice(&logits, &sampling, draw));
        }

        #[test]
        fn greedy_matches_a_naive_argmax(logits in prop::collection::vec(-5i8..5, 1..500)) {
            let logits: Vec<f32> = logits.iter().map(|&x| f32::from(x)).collect();
            let mut best = 0;
            for (i, &x) in logits.iter().enumerate() {
                if x > logits[best] {
                    best = i;
                }
            }
            let token = sample(&logits, &SamplingParams::greedy(), &[], 0);
            prop_assert_eq!(token.token_id as usize, best);
            prop_assert!((f64::from(token.logprob) - log_softmax(&logits)[best]).abs() < 1e-4);
        }
    }
}
