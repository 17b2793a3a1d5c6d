//! The three original modes, kept for the scenario scripts and BENCHMARKS.md commands that
//! parse their output: `ttft`, `closed-loop` and `open-loop`. They send TGI's
//! `/generate_stream` with `<extra_N>` prompts, as before, and print the same lines; the
//! measuring underneath is the crate's shared client and driver.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::client::Client;
use crate::config::{Api, Bounds, LoadShape, Target};
use crate::driver::run_level;
use crate::error::LoadError;
use crate::goodput::Slo;
use crate::progress::Progress;
use crate::prompt::{exact_prompt, PromptStyle};
use crate::stats::{median, percentile};
use crate::workload::{RequestSpec, WorkloadConfig};

/// Settings every legacy mode shares.
#[derive(Debug, Clone)]
pub struct Legacy {
    pub url: String,
    pub first_extra_id: usize,
    pub vocab: usize,
    pub api_key: Option<String>,
}

/// The legacy modes had no per-request timeout; this one only stops a hung stream from
/// hanging the script.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);
const MAX_REQUESTS: usize = 1_000_000;

impl Legacy {
    fn client(&self) -> Result<Client, LoadError> {
        let target = Target {
            base_url: self.url.clone(),
            api: Api::Tgi,
            model: None,
            api_key: self.api_key.clone(),
        };
        Client::new(target, REQUEST_TIMEOUT)
    }

    fn workload(&self, prompt_tokens: usize, max_new_tokens: usize) -> WorkloadConfig {
        WorkloadConfig::fixed(
            prompt_tokens,
            max_new_tokens,
            PromptStyle::Extra {
                first_extra_id: self.first_extra_id,
                vocab: self.vocab,
            },
        )
    }

    fn spec(&self, num_tokens: usize, seed: usize, max_new_tokens: usize) -> RequestSpec {
        let prompt = exact_prompt(num_tokens, seed, self.first_extra_id, self.vocab);
        RequestSpec {
            index: seed as u64,
            user: prompt.clone(),
            prompt,
            system: None,
            input_len: num_tokens,
            output_len: max_new_tokens,
        }
    }

    /// Sequential requests of exact prompt lengths, after one unmeasured request per length:
    /// a CSV of TTFT and end-to-end medians.
    pub async fn ttft(
        &self,
        prompt_tokens: &[usize],
        repeats: usize,
        max_new_tokens: usize,
    ) -> Result<String, LoadError> {
        let client = self.client()?;
        let mut out = String::from("prompt_tokens,ttft_ms_median,e2e_ms_median,tokens\n");
        for (li, &n) in prompt_tokens.iter().enumerate() {
            let start = Instant::now();
            client
                .send(&self.spec(n, 1_000 + li, max_new_tokens), start)
                .await;
            let mut samples = Vec::new();
            for r in 0..repeats {
                let s = client
                    .send(&self.spec(n, li * 100 + r, max_new_tokens), start)
                    .await;
                if let Some(e) = &s.error {
                    return Err(LoadError::RequestFailed {
                        what: format!("a request of {n} prompt tokens"),
                        reason: e.label(),
                    });
                }
                samples.push(s);
            }
            let ttft: Vec<f64> = samples.iter().filter_map(|s| s.ttft_s).collect();
            let e2e: Vec<f64> = samples.iter().map(|s| s.e2e_s).collect();
            let _ = writeln!(
                out,
                "{n},{:.1},{:.1},{}",
                median(&ttft) * 1e3,
                median(&e2e) * 1e3,
                samples.first().map_or(0, |s| s.output_tokens)
            );
        }
        Ok(out)
    }

    /// `concurrency` clients for `warmup + duration`; only requests that both start and end
    /// inside the last `duration` count.
    pub async fn closed_loop(
        &self,
        concurrency: usize,
        duration: Duration,
        warmup: Duration,
        prompt_tokens: usize,
        max_new_tokens: usize,
    ) -> Result<String, LoadError> {
        let bounds = Bounds {
            duration: warmup + duration,
            max_requests: MAX_REQUESTS,
            request_timeout: REQUEST_TIMEOUT,
        };
        let run = run_level(
            &self.client()?,
            &self.workload(prompt_tokens, max_new_tokens),
            LoadShape::Closed { concurrency },
            &bounds,
            rand::random(),
            &Progress::hidden().level("", bounds.duration),
        )
        .await?;
        let (from, to) = (warmup.as_secs_f64(), (warmup + duration).as_secs_f64());
        let window: Vec<_> = run
            .records
            .iter()
            .filter(|r| r.sent_at_s >= from && r.sent_at_s + r.e2e_s <= to)
            .collect();
        let ok = window.iter().filter(|r| r.ok()).count();
        let failed = window.len() - ok;
        let tokens: usize = window
            .iter()
            .filter(|r| r.ok())
            .map(|r| r.output_tokens)
            .sum();
        let secs = duration.as_secs_f64();
        Ok(format!(
            "requests ok {ok} failed {failed} in {} s, concurrency {concurrency}\nthroughput req_per_s {:.2} tokens_per_s {:.1}\n",
            duration.as_secs(),
            ok as f64 / secs,
            tokens as f64 / secs
        ))
    }

    /// Poisson arrivals at `rate` for `duration`: TTFT/TPOT percentiles, throughput and good
    /// requests per second.
    pub async fn open_loop(
        &self,
        rate: f64,
        duration: Duration,
        prompt_tokens: usize,
        max_new_tokens: usize,
        slo: Slo,
    ) -> Result<String, LoadError> {
        let bounds = Bounds {
            duration,
            max_requests: MAX_REQUESTS,
            request_timeout: REQUEST_TIMEOUT,
        };
        let run = run_level(
            &self.client()?,
            &self.workload(prompt_tokens, max_new_tokens),
            LoadShape::Open {
                rate_rps: rate,
                burstiness: 1.0,
            },
            &bounds,
            rand::random(),
            &Progress::hidden().level("", duration),
        )
        .await?;
        let ok: Vec<_> = run.records.iter().filter(|r| r.ok()).collect();
        let ms = |v: &[f64], p| format!("{:.1}", percentile(v, p) * 1e3);
        let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
        let tpot: Vec<f64> = ok.iter().filter_map(|r| r.tpot_s()).collect();
        let good = run.records.iter().filter(|r| slo.is_good(r)).count();
        let tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "requests {} ok {} failed {}",
            run.records.len(),
            ok.len(),
            run.records.len() - ok.len()
        );
        for (name, v) in [("ttft_ms", &ttft), ("tpot_ms", &tpot)] {
            let _ = writeln!(
                out,
                "{name} p50 {} p90 {} p99 {}",
                ms(v, 50.0),
                ms(v, 90.0),
                ms(v, 99.0)
            );
        }
        let _ = writeln!(
            out,
            "throughput {:.1} tok/s, goodput {:.2} req/s (SLO ttft<={}ms tpot<={}ms)",
            tokens as f64 / run.wall_s,
            good as f64 / run.wall_s,
            slo.ttft_ms,
            slo.tpot_ms
        );
        Ok(out)
    }
}
