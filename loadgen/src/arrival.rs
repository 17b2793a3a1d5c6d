//! Open-loop arrival times. Inter-arrival gaps are gamma distributed with shape `burstiness`
//! and mean `1 / rate`, as in vLLM's `benchmark_serving` (`--burstiness`): shape 1 is a
//! Poisson process; below 1 the gaps' coefficient of variation, `1 / sqrt(burstiness)`, grows
//! and requests come in bursts; above 1 they come more evenly.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

use crate::error::LoadError;

pub struct Arrivals {
    rng: StdRng,
    gaps_s: Gamma<f64>,
}

impl Arrivals {
    pub fn new(rate_rps: f64, burstiness: f64, seed: u64) -> Result<Self, LoadError> {
        if !(rate_rps.is_finite() && rate_rps > 0.0) {
            return Err(LoadError::invalid("rate", "must be above 0", rate_rps));
        }
        if !(burstiness.is_finite() && burstiness > 0.0) {
            return Err(LoadError::invalid(
                "burstiness",
                "must be above 0 (1 is Poisson)",
                burstiness,
            ));
        }
        // Mean of Gamma(k, theta) is k * theta; theta = 1 / (rate * k) keeps it at 1 / rate.
        let gaps_s = Gamma::new(burstiness, 1.0 / (rate_rps * burstiness))
            .map_err(|e| LoadError::invalid("burstiness", e.to_string(), burstiness))?;
        Ok(Self {
            rng: StdRng::seed_from_u64(seed),
            gaps_s,
        })
    }

    /// The gap before the next arrival.
    pub fn next_gap(&mut self) -> Duration {
        Duration::from_secs_f64(self.gaps_s.sample(&mut self.rng))
    }

    /// Arrival offsets from the start of a level, up to `window` and at most `max_requests`
    /// of them. The first is at 0, as in vLLM's benchmark, so that no level, however short
    /// and slow, measures nothing. Computed up front so a slow dispatcher cannot change the
    /// schedule it is meant to follow.
    pub fn schedule(&mut self, window: Duration, max_requests: usize) -> Vec<Duration> {
        let mut at = Duration::ZERO;
        let mut out = Vec::new();
        while out.len() < max_requests && at < window {
            out.push(at);
            at += self.next_gap();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(rate: f64, burstiness: f64, n: usize) -> Vec<f64> {
        let mut a = Arrivals::new(rate, burstiness, 7).expect("valid");
        (0..n).map(|_| a.next_gap().as_secs_f64()).collect()
    }

    fn mean_cv(v: &[f64]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate_and_cv_one() {
        let (mean, cv) = mean_cv(&gaps(4.0, 1.0, 40_000));
        assert!((mean - 0.25).abs() < 0.25 * 0.03, "mean {mean}");
        assert!((cv - 1.0).abs() < 0.05, "cv {cv}");
    }

    #[test]
    fn burstiness_changes_the_spread_not_the_rate() {
        for (b, want_cv) in [(0.25, 2.0), (4.0, 0.5)] {
            let (mean, cv) = mean_cv(&gaps(2.0, b, 40_000));
            assert!(
                (mean - 0.5).abs() < 0.5 * 0.04,
                "burstiness {b}: mean {mean}"
            );
            assert!(
                (cv - want_cv).abs() < want_cv * 0.06,
                "burstiness {b}: cv {cv}, want {want_cv}"
            );
        }
    }

    #[test]
    fn schedules_are_seeded_and_bounded() {
        let window = Duration::from_secs(10);
        let a = Arrivals::new(5.0, 1.0, 1)
            .expect("valid")
            .schedule(window, 1000);
        let b = Arrivals::new(5.0, 1.0, 1)
            .expect("valid")
            .schedule(window, 1000);
        assert_eq!(a, b);
        assert_eq!(a[0], Duration::ZERO, "the first request goes at once");
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        assert!(a.iter().all(|t| *t < window));
        // About 50 arrivals in 10 s at 5/s (Poisson: sd about 7).
        assert!((30..=70).contains(&a.len()), "{} arrivals", a.len());
        let capped = Arrivals::new(5.0, 1.0, 1)
            .expect("valid")
            .schedule(window, 3);
        assert_eq!(capped.len(), 3);
    }

    #[test]
    fn bad_rates_are_refused() {
        assert!(Arrivals::new(0.0, 1.0, 0).is_err());
        assert!(Arrivals::new(1.0, 0.0, 0).is_err());
        assert!(Arrivals::new(f64::NAN, 1.0, 0).is_err());
    }
}
