//! The rate sweep that finds the goodput: levels at increasing rates until one misses the 90%
//! attainment target, then optional bisection between the last rate that met it and the first
//! that did not. Attainment falls as the rate grows once a server saturates, so the scan stops
//! at the first miss instead of spending time on rates that can only be worse.

use std::str::FromStr;

use serde::Serialize;

use crate::goodput::meets_target;

/// At most this many scanned rates, so a `start:factor:max` typo stays bounded.
pub const MAX_SWEEP_RATES: usize = 32;

/// The rates to scan: a list (`0.5,1,2,4`) or a geometric series (`start:factor:max`, as
/// `0.5:2:8` for 0.5, 1, 2, 4, 8).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct SweepSpec {
    rates: Vec<f64>,
}

impl SweepSpec {
    pub fn rates(&self) -> &[f64] {
        &self.rates
    }
}

impl FromStr for SweepSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let num = |x: &str| {
            x.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| format!("`{x}` in `{s}` is not a positive rate"))
        };
        let mut rates = if s.contains(':') {
            let parts: Vec<&str> = s.split(':').collect();
            let [start, factor, max] = parts[..] else {
                return Err(format!("`{s}`: a series is start:factor:max, as 0.5:2:8"));
            };
            let (start, factor, max) = (num(start)?, num(factor)?, num(max)?);
            if factor <= 1.0 {
                return Err(format!("`{s}`: the factor must be above 1"));
            }
            let mut v = Vec::new();
            let mut r = start;
            // A hair over `max` still counts, so 0.1:2:0.8 reaches 0.8 despite rounding.
            while r <= max * (1.0 + 1e-9) && v.len() <= MAX_SWEEP_RATES {
                v.push(r);
                r *= factor;
            }
            v
        } else {
            s.split(',').map(num).collect::<Result<Vec<_>, _>>()?
        };
        rates.sort_by(f64::total_cmp);
        rates.dedup();
        if rates.is_empty() || rates.len() > MAX_SWEEP_RATES {
            return Err(format!(
                "`{s}` gives {} rates; a sweep has 1 to {MAX_SWEEP_RATES}",
                rates.len()
            ));
        }
        Ok(Self { rates })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SweepPoint {
    pub rate_rps: f64,
    pub attainment: f64,
    pub meets_slo: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SweepResult {
    /// The highest rate measured to meet the target; `None` when even the lowest missed it.
    pub goodput_rps: Option<f64>,
    /// The lowest rate measured to miss it; `None` when every rate met it (the goodput is then
    /// at least the highest rate tried, not the server's limit).
    pub first_miss_rps: Option<f64>,
    pub points: Vec<SweepPoint>,
}

/// The search as a state machine: ask [`Self::next_rate`], run that level, [`Self::record`]
/// its attainment. The caller owns the measuring, so the search is tested on synthetic
/// attainment curves.
#[derive(Debug, Clone)]
pub struct SweepSearch {
    rates: Vec<f64>,
    scanned: usize,
    bisect_left: usize,
    last_good: Option<f64>,
    first_miss: Option<f64>,
    points: Vec<SweepPoint>,
}

impl SweepSearch {
    pub fn new(spec: &SweepSpec, bisect_steps: usize) -> Self {
        Self {
            rates: spec.rates.clone(),
            scanned: 0,
            bisect_left: bisect_steps,
            last_good: None,
            first_miss: None,
            points: Vec::new(),
        }
    }

    pub fn next_rate(&self) -> Option<f64> {
        if self.first_miss.is_none() {
            return self.rates.get(self.scanned).copied();
        }
        match (self.last_good, self.first_miss) {
            // Halving stops once the bracket is within 2% of its top: closer than that, two
            // levels of a noisy server cannot tell the rates apart.
            (Some(lo), Some(hi)) if self.bisect_left > 0 && hi - lo > 0.02 * hi => {
                Some((lo + hi) / 2.0)
            }
            _ => None,
        }
    }

    pub fn record(&mut self, rate_rps: f64, attainment: f64) {
        let meets_slo = meets_target(attainment);
        if self.first_miss.is_none() {
            self.scanned += 1;
        } else {
            self.bisect_left = self.bisect_left.saturating_sub(1);
        }
        if meets_slo {
            self.last_good = Some(self.last_good.map_or(rate_rps, |g| g.max(rate_rps)));
        } else {
            self.first_miss = Some(self.first_miss.map_or(rate_rps, |m| m.min(rate_rps)));
        }
        self.points.push(SweepPoint {
            rate_rps,
            attainment,
            meets_slo,
        });
    }

    pub fn result(&self) -> SweepResult {
        let mut points = self.points.clone();
        points.sort_by(|a, b| a.rate_rps.total_cmp(&b.rate_rps));
        SweepResult {
            goodput_rps: self.last_good,
            first_miss_rps: self.first_miss,
            points,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(s: &str) -> SweepSpec {
        s.parse().expect("valid sweep")
    }

    /// Runs the search against `attainment(rate)`, returning the rates tried in order.
    fn drive(
        spec: &SweepSpec,
        bisect: usize,
        attainment: impl Fn(f64) -> f64,
    ) -> (Vec<f64>, SweepResult) {
        let mut s = SweepSearch::new(spec, bisect);
        let mut tried = Vec::new();
        while let Some(r) = s.next_rate() {
            assert!(tried.len() < 100, "the search must end");
            tried.push(r);
            s.record(r, attainment(r));
        }
        (tried, s.result())
    }

    #[test]
    fn specs_parse_as_lists_and_series() {
        assert_eq!(spec("2,0.5,1,2").rates(), &[0.5, 1.0, 2.0]);
        assert_eq!(spec("0.5:2:8").rates(), &[0.5, 1.0, 2.0, 4.0, 8.0]);
        assert_eq!(spec("0.1:2:0.8").rates(), &[0.1, 0.2, 0.4, 0.8]);
        assert_eq!(spec("3").rates(), &[3.0]);
        assert!("1:1:4".parse::<SweepSpec>().is_err());
        assert!("0,1".parse::<SweepSpec>().is_err());
        assert!("1:2".parse::<SweepSpec>().is_err());
        assert!("0.001:1.01:1000".parse::<SweepSpec>().is_err());
    }

    #[test]
    fn the_scan_stops_at_the_first_miss_and_bisects() {
        // A server that keeps 100% up to 3.3 req/s and 50% above.
        let curve = |r: f64| if r <= 3.3 { 1.0 } else { 0.5 };
        let (tried, res) = drive(&spec("1,2,4,8"), 4, curve);
        assert_eq!(tried, vec![1.0, 2.0, 4.0, 3.0, 3.5, 3.25, 3.375]);
        assert_eq!(res.goodput_rps, Some(3.25));
        assert_eq!(res.first_miss_rps, Some(3.375));
        assert_eq!(res.points.len(), 7);
        assert!(res.points.windows(2).all(|w| w[0].rate_rps < w[1].rate_rps));
    }

    #[test]
    fn without_bisection_the_goodput_is_the_last_good_rate() {
        let curve = |r: f64| 1.0 - r / 10.0; // 90% at 1 req/s, then lower
        let (tried, res) = drive(&spec("0.5:2:8"), 0, curve);
        assert_eq!(tried, vec![0.5, 1.0, 2.0]);
        assert_eq!(res.goodput_rps, Some(1.0));
        assert_eq!(res.first_miss_rps, Some(2.0));
    }

    #[test]
    fn edges_all_good_and_none_good() {
        let (tried, res) = drive(&spec("1,2,4"), 3, |_| 0.95);
        assert_eq!(tried, vec![1.0, 2.0, 4.0]);
        assert_eq!((res.goodput_rps, res.first_miss_rps), (Some(4.0), None));
        let (tried, res) = drive(&spec("1,2,4"), 3, |_| 0.2);
        assert_eq!(tried, vec![1.0], "no good rate: nothing to bisect from");
        assert_eq!((res.goodput_rps, res.first_miss_rps), (None, Some(1.0)));
    }

    #[test]
    fn bisection_converges_on_a_smooth_curve() {
        // Attainment crosses 90% at 5.05 req/s.
        let curve = |r: f64| (1.405 - r / 10.0).clamp(0.0, 1.0);
        let (_, res) = drive(&spec("1,2,4,8,16"), 8, curve);
        let g = res.goodput_rps.expect("a good rate");
        let miss = res.first_miss_rps.expect("a missed rate");
        assert!(g <= 5.06 && miss >= 5.04, "{g} {miss}");
        assert!(miss - g <= 0.02 * miss + 1e-9, "bracket {g}..{miss}");
    }
}
