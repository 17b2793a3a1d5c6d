//! The node's `/metrics` (Prometheus text) and `/health` endpoint.

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::NodeError;

/// Installs the global Prometheus recorder once per process and returns its handle.
pub fn install_recorder() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let buckets = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets(&buckets)
                .expect("static bucket list is non-empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed");
            }
            handle
        })
        .clone()
}

/// Serves `/metrics` and `/health` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route("/health", get(|| std::future::ready("ok")));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(|source| NodeError::Io {
            what: "metrics endpoint".into(),
            source,
        })
}
