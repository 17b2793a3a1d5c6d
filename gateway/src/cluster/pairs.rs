//! Failure accounting per prefill→decode pair. Two healthy nodes can still fail together: the
//! prefill node's KV push may not reach the decode node's address at all (a socket bound to
//! the wrong interface, a firewall between two hosts), while each node serves every other
//! peer. Node health cannot see that, and a request then spends every prefill attempt on the
//! pair before the decode node prefills it itself (42 failed attempts in one held-out run).
//!
//! After [`PairConfig::failures_to_mark`] consecutive failed attempts on a pair, the pair is
//! bad for [`PairConfig::cool_off`]: prompts for that decode node go to another prefill node,
//! or are prefilled on the decode node itself. After the cool-off one attempt is let through
//! (half-open): a success clears the pair, a failure marks it bad again at once. A node that
//! leaves the pool takes its pairs with it.
//!
//! Metrics: `fission_gateway_pair_failures_total{prefill_node, decode_node}` and the gauge
//! `fission_gateway_bad_pairs`; `/info` lists the bad pairs under `backend.bad_pairs`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::discovery::Role;

pub(crate) const PAIR_FAILURES_TOTAL: &str = "fission_gateway_pair_failures_total";
pub(crate) const BAD_PAIRS: &str = "fission_gateway_bad_pairs";

/// When a pair counts as bad, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct PairConfig {
    /// Consecutive failed prefill attempts on a pair that mark it bad.
    pub failures_to_mark: u32,
    /// How long a bad pair gets no prompt.
    pub cool_off: Duration,
}

impl Default for PairConfig {
    fn default() -> Self {
        // Three is one request's worth of attempts (`MAX_PREFILL_ATTEMPTS`): the request that
        // finds a broken pair marks it, and the next ones avoid it.
        PairConfig {
            failures_to_mark: 3,
            cool_off: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Default)]
struct PairState {
    consecutive: u32,
    failures_total: u64,
    bad_until: Option<Instant>,
    last_error: String,
}

impl PairState {
    fn is_bad(&self, now: Instant) -> bool {
        self.bad_until.is_some_and(|t| now < t)
    }
}

/// A bad pair as `/info` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BadPair {
    pub prefill_node: String,
    pub decode_node: String,
    pub consecutive_failures: u32,
    pub failures_total: u64,
    /// How much longer the pair gets no prompt.
    pub cool_off_left_ms: u64,
    pub last_error: String,
}

type PairKey = (String, String);

/// Every pair's record; shared by the pools' users behind an `Arc`.
#[derive(Debug, Default)]
pub struct Pairs {
    config: PairConfig,
    pairs: Arc<Mutex<HashMap<PairKey, PairState>>>,
}

impl Pairs {
    pub fn new(config: PairConfig) -> Self {
        let pairs = Pairs {
            config,
            pairs: Arc::default(),
        };
        // On /metrics from the start: a gauge that appears only once a pair fails cannot
        // be told from a gateway that does not count pairs.
        pairs.publish();
        pairs
    }

    pub fn config(&self) -> PairConfig {
        self.config
    }

    /// A prefill attempt on the pair failed for `why`. True when this marked the pair bad.
    pub fn failed(&self, prefill_node: &str, decode_node: &str, why: &str) -> bool {
        metrics::counter!(PAIR_FAILURES_TOTAL, "prefill_node" => prefill_node.to_string(), "decode_node" => decode_node.to_string())
            .increment(1);
        let now = Instant::now();
        let marked = {
            let mut pairs = self.lock();
            let p = pairs
                .entry((prefill_node.to_string(), decode_node.to_string()))
                .or_default();
            p.consecutive = p.consecutive.saturating_add(1);
            p.failures_total += 1;
            p.last_error = why.to_string();
            // Already bad: the attempt was in flight before the mark; the cool-off stands.
            let mark = !p.is_bad(now) && p.consecutive >= self.config.failures_to_mark;
            if mark {
                p.bad_until = Some(now + self.config.cool_off);
            }
            mark
        };
        if marked {
            tracing::warn!(
                prefill_node,
                decode_node,
                failures = self.config.failures_to_mark,
                cool_off_ms = self.config.cool_off.as_millis() as u64,
                why,
                "prefill/decode pair keeps failing; routing around it for a while"
            );
            self.publish();
            // The gauge falls when the cool-off ends, whether or not a request asks by then.
            let (pairs, cool_off) = (Arc::clone(&self.pairs), self.config.cool_off);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    tokio::time::sleep(cool_off).await;
                    publish(&pairs);
                });
            }
        }
        marked
    }

    /// A push on the pair went through: its failures so far were not the pair's.
    pub fn succeeded(&self, prefill_node: &str, decode_node: &str) {
        let was_bad = {
            let mut pairs = self.lock();
            let key = (prefill_node.to_string(), decode_node.to_string());
            match pairs.get_mut(&key) {
                Some(p) => {
                    let was_bad = p.bad_until.is_some();
                    p.consecutive = 0;
                    p.bad_until = None;
                    was_bad
                }
                None => false,
            }
        };
        if was_bad {
            tracing::info!(
                prefill_node,
                decode_node,
                "prefill/decode pair pushed again"
            );
            self.publish();
        }
    }

    pub fn is_bad(&self, prefill_node: &str, decode_node: &str) -> bool {
        let key = (prefill_node.to_string(), decode_node.to_string());
        self.lock()
            .get(&key)
            .is_some_and(|p| p.is_bad(Instant::now()))
    }

    /// The pairs in their cool-off, by prefill then decode node.
    pub fn bad_pairs(&self) -> Vec<BadPair> {
        let now = Instant::now();
        let mut bad: Vec<BadPair> = self
            .lock()
            .iter()
            .filter(|(_, p)| p.is_bad(now))
            .map(|((prefill, decode), p)| BadPair {
                prefill_node: prefill.clone(),
                decode_node: decode.clone(),
                consecutive_failures: p.consecutive,
                failures_total: p.failures_total,
                cool_off_left_ms: p
                    .bad_until
                    .map_or(0, |t| t.saturating_duration_since(now).as_millis() as u64),
                last_error: p.last_error.clone(),
            })
            .collect();
        bad.sort_by(|a, b| {
            (&a.prefill_node, &a.decode_node).cmp(&(&b.prefill_node, &b.decode_node))
        });
        bad
    }

    /// Drops every pair of a node that left the pool: a node that comes back under the same
    /// id is another process, with a clean record.
    pub fn forget(&self, role: Role, node_id: &str) {
        self.lock().retain(|(prefill, decode), _| match role {
            Role::Prefill => prefill != node_id,
            Role::Decode => decode != node_id,
        });
        self.publish();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PairKey, PairState>> {
        self.pairs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(&self) {
        publish(&self.pairs);
    }
}

/// Sets the bad-pairs gauge from the records.
fn publish(pairs: &Mutex<HashMap<PairKey, PairState>>) {
    let now = Instant::now();
    let bad = pairs
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .values()
        .filter(|p| p.is_bad(now))
        .count();
    metrics::gauge!(BAD_PAIRS).set(bad as f64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(cool_off: Duration) -> Pairs {
        Pairs::new(PairConfig {
            failures_to_mark: 3,
            cool_off,
        })
    }

    #[test]
    fn a_pair_is_bad_after_consecutive_failures_only() {
        let p = pairs(Duration::from_secs(60));
        assert!(!p.failed("p0", "d0", "push failed"));
        assert!(!p.failed("p0", "d0", "push failed"));
        p.succeeded("p0", "d0");
        assert!(!p.failed("p0", "d0", "push failed"));
        assert!(!p.failed("p0", "d0", "push failed"));
        assert!(
            !p.is_bad("p0", "d0"),
            "a success in between resets the count"
        );
        assert!(p.failed("p0", "d0", "connect: Invalid argument"));
        assert!(p.is_bad("p0", "d0"));
        assert!(!p.is_bad("p1", "d0"), "other pairs are untouched");
        assert!(!p.is_bad("p0", "d1"));
        let bad = p.bad_pairs();
        assert_eq!(bad.len(), 1);
        assert_eq!(
            (bad[0].prefill_node.as_str(), bad[0].decode_node.as_str()),
            ("p0", "d0")
        );
        assert_eq!(bad[0].consecutive_failures, 3);
        assert_eq!(bad[0].failures_total, 5);
        assert_eq!(bad[0].last_error, "connect: Invalid argument");
        assert!(bad[0].cool_off_left_ms > 50_000, "{bad:?}");
        // Failures of attempts already in flight do not extend the cool-off.
        assert!(!p.failed("p0", "d0", "push failed"));
    }

    #[test]
    fn after_the_cool_off_one_failure_marks_the_pair_again_and_a_push_clears_it() {
        let p = pairs(Duration::from_millis(50));
        for _ in 0..3 {
            p.failed("p0", "d0", "push failed");
        }
        assert!(p.is_bad("p0", "d0"));
        testkit::wait_until("the cool-off ends", Duration::from_secs(5), || {
            !p.is_bad("p0", "d0")
        });
        assert!(p.bad_pairs().is_empty());
        assert!(
            p.failed("p0", "d0", "push failed"),
            "half-open: one failure"
        );
        testkit::wait_until("the cool-off ends", Duration::from_secs(5), || {
            !p.is_bad("p0", "d0")
        });
        p.succeeded("p0", "d0");
        assert!(!p.failed("p0", "d0", "push failed"), "the count restarted");
    }

    #[test]
    fn failures_and_bad_pairs_render_on_metrics() {
        let recorder = telemetry::prometheus_builder()
            .expect("static buckets")
            .build_recorder();
        let handle = recorder.handle();
        ::metrics::with_local_recorder(&recorder, || {
            let p = pairs(Duration::from_secs(60));
            for _ in 0..3 {
                p.failed("prefill-0", "decode-1", "push failed");
            }
            p.failed("prefill-1", "decode-1", "push failed");
        });
        let text = handle.render();
        for line in [
            r#"fission_gateway_pair_failures_total{prefill_node="prefill-0",decode_node="decode-1"} 3"#,
            r#"fission_gateway_pair_failures_total{prefill_node="prefill-1",decode_node="decode-1"} 1"#,
            "fission_gateway_bad_pairs 1",
        ] {
            assert!(text.contains(line), "{line}:\n{text}");
        }
    }

    #[test]
    fn a_node_that_leaves_takes_its_pairs_with_it() {
        let p = pairs(Duration::from_secs(60));
        for (prefill, decode) in [("p0", "d0"), ("p1", "d0"), ("p0", "d1")] {
            for _ in 0..3 {
                p.failed(prefill, decode, "push failed");
            }
        }
        assert_eq!(p.bad_pairs().len(), 3);
        p.forget(Role::Decode, "d0");
        let left: Vec<_> = p
            .bad_pairs()
            .into_iter()
            .map(|b| (b.prefill_node, b.decode_node))
            .collect();
        assert_eq!(left, [("p0".to_string(), "d1".to_string())]);
        p.forget(Role::Prefill, "p0");
        assert!(p.bad_pairs().is_empty());
    }
}
