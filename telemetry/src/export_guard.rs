//! What a dead collector costs the process: one warning when export starts failing, one line
//! when it recovers, and between the two a backoff during which batches are dropped without a
//! connection attempt. Without it the SDK logs an ERROR per failed batch (one a second per
//! process) and dials the collector for every batch. An explicit flush (and the one at
//! shutdown) always tries to send, and reports its failure.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use opentelemetry_sdk::Resource;

/// The first pause after a failed export; it doubles per failure up to [`MAX_PAUSE`].
const MIN_PAUSE: Duration = Duration::from_secs(1);
/// Caps how long spans are dropped after a collector comes back.
const MAX_PAUSE: Duration = Duration::from_secs(10);

/// Set while the service flushes or shuts down: the SDK's batch processor calls the exporter's
/// plain `export` for those too, so the guard learns of them through this flag.
#[derive(Debug, Clone, Default)]
pub(crate) struct Flushing(Arc<AtomicBool>);

impl Flushing {
    pub(crate) fn set(&self, on: bool) {
        self.0.store(on, Ordering::SeqCst);
    }

    fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Wraps the real exporter; see the module docs. Outside a flush, export errors never reach
/// the SDK (which would log each one).
#[derive(Debug)]
pub(crate) struct ExportGuard<E> {
    inner: E,
    endpoint: String,
    flushing: Flushing,
    state: Mutex<Outage>,
}

/// The current outage, if any.
#[derive(Debug, Default)]
struct Outage {
    since: Option<Instant>,
    failed_batches: u64,
    dropped_spans: u64,
    pause: Duration,
    retry_at: Option<Instant>,
}

/// What one export call should do, decided under the lock and acted on outside it.
enum Plan {
    Send,
    Drop,
}

impl<E: SpanExporter> ExportGuard<E> {
    pub(crate) fn new(inner: E, endpoint: String, flushing: Flushing) -> Self {
        ExportGuard {
            inner,
            endpoint,
            flushing,
            state: Mutex::new(Outage::default()),
        }
    }

    fn plan(&self, now: Instant, spans: usize) -> Plan {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.retry_at {
            Some(at) if now < at => {
                state.dropped_spans += spans as u64;
                Plan::Drop
            }
            _ => Plan::Send,
        }
    }

    fn failed(&self, now: Instant, spans: usize, error: &dyn std::fmt::Display) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.since.is_none() {
            tracing::warn!(
                endpoint = %self.endpoint,
                %error,
                "trace export failing; spans are dropped until the collector answers"
            );
            state.since = Some(now);
            state.pause = MIN_PAUSE;
        } else {
            state.pause = (state.pause * 2).min(MAX_PAUSE);
        }
        state.failed_batches += 1;
        state.dropped_spans += spans as u64;
        state.retry_at = Some(now + state.pause);
    }

    fn succeeded(&self, now: Instant) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(since) = state.since {
            tracing::info!(
                endpoint = %self.endpoint,
                down_s = now.duration_since(since).as_secs_f64(),
                failed_batches = state.failed_batches,
                dropped_spans = state.dropped_spans,
                "trace export recovered"
            );
            *state = Outage::default();
        }
    }
}

impl<E: SpanExporter> SpanExporter for ExportGuard<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        // A flush is the last chance for these spans (at shutdown) or a caller waiting on
        // them: send through any pause.
        let flushing = self.flushing.get();
        if !flushing {
            if let Plan::Drop = self.plan(Instant::now(), spans) {
                return Ok(());
            }
        }
        match self.inner.export(batch).await {
            Ok(()) => self.succeeded(Instant::now()),
            Err(error) => {
                self.failed(Instant::now(), spans, &error);
                if flushing {
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn shutdown(&self) -> OTelSdkResult {
        self.inner.shutdown()
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    use opentelemetry_sdk::error::OTelSdkError;

    use super::*;

    /// Fails while `down` is set; counts the calls that reached it.
    #[derive(Debug, Clone, Default)]
    struct Flaky {
        down: Arc<AtomicBool>,
        calls: Arc<AtomicUsize>,
    }

    impl SpanExporter for Flaky {
        async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                Err(OTelSdkError::InternalFailure("connection refused".into()))
            } else {
                Ok(())
            }
        }
    }

    fn export(guard: &ExportGuard<Flaky>) -> OTelSdkResult {
        block_on(guard.export(Vec::new()))
    }

    /// These futures never pend; any executor will do.
    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn a_dead_collector_is_dialled_once_per_pause_and_never_reported_as_an_sdk_error() {
        let flaky = Flaky::default();
        flaky.down.store(true, Ordering::SeqCst);
        let guard = ExportGuard::new(
            flaky.clone(),
            "http://127.0.0.1:1".into(),
            Flushing::default(),
        );
        for _ in 0..20 {
            assert!(export(&guard).is_ok(), "errors stay out of the SDK's log");
        }
        // The first call failed and opened a pause of MIN_PAUSE: the other 19 were dropped.
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 1);
        let state = guard.state.lock().unwrap();
        assert_eq!(state.failed_batches, 1);
        assert_eq!(state.pause, MIN_PAUSE);
        assert!(state.since.is_some());
    }

    #[test]
    fn pauses_double_up_to_the_cap_and_reset_on_recovery() {
        let flaky = Flaky::default();
        let guard = ExportGuard::new(flaky.clone(), "x".into(), Flushing::default());
        let t0 = Instant::now();
        for i in 0..8 {
            guard.failed(t0, 10, &"refused");
            let want = (MIN_PAUSE * 2u32.pow(i)).min(MAX_PAUSE);
            assert_eq!(guard.state.lock().unwrap().pause, want, "failure {i}");
        }
        // Once the pause is over the next batch is sent; success clears the outage.
        let after = t0 + MAX_PAUSE + Duration::from_millis(1);
        assert!(matches!(guard.plan(after, 5), Plan::Send));
        assert!(matches!(guard.plan(t0, 5), Plan::Drop));
        guard.succeeded(after);
        let state = guard.state.lock().unwrap();
        assert!(state.since.is_none() && state.retry_at.is_none());
        assert_eq!((state.failed_batches, state.dropped_spans), (0, 0));
    }

    #[test]
    fn a_flush_sends_through_the_pause_and_reports_the_failure() {
        let flaky = Flaky::default();
        flaky.down.store(true, Ordering::SeqCst);
        let flushing = Flushing::default();
        let guard = ExportGuard::new(flaky.clone(), "x".into(), flushing.clone());
        export(&guard).unwrap(); // fails quietly and opens a pause
        export(&guard).unwrap(); // dropped inside the pause
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 1);
        flushing.set(true);
        assert!(export(&guard).is_err(), "a failed flush is reported");
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 2, "the flush was sent");
        flaky.down.store(false, Ordering::SeqCst);
        export(&guard).unwrap();
        assert!(guard.state.lock().unwrap().since.is_none(), "recovered");
    }

    #[test]
    fn a_live_collector_gets_every_batch() {
        let flaky = Flaky::default();
        let guard = ExportGuard::new(flaky.clone(), "x".into(), Flushing::default());
        for _ in 0..5 {
            export(&guard).unwrap();
        }
        assert_eq!(flaky.calls.load(Ordering::SeqCst), 5);
    }
}
