//! gateway: Fission's HTTP front door. It takes TGI- and OpenAI-shaped requests, validates and
//! tokenizes them into a [`ValidRequest`], admits them under a concurrency limit, hands them to a
//! [`Backend`], and streams the tokens back as JSON or SSE.
//!
//! It must not touch models, KV caches or GPUs: it never depends on `engine` or `kernels`, and it
//! knows nodes only through the [`Backend`] trait. Its errors are one [`GatewayError`], mapped to
//! HTTP and SSE through `proto::ErrorCode`.

mod body_limit;
mod chat_template;
mod chat_tools;
mod generation;
mod json;
mod openai;
pub mod queue;
mod sequences;
mod service_routes;
mod sse;
mod state;
mod structured;
mod tgi;
mod validation;

pub mod auth;
pub mod backend;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod error;
pub mod fake;
pub mod metrics;
pub mod openapi;
pub mod request;
mod request_id;
pub mod server;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use backend::Backend;
pub use chat_template::ChatMessage;
pub use config::GatewayConfig;
pub use error::GatewayError;
pub use request::{
    FinishReason, GeneratedToken, RequestId, SamplingParams, StoppingParams, TokenStream,
    ValidRequest,
};
pub use server::app;
pub use state::AppState;

/// How long shutdown waits, after ending the requests left at the drain deadline, for their last
/// events to be written.
pub const ABORT_WRITE_MS: u64 = 2_000;

/// Serves the gateway on `listener` until `shutdown` is cancelled.
///
/// Installs the Prometheus recorder (once per process). On shutdown it stops accepting, lets
/// in-flight requests and streams finish for up to `config.shutdown_grace_ms`, then ends what is
/// left with an `unavailable` error (cancelling those requests upstream) and returns once their
/// responses are written, or after [`ABORT_WRITE_MS`] more.
pub async fn run(
    config: GatewayConfig,
    listener: TcpListener,
    backend: Arc<dyn Backend>,
    shutdown: CancellationToken,
) -> Result<(), GatewayError> {
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    let state = AppState::new(config, backend, metrics::install_recorder())?;
    let local_addr = listener.local_addr().map_err(GatewayError::Serve)?;
    tracing::info!(%local_addr, model_id = %state.config().model_id, "gateway listening");

    // Tokens go out as small SSE writes: with Nagle's algorithm each write after the first
    // waits for the client's delayed ACK (about 40 ms on Linux), which would set every
    // stream's TTFT and TPOT floor.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!(%error, "could not set TCP_NODELAY on a client connection");
        }
    });
    let serve = axum::serve(listener, app(state.clone()))
        .with_graceful_shutdown(shutdown.clone().cancelled_owned())
        .into_future();
    tokio::pin!(serve);
    let drain_deadline = async {
        shutdown.cancelled().await;
        tracing::info!(
            grace_ms = grace.as_millis() as u64,
            "shutting down; draining in-flight requests"
        );
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        result = &mut serve => result.map_err(GatewayError::Serve)?,
        () = drain_deadline => {
            tracing::warn!("drain deadline passed; ending in-flight requests");
            state.abort_in_flight();
            let last_writes = Duration::from_millis(ABORT_WRITE_MS);
            match tokio::time::timeout(last_writes, serve).await {
                Ok(result) => result.map_err(GatewayError::Serve)?,
                Err(_) => tracing::warn!("connections still open after the abort; leaving them"),
            }
        }
    }
    tracing::info!("gateway stopped");
    Ok(())
}
