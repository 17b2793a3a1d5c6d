//! The node's `/metrics` (Prometheus text) and `/health` endpoint.

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::NodeError;
use crate::etcd_status::EtcdStatus;

/// Installs the global Prometheus recorder once per process and returns its handle, with
/// buckets that fit LLM latencies (see [`telemetry::prometheus_builder`]).
pub fn install_recorder() -> PrometheusHandle {
    telemetry::install_prometheus_recorder()
}

/// Serves `/metrics` and `/health` until `shutdown`. `/health` is JSON that says whether the
/// node is in etcd (see [`EtcdStatus`] for why it stays 200 when it is not).
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    etcd: EtcdStatus,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let app = Router::new()
        .route("/metrics", get(move || std::future::ready(handle.render())))
        .route(
            "/health",
            get(move || {
                std::future::ready((
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    etcd.health_json(),
                ))
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .map_err(|source| NodeError::Io {
            what: "metrics endpoint".into(),
            source,
        })
}
