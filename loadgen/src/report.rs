//! The results: a Markdown summary for people and a JSON document for tools. Both come from
//! one [`RunReport`].

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use crate::config::{LoadConfig, LoadPlan};
use crate::error::LoadError;
use crate::goodput::ATTAINMENT_TARGET;
use crate::record::RequestRecord;
use crate::stats::Distribution;
use crate::summary::LevelSummary;
use crate::sweep::SweepResult;

#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    pub config: LoadConfig,
    /// The `model` sent with OpenAI requests, given or discovered.
    pub model: Option<String>,
    pub levels: Vec<LevelReport>,
    pub sweep: Option<SweepResult>,
    /// Set when the levels were simulated (`fission-loadtest simulate`): the cluster and
    /// cost profile simulated. The target and API in `config` then mean nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulated: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LevelReport {
    pub summary: LevelSummary,
    /// Every request, in the order sent (inter-token gaps are left out of the JSON).
    pub requests: Vec<RequestRecord>,
}

impl RunReport {
    /// The goodput: the sweep's, or for a single level its rate if it met the target.
    pub fn goodput_rps(&self) -> Option<f64> {
        match &self.sweep {
            Some(s) => s.goodput_rps,
            None => self
                .levels
                .first()
                .filter(|l| l.summary.meets_slo)
                .map(|l| l.summary.rate_rps()),
        }
    }

    pub fn write_json(&self, path: &Path) -> Result<(), LoadError> {
        let json = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, json).map_err(|source| LoadError::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn markdown(&self) -> String {
        let c = &self.config;
        let mut out = String::new();
        match &self.simulated {
            Some(cluster) => {
                let _ = writeln!(out, "## fission-loadtest simulate: {cluster}\n");
            }
            None => {
                let _ = writeln!(out, "## fission-loadtest: {}\n", c.target.endpoint());
            }
        }
        let plan = match &c.plan {
            LoadPlan::Single(shape) => shape.label(),
            LoadPlan::Sweep {
                rates,
                burstiness,
                bisect_steps,
            } => format!(
                "sweep over {:?} req/s (burstiness {burstiness}, {bisect_steps} bisection steps)",
                rates.rates()
            ),
        };
        if self.simulated.is_some() {
            let _ = writeln!(
                out,
                "- simulated: workload `{}`, load: {plan}",
                value_name(c.workload.kind),
            );
        } else {
            let _ = writeln!(
                out,
                "- API `{}`, model `{}`, workload `{}`, load: {plan}",
                value_name(c.target.api),
                self.model.as_deref().unwrap_or("(none sent)"),
                value_name(c.workload.kind),
            );
        }
        let _ = writeln!(
            out,
            "- per level: at most {:.0} s and {} requests, {:.0} s timeout per request; seed {}",
            c.bounds.duration.as_secs_f64(),
            c.bounds.max_requests,
            c.bounds.request_timeout.as_secs_f64(),
            c.seed
        );
        let _ = writeln!(
            out,
            "- SLO: TTFT ≤ {} ms and TPOT ≤ {} ms for {:.0}% of requests",
            c.slo.ttft_ms,
            c.slo.tpot_ms,
            ATTAINMENT_TARGET * 100.0
        );
        match (self.goodput_rps(), &self.sweep) {
            (Some(g), Some(s)) if s.first_miss_rps.is_none() => {
                let _ = writeln!(
                    out,
                    "- **goodput ≥ {g:.3} req/s**: every rate tried met the SLO; sweep higher"
                );
            }
            (Some(g), Some(s)) => {
                let miss = s.first_miss_rps.unwrap_or(f64::NAN);
                let _ = writeln!(
                    out,
                    "- **goodput {g:.3} req/s** (missed the SLO at {miss:.3} req/s)"
                );
            }
            (Some(g), None) => {
                let _ = writeln!(out, "- **goodput {g:.3} req/s**: this rate met the SLO");
            }
            (None, _) => {
                let _ = writeln!(out, "- **goodput: none**: no rate tried met the SLO");
            }
        }

        out.push_str("\n### Throughput and SLO attainment\n\n");
        out.push_str("| load | sent | ok | failed | offered req/s | req/s | output tok/s | in/out tokens | attainment | good req/s |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for l in &self.levels {
            let s = &l.summary;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.2} | {:.2} | {:.1} | {:.0}/{:.0} | {:.1}%{} | {:.2} |",
                s.label,
                s.requests,
                s.ok,
                s.failed,
                s.offered_rps,
                s.throughput_rps,
                s.output_tokens_per_s,
                s.mean_prompt_tokens.unwrap_or(s.mean_input_len),
                s.mean_output_tokens,
                s.slo_attainment * 100.0,
                if s.meets_slo { " ✓" } else { "" },
                s.good_rps,
            );
        }

        out.push_str("\n### Latency (ms): p50 / p90 / p99\n\n");
        out.push_str("| load | TTFT | TPOT | ITL | end-to-end |\n|---|---|---|---|---|\n");
        for l in &self.levels {
            let s = &l.summary;
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                s.label,
                triple(&s.ttft_ms),
                triple(&s.tpot_ms),
                triple(&s.itl_ms),
                triple(&s.e2e_ms)
            );
        }

        let failures: Vec<&LevelReport> = self
            .levels
            .iter()
            .filter(|l| !l.summary.errors.is_empty())
            .collect();
        if !failures.is_empty() {
            out.push_str("\n### Errors\n\n| load | errors |\n|---|---|\n");
            for l in failures {
                let list: Vec<String> = l
                    .summary
                    .errors
                    .iter()
                    .map(|(k, n)| format!("{k}: {n}"))
                    .collect();
                let _ = writeln!(out, "| {} | {} |", l.summary.label, list.join(", "));
            }
        }
        out
    }
}

/// The name the command line knows a value by (`openai-chat`, `shared-prefix`).
fn value_name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

fn triple(d: &Distribution) -> String {
    let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
    format!("{} / {} / {}", f(d.p50), f(d.p90), f(d.p99))
}
