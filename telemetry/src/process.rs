//! The process around a service, the same for the gateway and both node roles: a
//! multi-threaded runtime, the logger and trace export, and the signals that start its
//! shutdown. Each binary's `main` and each `fission` subcommand that runs a service goes
//! through [`run_service`], so their set-up cannot drift apart.

use std::future::Future;

use tokio_util::sync::CancellationToken;

use crate::error::TelemetryError;
use crate::init::init;

/// Why a service process could not start or ended with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError<E: std::error::Error + 'static> {
    #[error(transparent)]
    Telemetry(#[from] TelemetryError),
    #[error("cannot build the async runtime: {0}")]
    Runtime(std::io::Error),
    #[error(transparent)]
    Service(E),
}

/// Builds the runtime, installs the logger (`RUST_LOG`, else `default_filter`) and trace
/// export as `service_name`, cancels the token it passes to `serve` on SIGTERM or Ctrl-C, and
/// runs `serve` to its end. The last spans are flushed before it returns.
pub fn run_service<F, Fut, E>(
    service_name: &str,
    default_filter: &str,
    otlp_endpoint: Option<String>,
    serve: F,
) -> Result<(), ProcessError<E>>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::error::Error + 'static,
{
    // Export runs on a runtime of its own; its guard is dropped (flushing the last spans)
    // after the service's runtime has stopped.
    let _telemetry = init(service_name, otlp_endpoint, default_filter)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ProcessError::Runtime)?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        spawn_signal_handler(shutdown.clone());
        serve(shutdown).await.map_err(ProcessError::Service)
    })
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
