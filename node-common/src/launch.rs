//! A node process's entry, one for both roles and both ways of starting one: `fission-prefill`,
//! `fission-decode` and `fission node prefill|decode|start` all parse [`NodeCli`] and call
//! [`launch`], so their flags, logging and signals cannot drift apart.

use std::future::Future;
use std::io::Write;

use clap::Args;
use cluster::Role;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::NodeError;
use crate::node::NodeListeners;

/// Target of events that belong in a trace but not in the log (one per layer per request):
/// [`LOG_FILTER`] turns it off, while the trace filter (`info` by default) keeps it.
pub const TRACE_EVENTS_TARGET: &str = "fission_trace_events";

/// Every node's log filter when `RUST_LOG` is unset.
pub const LOG_FILTER: &str = "info,fission_trace_events=off";

/// Where a node listens. Unset, each role has its own default ports, so one prefill and one
/// decode node can run side by side with no flags.
#[derive(Args, Debug, Clone, Default)]
pub struct ListenArgs {
    /// gRPC `host:port` [default: 127.0.0.1:7000 for prefill, 127.0.0.1:7100 for decode].
    #[arg(long, env = "FISSION_GRPC_ADDR")]
    pub grpc_addr: Option<String>,
    /// `/metrics` and `/health` `host:port` [default: 127.0.0.1:9000 for prefill,
    /// 127.0.0.1:9100 for decode].
    #[arg(long, env = "FISSION_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
}

/// Every node's command line: its role's config, where it listens, and trace export.
#[derive(Args, Debug, Clone)]
pub struct NodeCli<C: Args> {
    #[command(flatten)]
    pub config: C,
    #[command(flatten)]
    pub listen: ListenArgs,
    #[command(flatten)]
    pub telemetry: telemetry::TelemetryArgs,
}

/// A node role as a process: its config and its service's `run`.
pub trait NodeRole {
    type Config: Args + Send + 'static;
    const ROLE: Role;
    const DEFAULT_GRPC_ADDR: &'static str;
    const DEFAULT_METRICS_ADDR: &'static str;

    fn run(
        config: Self::Config,
        listeners: NodeListeners,
        shutdown: CancellationToken,
    ) -> impl Future<Output = Result<(), NodeError>> + Send + 'static;
}

/// Sets the thread count candle reads (it re-reads /proc/cpuinfo on every op otherwise). Call
/// it before any thread exists.
pub fn set_engine_threads() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// Runs a node of role `R` as this process: binds its sockets, prints where it listens (for
/// whoever started it on free ports), and serves until SIGTERM or Ctrl-C and the drain end.
pub fn launch<R: NodeRole>(
    cli: NodeCli<R::Config>,
) -> Result<(), telemetry::ProcessError<NodeError>> {
    set_engine_threads();
    let service_name = format!("fission-{}", R::ROLE);
    telemetry::run_service(
        &service_name,
        LOG_FILTER,
        cli.telemetry.otlp_endpoint.clone(),
        |shutdown| async move {
            let listen = &cli.listen;
            let grpc = bind(listen.grpc_addr.as_deref().unwrap_or(R::DEFAULT_GRPC_ADDR)).await?;
            let metrics = bind(
                listen
                    .metrics_addr
                    .as_deref()
                    .unwrap_or(R::DEFAULT_METRICS_ADDR),
            )
            .await?;
            announce(R::ROLE, &grpc, &metrics)?;
            R::run(cli.config, NodeListeners { grpc, metrics }, shutdown).await
        },
    )
}

async fn bind(addr: &str) -> Result<TcpListener, NodeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::Io {
            what: format!("binding {addr}"),
            source,
        })
}

fn announce(role: Role, grpc: &TcpListener, metrics: &TcpListener) -> Result<(), NodeError> {
    let addr = |l: &TcpListener| {
        l.local_addr().map_err(|source| NodeError::Io {
            what: "listener address".into(),
            source,
        })
    };
    let io = |source| NodeError::Io {
        what: "stdout".into(),
        source,
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{role} node grpc={} metrics=http://{}/metrics",
        addr(grpc)?,
        addr(metrics)?
    )
    .map_err(io)?;
    out.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use testkit::span_capture::Captured;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::EnvFilter;

    use super::*;

    /// Events seen inside a span under `filter`, by message.
    fn seen_under(filter: &str) -> Vec<String> {
        let capture = Captured::default();
        let subscriber = tracing_subscriber::registry()
            .with(EnvFilter::new(filter))
            .with(capture.clone());
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("kv_transfer");
            let _in = span.enter();
            tracing::info!(target: TRACE_EVENTS_TARGET, layer = 0i64, "layer sent");
            tracing::info!("kv push failed");
        });
        capture.named("kv_transfer")[0]
            .1
            .events
            .iter()
            .filter_map(|e| Some(e.get("message")?.as_str()?.to_owned()))
            .collect()
    }

    #[test]
    fn trace_events_stay_out_of_the_default_log_but_not_the_trace() {
        assert_eq!(seen_under(LOG_FILTER), vec!["kv push failed"]);
        // The trace filter's default.
        assert_eq!(seen_under("info"), vec!["layer sent", "kv push failed"]);
    }
}
