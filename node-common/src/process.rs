//! Process set-up shared by the node binaries: threads, logging and signals.

use tokio_util::sync::CancellationToken;

/// Sets the thread count candle reads (it re-reads /proc/cpuinfo per op otherwise) and installs
/// the stderr logger honouring `RUST_LOG`, plus OTLP trace export as `service_name` when an
/// endpoint is configured (the argument or `OTEL_EXPORTER_OTLP_ENDPOINT`). Keep the guard until
/// exit: dropping it flushes the last spans, within a bound.
pub fn init_process(
    service_name: &str,
    default_filter: &str,
    otlp_endpoint: Option<String>,
) -> Result<telemetry::TelemetryGuard, telemetry::TelemetryError> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    telemetry::init(service_name, otlp_endpoint, default_filter)
}

/// Cancels `shutdown` on SIGTERM or Ctrl-C.
pub fn spawn_signal_handler(shutdown: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot listen for SIGTERM");
                        let _ = ctrl_c.await;
                        shutdown.cancel();
                        return;
                    }
                };
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
        tracing::info!("shutdown signal received");
        shutdown.cancel();
    });
}
