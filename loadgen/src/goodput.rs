//! SLO attainment and goodput, as DistServe (Zhong et al., OSDI 2024) defines them: a request
//! is good when it meets both its TTFT SLO and its TPOT SLO; a rate's SLO attainment is the
//! fraction of its requests that are good; the goodput is the highest request rate whose
//! attainment is at least 90%.

use serde::Serialize;

use crate::record::RequestRecord;

/// DistServe's attainment target.
pub const ATTAINMENT_TARGET: f64 = 0.9;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// Good: it succeeded, its first token came within the TTFT SLO and its time per output
    /// token after the first is within the TPOT SLO. A one-token answer has no TPOT and is
    /// judged on TTFT alone. A failed request is never good: a server cannot raise its
    /// goodput by refusing work.
    pub fn is_good(&self, r: &RequestRecord) -> bool {
        let Some(ttft_s) = r.ttft_s else {
            return false;
        };
        r.ok() && ttft_s * 1e3 <= self.ttft_ms && r.tpot_s().is_none_or(|t| t * 1e3 <= self.tpot_ms)
    }

    /// The fraction of `records` that are good; 0 for none (no evidence is no attainment).
    pub fn attainment(&self, records: &[RequestRecord]) -> f64 {
        if records.is_empty() {
            return 0.0;
        }
        records.iter().filter(|r| self.is_good(r)).count() as f64 / records.len() as f64
    }
}

/// Whether a level with this attainment meets the target.
pub fn meets_target(attainment: f64) -> bool {
    attainment >= ATTAINMENT_TARGET
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::ErrorKind;

    fn rec(ttft_ms: f64, tpot_ms: f64, tokens: usize) -> RequestRecord {
        let ttft = ttft_ms / 1e3;
        RequestRecord {
            index: 0,
            sent_at_s: 0.0,
            input_len: 1,
            prompt_tokens: None,
            output_len: tokens,
            output_tokens: tokens,
            ttft_s: Some(ttft),
            e2e_s: ttft + tpot_ms / 1e3 * (tokens.max(1) - 1) as f64,
            itl_s: Vec::new(),
            error: None,
        }
    }

    const SLO: Slo = Slo {
        ttft_ms: 100.0,
        tpot_ms: 20.0,
    };

    #[test]
    fn good_means_both_slos() {
        assert!(SLO.is_good(&rec(99.0, 19.0, 10)));
        assert!(!SLO.is_good(&rec(101.0, 10.0, 10)));
        assert!(!SLO.is_good(&rec(50.0, 21.0, 10)));
        assert!(SLO.is_good(&rec(50.0, 1000.0, 1)), "one token: no TPOT");
        let failed = RequestRecord {
            error: Some(ErrorKind::Http { status: 429 }),
            ..rec(1.0, 1.0, 10)
        };
        assert!(!SLO.is_good(&failed));
        let no_token = RequestRecord {
            ttft_s: None,
            ..rec(1.0, 1.0, 10)
        };
        assert!(!SLO.is_good(&no_token));
    }

    #[test]
    fn attainment_counts_failures_against_the_level() {
        let mut v: Vec<RequestRecord> = (0..9).map(|_| rec(10.0, 10.0, 5)).collect();
        v.push(RequestRecord {
            error: Some(ErrorKind::Timeout),
            ..rec(10.0, 10.0, 5)
        });
        let a = SLO.attainment(&v);
        assert!((a - 0.9).abs() < 1e-12);
        assert!(meets_target(a));
        v.push(rec(500.0, 10.0, 5));
        assert!(!meets_target(SLO.attainment(&v)));
        assert_eq!(SLO.attainment(&[]), 0.0);
    }
}
