//! Least-squares fits of the linear cost model from measured step times.
//!
//! - prefill: `t = a + b * tokens + c * tokens² / 1e6`, from prompts computed in one step;
//! - decode: `t = a + b * batch + c * context_tokens`, from decode steps.
//!
//! The fit minimises the squared *relative* error, `Σ ((model - t) / t)²`, so a 1 ms step
//! counts as much as a 1 s one (step times span three orders of magnitude). Every
//! coefficient must be non-negative (no work makes a step faster); the fit tries every subset
//! of the three terms, solves each by the normal equations, and keeps the best fit whose
//! coefficients are all non-negative. With three terms that exhaustive search is an exact
//! non-negative least squares, and it copes with measurements that cannot tell two terms apart
//! (`fission bench engine` grows the context with the batch): the redundant term drops out.

use serde::Serialize;

use crate::cost::{Linear3, LinearCost};
use loadgen::error::LoadError;

/// One measurement: the step took `t_s` for work `(x, y)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    pub x: f64,
    pub y: f64,
    pub t_s: f64,
}

/// A fit and how well it matches its samples.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    pub coef: Linear3,
    /// Root mean square of the relative errors.
    pub rms_rel_error: f64,
}

/// Prefill samples from `(prompt tokens, seconds)`.
pub fn prefill_samples(points: &[(usize, f64)]) -> Vec<Sample> {
    points
        .iter()
        .map(|&(n, t_s)| Sample {
            x: n as f64,
            y: (n as f64) * (n as f64) / 1e6,
            t_s,
        })
        .collect()
}

/// Decode samples from `(batch, context tokens, seconds)`.
pub fn decode_samples(points: &[(usize, usize, f64)]) -> Vec<Sample> {
    points
        .iter()
        .map(|&(b, ctx, t_s)| Sample {
            x: b as f64,
            y: ctx as f64,
            t_s,
        })
        .collect()
}

pub fn fit_cost(
    prefill: &[Sample],
    decode: &[Sample],
) -> Result<(LinearCost, Fit, Fit), LoadError> {
    let p = fit_linear3(prefill, "prefill")?;
    let d = fit_linear3(decode, "decode")?;
    Ok((
        LinearCost {
            prefill: p.coef,
            decode: d.coef,
        },
        p,
        d,
    ))
}

/// The non-negative relative least-squares fit of `t = a + b x + c y`.
pub fn fit_linear3(samples: &[Sample], what: &'static str) -> Result<Fit, LoadError> {
    let usable: Vec<Sample> = samples
        .iter()
        .copied()
        .filter(|s| s.t_s.is_finite() && s.t_s > 0.0)
        .collect();
    if usable.is_empty() {
        return Err(LoadError::invalid(
            what,
            "needs at least one positive step time to fit",
            samples.len(),
        ));
    }
    let mut best: Option<Fit> = None;
    // Subsets of {a, b, c} as bit masks, the full model first so it wins ties.
    for mask in [0b111u8, 0b011, 0b101, 0b110, 0b001, 0b010, 0b100] {
        let cols: Vec<usize> = (0..3).filter(|i| mask & (1 << i) != 0).collect();
        if cols.len() > usable.len() {
            continue;
        }
        let Some(sol) = solve_subset(&usable, &cols) else {
            continue;
        };
        if sol.iter().any(|v| *v < 0.0) {
            continue;
        }
        let mut coef = [0.0; 3];
        for (i, &c) in cols.iter().enumerate() {
            coef[c] = sol[i];
        }
        let coef = Linear3 {
            a: coef[0],
            b: coef[1],
            c: coef[2],
        };
        let rms = rms_rel(&usable, &coef);
        if best.is_none_or(|b| rms < b.rms_rel_error * (1.0 - 1e-9)) {
            best = Some(Fit {
                coef,
                rms_rel_error: rms,
            });
        }
    }
    best.ok_or_else(|| {
        LoadError::invalid(
            what,
            "no non-negative fit: the samples are degenerate",
            usable.len(),
        )
    })
}

fn features(s: &Sample) -> [f64; 3] {
    [1.0, s.x, s.y]
}

fn rms_rel(samples: &[Sample], c: &Linear3) -> f64 {
    let sum: f64 = samples
        .iter()
        .map(|s| ((c.eval(s.x, s.y) - s.t_s) / s.t_s).powi(2))
        .sum();
    (sum / samples.len() as f64).sqrt()
}

/// Weighted normal equations over the columns `cols`, rows weighted by `1 / t`; `None` when
/// they are singular.
fn solve_subset(samples: &[Sample], cols: &[usize]) -> Option<Vec<f64>> {
    let k = cols.len();
    // Columns are scaled to unit RMS first, so tokens² next to a constant stays well
    // conditioned.
    let scale: Vec<f64> = cols
        .iter()
        .map(|&c| {
            let ms = samples
                .iter()
                .map(|s| (features(s)[c] / s.t_s).powi(2))
                .sum::<f64>()
                / samples.len() as f64;
            if ms > 0.0 {
                ms.sqrt()
            } else {
                1.0
            }
        })
        .collect();
    let mut ata = vec![vec![0.0; k]; k];
    let mut atb = vec![0.0; k];
    for s in samples {
        let f = features(s);
        let row: Vec<f64> = cols
            .iter()
            .enumerate()
            .map(|(i, &c)| f[c] / s.t_s / scale[i])
            .collect();
        for i in 0..k {
            atb[i] += row[i]; // the target t / t = 1
            for j in 0..k {
                ata[i][j] += row[i] * row[j];
            }
        }
    }
    let sol = gauss(ata, atb)?;
    Some(sol.iter().zip(&scale).map(|(v, s)| v / s).collect())
}

/// Gaussian elimination with partial pivoting; `None` for a (nearly) singular system.
fn gauss(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    let norm = a
        .iter()
        .flat_map(|r| r.iter())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= 1e-10 * norm.max(1e-300) {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let pivot_row = a[col].clone();
        for row in col + 1..n {
            let f = a[row][col] / pivot_row[col];
            for (v, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *v -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for row in (0..n).rev() {
        let s: f64 = (row + 1..n).map(|c| a[row][c] * x[c]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1e-9)
    }

    #[test]
    fn exact_points_give_back_their_coefficients() {
        let truth = Linear3 {
            a: 0.004,
            b: 2.5e-5,
            c: 0.8,
        };
        let pts: Vec<(usize, f64)> = [16, 128, 512, 1024, 2048, 4096]
            .iter()
            .map(|&n| {
                let n2 = (n * n) as f64 / 1e6;
                (n, truth.eval(n as f64, n2))
            })
            .collect();
        let fit = fit_linear3(&prefill_samples(&pts), "prefill").expect("fits");
        assert!(close(fit.coef.a, truth.a), "{:?}", fit.coef);
        assert!(close(fit.coef.b, truth.b), "{:?}", fit.coef);
        assert!(close(fit.coef.c, truth.c), "{:?}", fit.coef);
        assert!(fit.rms_rel_error < 1e-9);

        let decode = Linear3 {
            a: 0.006,
            b: 3e-5,
            c: 5e-8,
        };
        let mut pts = Vec::new();
        for b in [1usize, 4, 16, 64] {
            for ctx in [64usize, 512, 2048] {
                pts.push((b, b * ctx, decode.eval(b as f64, (b * ctx) as f64)));
            }
        }
        let fit = fit_linear3(&decode_samples(&pts), "decode").expect("fits");
        assert!(close(fit.coef.a, decode.a) && close(fit.coef.b, decode.b));
        assert!(close(fit.coef.c, decode.c), "{:?}", fit.coef);
    }

    #[test]
    fn noisy_points_fit_within_the_noise() {
        let truth = Linear3 {
            a: 0.01,
            b: 1e-4,
            c: 0.0,
        };
        // ±3% alternating noise.
        let pts: Vec<(usize, usize, f64)> = (1..=20)
            .map(|b| {
                let t = truth.eval(b as f64, 0.0) * if b % 2 == 0 { 1.03 } else { 0.97 };
                (b, 0, t)
            })
            .collect();
        let fit = fit_linear3(&decode_samples(&pts), "decode").expect("fits");
        assert!((fit.coef.a - 0.01).abs() < 0.001, "{:?}", fit.coef);
        assert!((fit.coef.b - 1e-4).abs() < 2e-5, "{:?}", fit.coef);
        assert!(fit.rms_rel_error < 0.035);
    }

    #[test]
    fn collinear_terms_drop_out_instead_of_going_negative() {
        // Context grows with the batch (64 tokens each), as in `fission bench engine`.
        let pts: Vec<(usize, usize, f64)> = [1usize, 8, 32, 64]
            .iter()
            .map(|&b| (b, 64 * b, 0.002 + 1e-4 * b as f64))
            .collect();
        let fit = fit_linear3(&decode_samples(&pts), "decode").expect("fits");
        let c = fit.coef;
        assert!(c.a >= 0.0 && c.b >= 0.0 && c.c >= 0.0, "{c:?}");
        for b in [1.0, 8.0, 64.0] {
            let t = c.eval(b, 64.0 * b);
            assert!((t - (0.002 + 1e-4 * b)).abs() < 1e-9, "{b}: {t} ({c:?})");
        }
    }

    #[test]
    fn nothing_to_fit_is_an_error() {
        assert!(fit_linear3(&[], "prefill").is_err());
        let zero = [Sample {
            x: 1.0,
            y: 1.0,
            t_s: 0.0,
        }];
        assert!(fit_linear3(&zero, "prefill").is_err());
    }
}
