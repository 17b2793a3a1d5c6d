//! A counter-based random number generator for sampling.
//!
//! A seeded request must yield the same tokens whether it runs alone or in a batch, on one node or
//! split between a prefill node and a decode node. A stateful generator (one stream per engine or
//! per batch) breaks that: the numbers a request gets would depend on how many draws other requests
//! made before it, and on which node made them. Instead every draw is a pure function of
//! `(seed, position, draw_index)`, like Philox in JAX and cuRAND: no state to carry, ship or keep in
//! sync, and the same draw on every node.
//!
//! The mixing function is the splitmix64 finalizer (Steele, Lea and Flood, "Fast splittable
//! pseudorandom number generators", 2014), applied once per input word. It passes BigCrush as a
//! generator and is plenty for choosing tokens; it is not a cryptographic generator.

/// The golden-ratio increment of splitmix64: spreads consecutive counters over the whole range.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The splitmix64 finalizer: a bijection on `u64` with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// 64 random bits for draw `draw_index` of the token at `position` of a request seeded with `seed`.
pub fn random_u64(seed: u64, position: u64, draw_index: u64) -> u64 {
    let h = mix64(seed.wrapping_add(GAMMA));
    let h = mix64(h ^ position.wrapping_add(1).wrapping_mul(GAMMA));
    mix64(h ^ draw_index.wrapping_add(1).wrapping_mul(GAMMA))
}

/// 53 random bits: a uniform integer in `[0, 2^53)`, the numerator of [`unit_interval`].
pub fn random_u53(seed: u64, position: u64, draw_index: u64) -> u64 {
    random_u64(seed, position, draw_index) >> 11
}

/// A [`random_u53`] as a uniform `f64` in `[0, 1)`, exactly.
pub fn unit_interval(u53: u64) -> f64 {
    u53 as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A uniform `f64` in `[0, 1)` for `(seed, position, draw_index)`.
#[cfg(test)]
pub fn uniform(seed: u64, position: u64, draw_index: u64) -> f64 {
    unit_interval(random_u53(seed, position, draw_index))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_inputs_give_the_same_number() {
        assert_eq!(uniform(7, 100, 0), uniform(7, 100, 0));
        assert_eq!(
            random_u64(u64::MAX, u64::MAX, u64::MAX),
            random_u64(u64::MAX, u64::MAX, u64::MAX)
        );
    }

    #[test]
    fn each_input_changes_the_number() {
        let base = random_u64(1, 2, 3);
        assert_ne!(base, random_u64(0, 2, 3));
        assert_ne!(base, random_u64(1, 3, 3));
        assert_ne!(base, random_u64(1, 2, 4));
        // Swapping seed and position must not collide.
        assert_ne!(random_u64(5, 9, 0), random_u64(9, 5, 0));
    }

    #[test]
    fn uniform_is_in_range_and_roughly_flat() {
        const BINS: usize = 20;
        const N: u64 = 100_000;
        let mut counts = [0u64; BINS];
        for position in 0..N {
            let u = uniform(42, position, 0);
            assert!((0.0..1.0).contains(&u), "{u} out of range");
            counts[(u * BINS as f64) as usize] += 1;
        }
        let expected = N as f64 / BINS as f64;
        let chi2: f64 = counts
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum();
        // 19 degrees of freedom: p = 0.001 at 43.8.
        assert!(chi2 < 43.8, "chi-square {chi2} over {counts:?}");
    }

    #[test]
    fn neighbouring_seeds_are_uncorrelated() {
        // Adjacent seeds at the same position agree on the top bit about half of the time.
        let agree = (0..10_000u64)
            .filter(|&seed| (random_u64(seed, 0, 0) >> 63) == (random_u64(seed + 1, 0, 0) >> 63))
            .count();
        assert!((4_700..5_300).contains(&agree), "{agree} of 10000 agree");
    }
}
