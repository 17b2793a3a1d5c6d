//! Percentiles and distribution summaries over latency samples.

use serde::Serialize;

/// The `p`-th percentile (0..=100) by linear interpolation between closest ranks (numpy's
/// default, which vLLM's and SGLang's benchmarks report); NaN for no samples.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| !x.is_nan()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    percentile_sorted(&v, p)
}

fn percentile_sorted(v: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

pub fn median(samples: &[f64]) -> f64 {
    percentile(samples, 50.0)
}

/// A distribution in milliseconds, as the report shows it. Every field is `None` without
/// samples, so JSON has `null` rather than NaN.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Distribution {
    pub count: usize,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Distribution {
    /// Summarises samples in seconds, reported in milliseconds.
    pub fn from_secs(samples: &[f64]) -> Self {
        let mut v: Vec<f64> = samples
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .map(|s| s * 1e3)
            .collect();
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        Self {
            count: v.len(),
            mean: Some(v.iter().sum::<f64>() / v.len() as f64),
            p50: Some(percentile_sorted(&v, 50.0)),
            p90: Some(percentile_sorted(&v, 90.0)),
            p99: Some(percentile_sorted(&v, 99.0)),
            max: v.last().copied(),
        }
    }
}

/// Sorted values and their cumulative fractions, for CDF plots.
pub fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 10.0);
        assert!((percentile(&v, 50.0) - 5.5).abs() < 1e-12);
        assert!((percentile(&v, 90.0) - 9.1).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 9.91).abs() < 1e-12);
        let shuffled = [3.0, 1.0, 2.0];
        assert_eq!(median(&shuffled), 2.0);
        assert!(percentile(&[], 50.0).is_nan());
        assert_eq!(percentile(&[4.0], 99.0), 4.0);
    }

    #[test]
    fn distributions_report_milliseconds() {
        let d = Distribution::from_secs(&[0.010, 0.020, 0.030, f64::NAN]);
        assert_eq!(d.count, 3);
        assert!((d.mean.expect("samples") - 20.0).abs() < 1e-9);
        assert!((d.p50.expect("samples") - 20.0).abs() < 1e-9);
        assert!((d.max.expect("samples") - 30.0).abs() < 1e-9);
        assert_eq!(Distribution::from_secs(&[]), Distribution::default());
    }

    #[test]
    fn cdfs_end_at_one() {
        let c = cdf(&[3.0, 1.0, 2.0, 4.0]);
        assert_eq!(c.first(), Some(&(1.0, 0.25)));
        assert_eq!(c.last(), Some(&(4.0, 1.0)));
    }
}
