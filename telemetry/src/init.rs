//! Installing the subscriber: stderr logs always, OpenTelemetry export only when an OTLP
//! endpoint is configured, and a guard that flushes within [`SHUTDOWN_BOUND`].

use std::sync::mpsc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{RetryPolicy, WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SpanExporter;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::error::TelemetryError;
use crate::export_guard::{ExportGuard, Flushing};
use crate::sampler::sampler_from_env;

/// The longest [`TelemetryGuard::shutdown`] waits for the last spans to leave. A dead
/// collector costs process exit at most this much.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(2);
/// Per-export deadline (retries included) unless `OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT` is set.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);
/// Spans waiting for export; beyond this they are dropped, never waited for.
/// `OTEL_BSP_MAX_QUEUE_SIZE` overrides it.
const MAX_QUEUE_SPANS: usize = 8192;
/// How often queued spans are sent. `OTEL_BSP_SCHEDULE_DELAY` (ms) overrides it.
const SCHEDULE_DELAY: Duration = Duration::from_secs(1);
/// One quick retry per batch: enough for a collector restart's blip, while a dead collector
/// costs each queued batch 100 ms, so a backlog drains (by dropping) instead of stalling.
fn retry_policy() -> RetryPolicy {
    RetryPolicy::recommended()
        .with_max_retries(1)
        .with_initial_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_millis(100))
        .with_max_jitter(Duration::from_millis(20))
}
/// Which spans are exported, in `EnvFilter` syntax. The exporter's own stack is never traced.
const TRACE_FILTER_ENV: &str = "FISSION_TRACE_FILTER";
const DEFAULT_TRACE_FILTER: &str = "info";
const EXPORTER_CRATES_OFF: &str = "h2=off,hyper=off,hyper_util=off,tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off,opentelemetry_otlp=off";
/// Phoenix files spans under the project this resource attribute names; Jaeger ignores it.
const PROJECT_ATTRIBUTE: &str = "openinference.project.name";

/// The `--otlp-endpoint` flag, for a service's clap struct (`#[command(flatten)]`).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TelemetryArgs {
    /// OTLP/gRPC collector for traces, e.g. `http://localhost:4317`; it beats
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, which beats `OTEL_EXPORTER_OTLP_ENDPOINT`. None of
    /// them set: nothing is exported.
    // No clap `env`: bound to `OTEL_EXPORTER_OTLP_ENDPOINT`, the generic variable would arrive
    // as the flag and beat the traces-specific one, against the OpenTelemetry specification.
    // `resolve_endpoint` reads both variables in the specified order.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
}

/// What [`build`] needs; [`init`] fills it from its arguments.
#[derive(Clone, Debug)]
pub struct TelemetrySettings {
    /// `service.name` unless `OTEL_SERVICE_NAME` is set: `fission-gateway`, `fission-prefill`,
    /// `fission-decode`.
    pub service_name: String,
    /// Takes precedence over `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub otlp_endpoint: Option<String>,
    /// The log filter when `RUST_LOG` is unset, e.g. `info`.
    pub default_filter: String,
}

/// Installs the global subscriber. See [`build`].
pub fn init(
    service_name: &str,
    otlp_endpoint: Option<String>,
    default_filter: &str,
) -> Result<TelemetryGuard, TelemetryError> {
    let (dispatch, guard) = build(&TelemetrySettings {
        service_name: service_name.to_owned(),
        otlp_endpoint,
        default_filter: default_filter.to_owned(),
    })?;
    dispatch
        .try_init()
        .map_err(|_| TelemetryError::AlreadyInitialized)?;
    if let Some(export) = &guard.export {
        opentelemetry::global::set_tracer_provider(export.provider.clone());
        tracing::info!(
            endpoint = %export.endpoint,
            service = %export.service_name,
            "exporting traces over otlp/grpc"
        );
    }
    Ok(guard)
}

/// Builds the subscriber without installing it (tests scope it with
/// `tracing::dispatcher::with_default`): a stderr `fmt` layer filtered by `RUST_LOG` (else
/// `default_filter`), plus, when an endpoint is configured and `OTEL_SDK_DISABLED` is not
/// `true`, a `tracing-opentelemetry` layer feeding a batch OTLP/gRPC exporter. Also sets the
/// W3C trace-context propagator globally.
pub fn build(
    settings: &TelemetrySettings,
) -> Result<(tracing::Dispatch, TelemetryGuard), TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let fmt_layer = fmt_layer(&settings.default_filter)?;

    let Some(endpoint) = resolve_endpoint(settings.otlp_endpoint.as_deref())? else {
        let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(fmt_layer));
        return Ok((dispatch, TelemetryGuard { export: None }));
    };
    let (runtime, exporter) = otlp_exporter(&endpoint)?;
    let flushing = Flushing::default();
    let exporter = ExportGuard::new(exporter, endpoint.clone(), flushing.clone());
    assemble(
        settings,
        fmt_layer,
        exporter,
        endpoint,
        Some(runtime),
        flushing,
    )
}

/// [`build`] with spans going to `exporter` (through the same batch processor, sampler and
/// resource) instead of OTLP: for tests that check spans in-process, e.g. with
/// `opentelemetry_sdk::trace::InMemorySpanExporter` (feature `testing`). No endpoint needed.
pub fn build_with_exporter<E>(
    settings: &TelemetrySettings,
    exporter: E,
) -> Result<(tracing::Dispatch, TelemetryGuard), TelemetryError>
where
    E: SpanExporter + Send + 'static,
{
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let fmt_layer = fmt_layer(&settings.default_filter)?;
    assemble(
        settings,
        fmt_layer,
        exporter,
        "in-process".to_owned(),
        None,
        Flushing::default(),
    )
}

type FmtLayer = tracing_subscriber::filter::Filtered<
    tracing_subscriber::fmt::Layer<
        tracing_subscriber::Registry,
        tracing_subscriber::fmt::format::DefaultFields,
        tracing_subscriber::fmt::format::Format,
        fn() -> std::io::Stderr,
    >,
    EnvFilter,
    tracing_subscriber::Registry,
>;

/// Logs to stderr, filtered by `RUST_LOG` or else `default_filter` (as `init_process` did).
fn fmt_layer(default_filter: &str) -> Result<FmtLayer, TelemetryError> {
    let filter = match EnvFilter::try_from_default_env() {
        Ok(f) => f,
        Err(_) => {
            EnvFilter::try_new(default_filter).map_err(|source| TelemetryError::InvalidFilter {
                filter: default_filter.to_owned(),
                source,
            })?
        }
    };
    let stderr: fn() -> std::io::Stderr = std::io::stderr;
    Ok(tracing_subscriber::fmt::layer()
        .with_writer(stderr)
        .with_filter(filter))
}

/// The OTLP/gRPC exporter, with the small runtime its channel lives on. The channel gets its
/// own runtime so export never competes with serving tasks and works whatever runtime (or
/// none) the service's `main` has.
fn otlp_exporter(
    endpoint: &str,
) -> Result<(tokio::runtime::Runtime, opentelemetry_otlp::SpanExporter), TelemetryError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otel-export")
        .enable_all()
        .build()
        .map_err(|source| TelemetryError::Runtime { source })?;
    // The lazy tonic channel spawns its connection task on the runtime entered here.
    let exporter = {
        let _entered = runtime.enter();
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.to_owned())
            .with_retry_policy(retry_policy());
        if env_unset(&[
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
        ]) {
            builder = builder.with_timeout(EXPORT_TIMEOUT);
        }
        builder.build().map_err(|source| TelemetryError::Exporter {
            endpoint: endpoint.to_owned(),
            source,
        })?
    };
    Ok((runtime, exporter))
}

/// The OpenTelemetry half: batch processor, sampler, resource, and the layer over `fmt_layer`.
fn assemble<E>(
    settings: &TelemetrySettings,
    fmt_layer: FmtLayer,
    exporter: E,
    endpoint: String,
    runtime: Option<tokio::runtime::Runtime>,
    flushing: Flushing,
) -> Result<(tracing::Dispatch, TelemetryGuard), TelemetryError>
where
    E: SpanExporter + Send + 'static,
{
    let service_name = resolve_service_name(&settings.service_name);
    // A bad sampler setting must not stop a service: warn once the logger is up, and sample
    // by the default.
    let (sampler, sampler_err) = match sampler_from_env() {
        Ok(s) => (s, None),
        Err(e) => (Sampler::ParentBased(Box::new(Sampler::AlwaysOn)), Some(e)),
    };
    let mut batch = BatchConfigBuilder::default();
    if env_unset(&["OTEL_BSP_MAX_QUEUE_SIZE"]) {
        batch = batch.with_max_queue_size(MAX_QUEUE_SPANS);
    }
    if env_unset(&["OTEL_BSP_SCHEDULE_DELAY"]) {
        batch = batch.with_scheduled_delay(SCHEDULE_DELAY);
    }
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(batch.build())
        .build();
    let resource = Resource::builder()
        .with_service_name(service_name.clone())
        .with_attribute(KeyValue::new(PROJECT_ATTRIBUTE, service_name.clone()))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler)
        .with_resource(resource)
        .build();
    // busy/idle time and thread attributes cost per span and say nothing a waterfall does not.
    // Context activation attaches the span's OpenTelemetry context on every enter, that is on
    // every poll of an instrumented future (per streamed token in the gateway), and only
    // OpenTelemetry-native instrumentation reads it; our propagation reads `span.context()`.
    let otel_layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("fission"))
        .with_tracked_inactivity(false)
        .with_context_activation(false)
        .with_threads(false)
        .with_filter(trace_filter()?);
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::registry()
            .with(fmt_layer)
            .with(otel_layer),
    );
    if let Some(e) = sampler_err {
        tracing::dispatcher::with_default(
            &dispatch,
            || tracing::warn!(error = %e, "using the default sampler parentbased_always_on"),
        );
    }
    let export = Export {
        provider,
        runtime,
        endpoint,
        service_name,
        flushing,
    };
    Ok((
        dispatch,
        TelemetryGuard {
            export: Some(export),
        },
    ))
}

/// Flushes and stops the exporter when dropped or on [`shutdown`](Self::shutdown), waiting at
/// most [`SHUTDOWN_BOUND`]. Hold it in `main` until the service has stopped.
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    export: Option<Export>,
}

impl TelemetryGuard {
    /// Whether spans leave the process.
    pub fn is_exporting(&self) -> bool {
        self.export.is_some()
    }

    /// The OTLP endpoint spans go to, when exporting.
    pub fn endpoint(&self) -> Option<&str> {
        self.export.as_ref().map(|e| e.endpoint.as_str())
    }

    /// Sends the spans queued so far, without stopping the exporter (tests read an in-process
    /// exporter after this; a shutdown may clear it).
    pub fn force_flush(&self) -> Result<(), TelemetryError> {
        match &self.export {
            Some(export) => {
                export.flushing.set(true);
                let flushed = export.provider.force_flush();
                export.flushing.set(false);
                flushed.map_err(|e| TelemetryError::Shutdown {
                    endpoint: export.endpoint.clone(),
                    reason: e.to_string(),
                })
            }
            None => Ok(()),
        }
    }

    /// Sends the queued spans and stops the exporter, giving up after [`SHUTDOWN_BOUND`]
    /// (the spans still queued are then dropped). A second call does nothing.
    pub fn shutdown(&mut self) -> Result<(), TelemetryError> {
        match self.export.take() {
            Some(export) => export.shutdown(SHUTDOWN_BOUND),
            None => Ok(()),
        }
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!(error = %e, "trace export did not shut down cleanly");
        }
    }
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("endpoint", &self.endpoint())
            .finish()
    }
}

/// The provider, and the runtime the OTLP channel lives on (none for in-process exporters).
struct Export {
    provider: SdkTracerProvider,
    runtime: Option<tokio::runtime::Runtime>,
    endpoint: String,
    service_name: String,
    /// Tells the export guard that a flush is under way, so it sends through an outage pause.
    flushing: Flushing,
}

impl Export {
    /// Shuts the provider down on its own thread and waits at most `bound`: the SDK's own
    /// timeout does not cover an export already in flight to a collector that never answers.
    fn shutdown(self, bound: Duration) -> Result<(), TelemetryError> {
        let Export {
            provider,
            runtime,
            endpoint,
            flushing,
            ..
        } = self;
        // The last spans go out even inside an outage pause; the bound below still holds.
        flushing.set(true);
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("otel-shutdown".into())
            .spawn(move || {
                let _ = done_tx.send(provider.shutdown_with_timeout(bound));
            });
        let result = match spawned {
            Err(e) => Err(TelemetryError::Shutdown {
                endpoint: endpoint.clone(),
                reason: format!("cannot spawn the shutdown thread: {e}"),
            }),
            Ok(_) => match done_rx.recv_timeout(bound) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(TelemetryError::Shutdown {
                    endpoint: endpoint.clone(),
                    reason: e.to_string(),
                }),
                Err(_) => Err(TelemetryError::ShutdownTimeout {
                    endpoint: endpoint.clone(),
                    bound_ms: bound.as_millis() as u64,
                }),
            },
        };
        // Never blocks, even inside an async context; an export still running fails fast.
        if let Some(runtime) = runtime {
            runtime.shutdown_background();
        }
        result
    }
}

fn env_unset(names: &[&str]) -> bool {
    names
        .iter()
        .all(|n| std::env::var_os(n).is_none_or(|v| v.is_empty()))
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// The argument, else the standard variables; `None` means no export. A bare `host:port`
/// gets `http://`.
fn resolve_endpoint(arg: Option<&str>) -> Result<Option<String>, TelemetryError> {
    resolve_endpoint_from(arg, non_empty_env)
}

/// [`resolve_endpoint`] reading variables through `env` (non-empty values only), so tests
/// need not touch the process environment. The order is the OpenTelemetry specification's:
/// the explicit setting, then the per-signal variable, then the generic one.
fn resolve_endpoint_from(
    arg: Option<&str>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<String>, TelemetryError> {
    if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let Some(raw) = arg
        .map(|a| a.trim().to_owned())
        .filter(|a| !a.is_empty())
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"))
    else {
        return Ok(None);
    };
    normalize_endpoint(&raw).map(Some)
}

fn normalize_endpoint(raw: &str) -> Result<String, TelemetryError> {
    let with_scheme = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("http://{raw}")
    };
    let invalid = |reason: String| TelemetryError::InvalidEndpoint {
        endpoint: raw.to_owned(),
        reason,
    };
    let uri: http::Uri = with_scheme
        .parse()
        .map_err(|e: http::uri::InvalidUri| invalid(e.to_string()))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        other => return Err(invalid(format!("scheme {other:?} is not http or https"))),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("no host".to_owned()));
    }
    Ok(with_scheme)
}

fn resolve_service_name(arg: &str) -> String {
    non_empty_env("OTEL_SERVICE_NAME").unwrap_or_else(|| arg.to_owned())
}

fn trace_filter() -> Result<EnvFilter, TelemetryError> {
    let base = non_empty_env(TRACE_FILTER_ENV).unwrap_or_else(|| DEFAULT_TRACE_FILTER.to_owned());
    let filter = format!("{base},{EXPORTER_CRATES_OFF}");
    EnvFilter::try_new(&filter).map_err(|source| TelemetryError::InvalidFilter { filter, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_normalized_and_checked() {
        assert_eq!(
            normalize_endpoint("localhost:4317").unwrap(),
            "http://localhost:4317"
        );
        assert_eq!(
            normalize_endpoint("http://127.0.0.1:4317").unwrap(),
            "http://127.0.0.1:4317"
        );
        let err = normalize_endpoint("ftp://collector:21").unwrap_err();
        assert!(err.to_string().contains("ftp"), "{err}");
        assert!(normalize_endpoint("http://").is_err());
    }

    /// An environment of `(name, value)` pairs, read as `non_empty_env` reads the real one.
    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect();
        move |name| {
            vars.iter()
                .find(|(k, v)| k == name && !v.is_empty())
                .map(|(_, v)| v.clone())
        }
    }

    const TRACES: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
    const GENERIC: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

    #[test]
    fn an_explicit_endpoint_wins() {
        assert_eq!(
            resolve_endpoint(Some(" 127.0.0.1:9 ")).unwrap().as_deref(),
            Some("http://127.0.0.1:9")
        );
        let both = env_of(&[(TRACES, "traces:4317"), (GENERIC, "generic:4317")]);
        assert_eq!(
            resolve_endpoint_from(Some("flag:4317"), both).unwrap(),
            Some("http://flag:4317".into())
        );
    }

    #[test]
    fn the_traces_variable_beats_the_generic_one() {
        let both = env_of(&[(GENERIC, "generic:4317"), (TRACES, "traces:4317")]);
        assert_eq!(
            resolve_endpoint_from(None, &both).unwrap(),
            Some("http://traces:4317".into())
        );
        // An empty flag is no flag.
        assert_eq!(
            resolve_endpoint_from(Some(" "), &both).unwrap(),
            Some("http://traces:4317".into())
        );
        let generic_only = env_of(&[(GENERIC, "generic:4317"), (TRACES, " ")]);
        assert_eq!(
            resolve_endpoint_from(None, generic_only).unwrap(),
            Some("http://generic:4317".into())
        );
        assert_eq!(resolve_endpoint_from(None, env_of(&[])).unwrap(), None);
        let disabled = env_of(&[("OTEL_SDK_DISABLED", "TRUE"), (TRACES, "traces:4317")]);
        assert_eq!(
            resolve_endpoint_from(Some("flag:4317"), disabled).unwrap(),
            None
        );
    }

    /// The generic variable must not reach the flag through clap, or it would beat the
    /// traces-specific one.
    #[test]
    fn the_flag_is_not_bound_to_a_variable() {
        use clap::Args as _;
        let command = TelemetryArgs::augment_args(clap::Command::new("service"));
        let flag = command
            .get_arguments()
            .find(|a| a.get_long() == Some("otlp-endpoint"))
            .expect("--otlp-endpoint exists");
        assert_eq!(flag.get_env(), None);
    }

    #[test]
    fn trace_filter_silences_the_exporter_stack() {
        let f = trace_filter().unwrap().to_string();
        assert!(f.contains("h2=off") && f.contains("tonic=off"), "{f}");
    }

    /// With no endpoint nothing is exported: no exporter, no runtime, no OpenTelemetry layer,
    /// so spans carry no trace context to propagate.
    #[test]
    fn no_endpoint_exports_nothing() {
        if !env_unset(&[
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]) {
            eprintln!("skipping: an OTLP endpoint is set in this test's environment");
            return;
        }
        let (dispatch, mut guard) = build(&TelemetrySettings {
            service_name: "fission-test".into(),
            otlp_endpoint: None,
            default_filter: "warn".into(),
        })
        .unwrap();
        assert!(!guard.is_exporting());
        assert_eq!(guard.endpoint(), None);
        tracing::dispatcher::with_default(&dispatch, || {
            let span = tracing::info_span!("http_request", request_id = 1);
            let _entered = span.enter();
            assert_eq!(crate::current_traceparent(), None);
            let mut headers = http::HeaderMap::new();
            crate::inject_http(&mut headers);
            assert!(headers.is_empty(), "{headers:?}");
        });
        let started = std::time::Instant::now();
        guard.shutdown().unwrap();
        assert!(started.elapsed() < Duration::from_millis(50));
    }
}
