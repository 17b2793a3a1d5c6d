//! Prometheus histogram buckets that fit an LLM server: latencies from a millisecond (one
//! decode step of a small model) to ten minutes (a long generation queued behind others), and
//! sizes from one (a batch of one sequence) to a million (prompt tokens, blocks). Also the
//! upkeep a recorder built without the exporter's own runtime needs.

use std::time::Duration;

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// How often [`install_prometheus_recorder`]'s upkeep runs; the exporter's own default.
pub const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// Seconds: 1 ms … 10 min, about three buckets per decade.
pub fn latency_buckets_seconds() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        120.0, 300.0, 600.0,
    ]
}

/// Seconds a component adds on the request path (`*_overhead_seconds`: the gateway's time
/// before a request leaves for a node): 50 µs … 100 ms, fine enough to tell 1 ms from 2 ms.
pub fn overhead_buckets_seconds() -> Vec<f64> {
    vec![
        0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01,
        0.025, 0.05, 0.1,
    ]
}

/// Counts (batch sizes, tokens, blocks): powers of two from 1 to 2^20.
pub fn size_buckets() -> Vec<f64> {
    (0..=20).map(|p| f64::from(1u32 << p)).collect()
}

/// Bytes: powers of four from 1 KiB to 4 GiB.
fn byte_buckets() -> Vec<f64> {
    (5..=16).map(|p| 4f64.powi(p)).collect()
}

/// Bytes per second: powers of two from 1 MiB/s to 64 GiB/s (a transfer's throughput).
fn throughput_buckets() -> Vec<f64> {
    (20..=36).map(|p| 2f64.powi(p)).collect()
}

/// A builder whose histograms render as Prometheus histograms (not summaries): `*_seconds`
/// get [`latency_buckets_seconds`], `*_bytes` get byte buckets, and every other histogram
/// gets [`size_buckets`].
pub fn prometheus_builder() -> Result<PrometheusBuilder, BuildError> {
    PrometheusBuilder::new()
        .set_buckets(&size_buckets())?
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".into()),
            &latency_buckets_seconds(),
        )?
        .set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &byte_buckets())?
        // A prefix match wins over the `_seconds` suffix match.
        .set_buckets_for_metric(
            Matcher::Prefix("fission_gateway_overhead".into()),
            &overhead_buckets_seconds(),
        )?
        .set_buckets_for_metric(
            Matcher::Suffix("_bytes_per_second".into()),
            &throughput_buckets(),
        )
}

/// Installs [`prometheus_builder`]'s recorder as the global `metrics` recorder once per
/// process, with its upkeep running every [`UPKEEP_PERIOD`] (see [`spawn_upkeep`]), and returns
/// its handle (render it on `/metrics`). Later calls return the same handle.
pub fn install_prometheus_recorder() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = prometheus_builder()
                .expect("static bucket lists are non-empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            spawn_upkeep(handle.clone(), UPKEEP_PERIOD);
            handle
        })
        .clone()
}

/// Runs `handle`'s upkeep every `period` on a thread of its own, for the life of the process.
///
/// A recorder made by `build_recorder` or `install_recorder` (rather than the exporter's
/// `install`) gets no upkeep task: its histograms keep every sample until the next scrape
/// drains them, so a node nobody scrapes grows without bound. A thread, not a task, so it
/// needs no runtime and keeps running whichever runtime the caller has.
pub fn spawn_upkeep(handle: PrometheusHandle, period: Duration) -> std::thread::JoinHandle<()> {
    run_every(period, "prometheus-upkeep", move || {
        handle.run_upkeep();
        true
    })
}

/// Calls `f` every `period` on a new thread until it returns false.
fn run_every(
    period: Duration,
    name: &str,
    mut f: impl FnMut() -> bool + Send + 'static,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || loop {
            std::thread::sleep(period);
            if !f() {
                return;
            }
        })
        .expect("spawning a thread")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strictly_increasing(b: &[f64]) -> bool {
        b.windows(2).all(|w| w[0] < w[1])
    }

    #[test]
    fn buckets_span_the_ranges() {
        let l = latency_buckets_seconds();
        assert!(strictly_increasing(&l));
        assert_eq!((l[0], *l.last().unwrap()), (0.001, 600.0));
        let s = size_buckets();
        assert!(strictly_increasing(&s));
        assert_eq!((s[0], *s.last().unwrap()), (1.0, 1048576.0));
        let b = byte_buckets();
        assert!(strictly_increasing(&b));
        assert_eq!((b[0], *b.last().unwrap()), (1024.0, 4294967296.0));
    }

    #[test]
    fn run_every_repeats_until_told_to_stop() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut runs = 0;
        let thread = run_every(Duration::from_millis(5), "test-every", move || {
            runs += 1;
            tx.send(runs).is_ok() && runs < 3
        });
        let seen: Vec<i32> = rx.iter().collect();
        assert_eq!(seen, vec![1, 2, 3]);
        thread.join().unwrap();
    }

    #[test]
    fn upkeep_runs_on_its_own_thread() {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let upkeep = spawn_upkeep(recorder.handle(), Duration::from_millis(5));
        assert_eq!(upkeep.thread().name(), Some("prometheus-upkeep"));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!upkeep.is_finished(), "upkeep lives as long as the process");
    }

    #[test]
    fn histograms_render_with_the_right_buckets() {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::histogram!("fission_gateway_time_to_first_token_seconds").record(0.2);
            metrics::histogram!("fission_decode_batch_size").record(3.0);
            metrics::histogram!("fission_prefill_kv_transfer_size_bytes").record(5000.0);
        });
        let text = handle.render();
        assert!(
            text.contains("fission_gateway_time_to_first_token_seconds_bucket{le=\"600\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fission_decode_batch_size_bucket{le=\"4\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fission_prefill_kv_transfer_size_bytes_bucket{le=\"16384\"} 1"),
            "{text}"
        );
        assert!(
            !text.contains("quantile"),
            "histograms, not summaries: {text}"
        );
    }
}
