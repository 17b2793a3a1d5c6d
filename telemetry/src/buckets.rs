//! Prometheus histogram buckets that fit an LLM server: latencies from a millisecond (one
//! decode step of a small model) to ten minutes (a long generation queued behind others), and
//! sizes from one (a batch of one sequence) to a million (prompt tokens, blocks).

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

/// Seconds: 1 ms … 10 min, about three buckets per decade.
pub fn latency_buckets_seconds() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        120.0, 300.0, 600.0,
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
        .set_buckets_for_metric(
            Matcher::Suffix("_bytes_per_second".into()),
            &throughput_buckets(),
        )
}

/// Installs [`prometheus_builder`]'s recorder as the global `metrics` recorder once per
/// process and returns its handle (render it on `/metrics`). Later calls return the same
/// handle.
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
            handle
        })
        .clone()
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
