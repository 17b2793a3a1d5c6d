//! One load level's numbers, from its request records: latency distributions, throughput,
//! errors by kind and SLO attainment.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::config::LoadShape;
use crate::goodput::{meets_target, Slo};
use crate::record::RequestRecord;
use crate::stats::Distribution;

#[derive(Debug, Clone, Serialize)]
pub struct LevelSummary {
    pub label: String,
    pub shape: LoadShape,
    pub requests: usize,
    pub ok: usize,
    pub failed: usize,
    /// Failures by [`crate::record::ErrorKind::label`].
    pub errors: BTreeMap<String, usize>,
    /// From the level's start to its last send, and to its last answer.
    pub send_window_s: f64,
    pub wall_s: f64,
    /// Requests sent per second of the send window: the rate the server was offered, which
    /// for a closed loop is what the server let it reach.
    pub offered_rps: f64,
    /// Successful requests and their output tokens per second of wall time.
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Means over all requests of the tokens asked, and, over successful ones, of the prompt
    /// tokens the server counted (when it said) and of the output tokens received.
    pub mean_input_len: f64,
    pub mean_prompt_tokens: Option<f64>,
    pub mean_output_len: f64,
    pub mean_output_tokens: f64,
    pub ttft_ms: Distribution,
    pub tpot_ms: Distribution,
    pub itl_ms: Distribution,
    pub e2e_ms: Distribution,
    pub good: usize,
    pub slo_attainment: f64,
    /// Good requests per second of wall time (vLLM's "goodput").
    pub good_rps: f64,
    /// At least 90% good: DistServe counts this level's rate towards the goodput.
    pub meets_slo: bool,
}

impl LevelSummary {
    pub fn new(
        shape: LoadShape,
        records: &[RequestRecord],
        send_window_s: f64,
        wall_s: f64,
        slo: &Slo,
    ) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let mut errors = BTreeMap::new();
        for e in records.iter().filter_map(|r| r.error.as_ref()) {
            *errors.entry(e.label()).or_insert(0) += 1;
        }
        let collect = |f: &dyn Fn(&RequestRecord) -> Option<f64>| -> Vec<f64> {
            ok.iter().filter_map(|r| f(r)).collect()
        };
        let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let prompt_tokens = collect(&|r: &RequestRecord| r.prompt_tokens.map(|n| n as f64));
        let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let good = records.iter().filter(|r| slo.is_good(r)).count();
        let per_s = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
        let slo_attainment = slo.attainment(records);
        Self {
            label: shape.label(),
            shape,
            requests: records.len(),
            ok: ok.len(),
            failed: records.len() - ok.len(),
            errors,
            send_window_s,
            wall_s,
            offered_rps: per_s(records.len() as f64, send_window_s),
            throughput_rps: per_s(ok.len() as f64, wall_s),
            output_tokens_per_s: per_s(output_tokens as f64, wall_s),
            mean_input_len: mean(
                &records
                    .iter()
                    .map(|r| r.input_len as f64)
                    .collect::<Vec<_>>(),
            )
            .unwrap_or(0.0),
            mean_prompt_tokens: mean(&prompt_tokens),
            mean_output_len: mean(
                &records
                    .iter()
                    .map(|r| r.output_len as f64)
                    .collect::<Vec<_>>(),
            )
            .unwrap_or(0.0),
            mean_output_tokens: mean(&collect(&|r: &RequestRecord| Some(r.output_tokens as f64)))
                .unwrap_or(0.0),
            ttft_ms: Distribution::from_secs(&collect(&|r: &RequestRecord| r.ttft_s)),
            tpot_ms: Distribution::from_secs(&collect(&|r: &RequestRecord| r.tpot_s())),
            itl_ms: Distribution::from_secs(&itl),
            e2e_ms: Distribution::from_secs(&collect(&|r: &RequestRecord| Some(r.e2e_s))),
            good,
            slo_attainment,
            good_rps: per_s(good as f64, wall_s),
            meets_slo: meets_target(slo_attainment),
        }
    }

    /// The rate this level stands for on a goodput axis: the asked rate for an open loop
    /// (what DistServe sweeps), the offered rate for a closed one.
    pub fn rate_rps(&self) -> f64 {
        match self.shape {
            LoadShape::Open { rate_rps, .. } => rate_rps,
            LoadShape::Closed { .. } => self.offered_rps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::ErrorKind;

    fn rec(i: u64, ttft_s: f64, e2e_s: f64, tokens: usize) -> RequestRecord {
        RequestRecord {
            index: i,
            sent_at_s: i as f64,
            input_len: 10,
            prompt_tokens: Some(11),
            output_len: 4,
            output_tokens: tokens,
            ttft_s: Some(ttft_s),
            e2e_s,
            itl_s: vec![(e2e_s - ttft_s) / 3.0; 3],
            error: None,
        }
    }

    #[test]
    fn a_level_summarises_its_records() {
        let mut v = vec![
            rec(0, 0.1, 0.4, 4),
            rec(1, 0.2, 0.5, 4),
            rec(2, 0.3, 0.6, 4),
        ];
        v.push(RequestRecord {
            error: Some(ErrorKind::Http { status: 429 }),
            ttft_s: None,
            output_tokens: 0,
            ..rec(3, 0.0, 0.01, 0)
        });
        let slo = Slo {
            ttft_ms: 250.0,
            tpot_ms: 150.0,
        };
        let shape = LoadShape::Open {
            rate_rps: 2.0,
            burstiness: 1.0,
        };
        let s = LevelSummary::new(shape, &v, 2.0, 4.0, &slo);
        assert_eq!((s.requests, s.ok, s.failed, s.good), (4, 3, 1, 2));
        assert_eq!(s.errors.get("http_429"), Some(&1));
        assert!((s.offered_rps - 2.0).abs() < 1e-12);
        assert!((s.throughput_rps - 0.75).abs() < 1e-12);
        assert!((s.output_tokens_per_s - 3.0).abs() < 1e-12);
        assert!((s.slo_attainment - 0.5).abs() < 1e-12);
        assert!(!s.meets_slo);
        assert!((s.ttft_ms.p50.expect("ok requests") - 200.0).abs() < 1e-9);
        assert!((s.tpot_ms.p50.expect("ok requests") - 100.0).abs() < 1e-9);
        assert_eq!(s.itl_ms.count, 9);
        assert_eq!(s.mean_prompt_tokens, Some(11.0));
        assert_eq!(s.rate_rps(), 2.0);
    }
}
