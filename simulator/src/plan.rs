//! Capacity planning: for each GPU count N, the P:D split with the highest goodput, against
//! N colocated nodes on the same GPUs (DistServe's comparison, Zhong et al., OSDI 2024).
//!
//! Every split `P + D = N` (P, D ≥ 1) is searched. A goodput is found by simulated levels at
//! one seed (so attainment falls as the rate rises, the arrival times scaling with `1 / rate`):
//! double the rate until a level misses 90% attainment, then bisect until the bracket is within
//! `precision` of its top. Levels stop as soon as they cannot meet the SLO. Splits are tried
//! nearest first to the best split so far, starting from the one the cost model suggests
//! (prefill GPU-seconds against decode GPU-seconds per request), and a later split is first
//! tried just above the best goodput so far: one level tells whether it can beat it, so the
//! search stays exhaustive at about one level per split once the top is found.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::cluster::{GatewaySettings, NodeSettings, SimCluster, Topology};
use crate::cost::{CostModel, StepWork};
use crate::level::simulate_level;
use loadgen::config::{Bounds, LoadShape};
use loadgen::error::LoadError;
use loadgen::goodput::{Slo, ATTAINMENT_TARGET};
use loadgen::workload::WorkloadConfig;

#[derive(Debug, Clone, Serialize)]
pub struct PlanConfig {
    #[serde(skip)]
    pub cost: CostModel,
    pub profile: String,
    pub node: NodeSettings,
    pub gateway: GatewaySettings,
    pub gpus: Vec<usize>,
    pub workload: WorkloadConfig,
    pub burstiness: f64,
    pub bounds: Bounds,
    pub slo: Slo,
    pub seed: u64,
    /// Bisection stops once the bracket is within this fraction of its top (0.02: 2%).
    pub precision: f64,
}

/// One GPU count's answer.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRow {
    pub gpus: usize,
    /// The best split and its goodput; `None` when no split met the SLO at any rate tried.
    pub prefill: Option<usize>,
    pub decode: Option<usize>,
    pub disaggregated_rps: Option<f64>,
    pub colocated_rps: Option<f64>,
    /// Every split's goodput where it was measured to beat the best before it (else `None`:
    /// it could not, at the rate tried).
    pub splits: Vec<(usize, usize, Option<f64>)>,
    pub levels: usize,
}

impl PlanRow {
    pub fn ratio(&self) -> Option<f64> {
        match (self.disaggregated_rps, self.colocated_rps) {
            (Some(d), Some(c)) if c > 0.0 => Some(d / c),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub config: PlanConfig,
    pub rows: Vec<PlanRow>,
    pub elapsed_s: f64,
}

struct Planner<'a> {
    config: &'a PlanConfig,
    levels: usize,
}

impl Planner<'_> {
    fn cluster(&self, topology: Topology) -> SimCluster {
        let mut c = SimCluster::new(topology, self.config.cost.clone());
        c.node = self.config.node.clone();
        c.gateway = self.config.gateway.clone();
        c
    }

    fn meets(&mut self, cluster: &SimCluster, rate_rps: f64) -> Result<bool, LoadError> {
        self.levels += 1;
        let shape = LoadShape::Open {
            rate_rps,
            burstiness: self.config.burstiness,
        };
        let c = self.config;
        let l = simulate_level(cluster, &c.workload, shape, &c.bounds, &c.slo, c.seed, true)?;
        Ok(l.report.summary.meets_slo)
    }

    /// The goodput of `topology`, starting from `start_rps`; with `beat`, `None` unless it
    /// meets the SLO above `beat`.
    fn goodput(
        &mut self,
        topology: Topology,
        start_rps: f64,
        beat: Option<f64>,
    ) -> Result<Option<f64>, LoadError> {
        let cluster = self.cluster(topology);
        let p = self.config.precision;
        let (mut lo, mut hi) = (None, None);
        match beat {
            Some(b) => {
                let r = b * (1.0 + p);
                if !self.meets(&cluster, r)? {
                    return Ok(None);
                }
                lo = Some(r);
            }
            None => {
                if self.meets(&cluster, start_rps)? {
                    lo = Some(start_rps);
                } else {
                    hi = Some(start_rps);
                }
            }
        }
        // Bracket: grow up to a miss, or halve down to a hit (bounded either way). Above a
        // goodput to beat, neighbouring splits differ by tens of percent, not by 2×.
        let grow = if beat.is_some() { 1.25 } else { 2.0 };
        for _ in 0..24 {
            match (lo, hi) {
                (Some(l), None) => {
                    let r = l * grow;
                    if self.meets(&cluster, r)? {
                        lo = Some(r);
                    } else {
                        hi = Some(r);
                    }
                }
                (None, Some(h)) => {
                    let r = h / 2.0;
                    if self.meets(&cluster, r)? {
                        lo = Some(r);
                    } else {
                        hi = Some(r);
                    }
                }
                _ => break,
            }
        }
        let (Some(mut l), Some(mut h)) = (lo, hi) else {
            return Ok(lo);
        };
        while h - l > p * h {
            let mid = (l + h) / 2.0;
            if self.meets(&cluster, mid)? {
                l = mid;
            } else {
                h = mid;
            }
        }
        Ok(Some(l))
    }
}

/// The share of GPUs the cost model suggests for prefill, from each role's capacity for the
/// workload's mean lengths: a prefill node computing full batches of
/// `max_batch_prefill_tokens` at 80% load (headroom for the TTFT SLO's queueing), against a
/// decode node at the largest batch whose step fits the TPOT SLO. Only the search's starting
/// point: the simulation decides.
pub fn suggested_prefill_share(config: &PlanConfig) -> f64 {
    let Ok(mut sampler) = config.workload.sampler(config.seed) else {
        return 0.5;
    };
    let n = 2000;
    let (mut input, mut output) = (0.0, 0.0);
    for _ in 0..n {
        let p = sampler.next_plan();
        input += p.input_len as f64;
        output += p.output_len as f64;
    }
    let (input, output) = (input / n as f64, output / n as f64);
    let cost = &config.cost;
    let batch_tokens = config.node.max_batch_prefill_tokens;
    let prefill_rps = 0.8 * batch_tokens as f64 / cost.prefill_s(batch_tokens) / input;
    let ctx = (input + output / 2.0) as usize;
    let tpot_s = config.slo.tpot_ms / 1e3;
    let batch = (1..=config.node.max_num_seqs)
        .rev()
        .find(|&b| cost.step_s(&StepWork::decode(b, b * ctx)) <= tpot_s)
        .unwrap_or(1);
    let decode_rps = batch as f64 / cost.step_s(&StepWork::decode(batch, batch * ctx)) / output;
    let (p, d) = (1.0 / prefill_rps, 1.0 / decode_rps);
    if (p / (p + d)).is_finite() {
        p / (p + d)
    } else {
        0.5
    }
}

pub fn plan(config: &PlanConfig) -> Result<PlanReport, LoadError> {
    if config.gpus.iter().any(|&n| n < 2) {
        return Err(LoadError::invalid(
            "gpus",
            "a disaggregated cluster needs at least 2 GPUs",
            format!("{:?}", config.gpus),
        ));
    }
    config.workload.lengths()?;
    let started = Instant::now();
    let share = suggested_prefill_share(config);
    let mut rows = Vec::new();
    // Per-GPU goodput of the last count, to start the next count's searches near it.
    let mut per_gpu_guess = 1.0;
    for &n in &config.gpus {
        let mut planner = Planner { config, levels: 0 };
        let p0 = ((n as f64 * share).round() as usize).clamp(1, n - 1);
        let mut untried: Vec<usize> = (1..n).collect();
        let mut best: Option<(usize, f64)> = None;
        let mut splits = Vec::new();
        // Nearest first to the best split so far (to p0 before there is one): a hill climb
        // that finds the top early, so every split after it takes one level to rule out.
        while !untried.is_empty() {
            let centre = best.map_or(p0, |b| b.0);
            let k = (0..untried.len())
                .min_by_key(|&k| (untried[k].abs_diff(centre), untried[k]))
                .expect("not empty");
            let p = untried.swap_remove(k);
            let topology = Topology::Disaggregated {
                prefill: p,
                decode: n - p,
            };
            let g = planner.goodput(topology, per_gpu_guess * n as f64, best.map(|b| b.1))?;
            if let Some(g) = g {
                best = Some((p, g));
            }
            splits.push((p, n - p, g));
        }
        splits.sort_by_key(|s| s.0);
        let start = best.map_or(per_gpu_guess * n as f64, |b| b.1);
        let colocated = planner.goodput(Topology::Colocated { nodes: n }, start, None)?;
        if let Some(g) = best.map(|b| b.1).or(colocated) {
            per_gpu_guess = g / n as f64;
        }
        rows.push(PlanRow {
            gpus: n,
            prefill: best.map(|b| b.0),
            decode: best.map(|b| n - b.0),
            disaggregated_rps: best.map(|b| b.1),
            colocated_rps: colocated,
            splits,
            levels: planner.levels,
        });
    }
    Ok(PlanReport {
        config: config.clone(),
        rows,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

impl PlanReport {
    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut out = String::new();
        let _ = writeln!(out, "## fission-loadtest simulate plan: {}\n", c.profile);
        let means = match (c.workload.input_len, c.workload.output_len) {
            (Some(i), Some(o)) => format!(" (input {i}, output {o})"),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "- workload `{}`{means}, burstiness {}, {:.0} s per level, seed {}",
            clap::ValueEnum::to_possible_value(&c.workload.kind)
                .map_or_else(String::new, |v| v.get_name().to_string()),
            c.burstiness,
            c.bounds.duration.as_secs_f64(),
            c.seed
        );
        let _ = writeln!(
            out,
            "- SLO: TTFT ≤ {} ms and TPOT ≤ {} ms for {:.0}% of requests; goodput within {:.0}%",
            c.slo.ttft_ms,
            c.slo.tpot_ms,
            ATTAINMENT_TARGET * 100.0,
            c.precision * 100.0
        );
        let _ = writeln!(
            out,
            "- routing `{}`, every P+D=N split searched; planned in {:.1} s\n",
            c.gateway.routing.as_str(),
            self.elapsed_s
        );
        out.push_str("| GPUs | best P:D | disaggregated goodput (req/s) | per GPU | colocated goodput (req/s) | per GPU | disaggregated ÷ colocated |\n");
        out.push_str("|---:|:---:|---:|---:|---:|---:|---:|\n");
        let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        for r in &self.rows {
            let n = r.gpus as f64;
            let split = match (r.prefill, r.decode) {
                (Some(p), Some(d)) => format!("{p}:{d}"),
                _ => "-".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {split} | {} | {} | {} | {} | {} |",
                r.gpus,
                f(r.disaggregated_rps),
                f(r.disaggregated_rps.map(|g| g / n)),
                f(r.colocated_rps),
                f(r.colocated_rps.map(|g| g / n)),
                r.ratio().map_or("-".into(), |x| format!("{x:.2}×")),
            );
        }
        out
    }

    pub fn write_json(&self, path: &Path) -> Result<(), LoadError> {
        let json = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, json).map_err(|source| LoadError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// `plan_goodput_per_gpu.svg` and `plan_goodput.svg` in `dir`.
    pub fn write_plots(&self, dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
        std::fs::create_dir_all(dir).map_err(|source| LoadError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let series = |per_gpu: bool, f: fn(&PlanRow) -> Option<f64>| -> Vec<(f64, f64)> {
            self.rows
                .iter()
                .filter_map(|r| {
                    let scale = if per_gpu { r.gpus as f64 } else { 1.0 };
                    f(r).map(|g| (r.gpus as f64, g / scale))
                })
                .collect()
        };
        let disagg = |r: &PlanRow| r.disaggregated_rps;
        let coloc = |r: &PlanRow| r.colocated_rps;
        let per_gpu = dir.join("plan_goodput_per_gpu.svg");
        loadgen::plot::gpu_plot(
            &per_gpu,
            "Goodput per GPU: best P:D against colocated",
            "goodput per GPU (req/s)",
            vec![
                ("disaggregated (best P:D)", series(true, disagg)),
                ("colocated", series(true, coloc)),
            ],
        )?;
        let total = dir.join("plan_goodput.svg");
        loadgen::plot::gpu_plot(
            &total,
            "Goodput: best P:D against colocated",
            "goodput (req/s)",
            vec![
                ("disaggregated (best P:D)", series(false, disagg)),
                ("colocated", series(false, coloc)),
            ],
        )?;
        Ok(vec![per_gpu, total])
    }
}
