//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers, gRPC metadata
//! and the KV-transfer frame header.
//!
//! Incoming context becomes a span's parent with [`set_parent`], which must run before the
//! span is first entered. Outgoing context is taken from the current span (or a given one).
//!
//! Without the OpenTelemetry layer (no endpoint configured) spans have no context of their
//! own, but a process that does not export must not split the client's trace when the next
//! hop does: [`set_parent`] then keeps the incoming context on the span, and injection
//! forwards it unchanged from that span and its descendants. With no incoming context
//! injection writes nothing and [`current_traceparent`] is `None`.

use std::collections::HashMap;

use http::header::{HeaderName, HeaderValue};
use http::HeaderMap;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::registry::{LookupSpan, Registry};

const TRACEPARENT: &str = "traceparent";

/// W3C is the wire format in every carrier, whatever global propagator is installed.
fn propagator() -> &'static TraceContextPropagator {
    static PROPAGATOR: std::sync::OnceLock<TraceContextPropagator> = std::sync::OnceLock::new();
    PROPAGATOR.get_or_init(TraceContextPropagator::new)
}

/// Whether `value` has the W3C `traceparent` shape: `vv-<32 hex>-<16 hex>-ff` in lowercase
/// hex, version `ff` excluded, exactly 55 characters for version `00` (later versions may
/// append fields). The SDK's parser alone accepts short ids.
fn is_w3c_traceparent(value: &str) -> bool {
    let b = value.as_bytes();
    let hex = |r: std::ops::Range<usize>| {
        b[r].iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() >= 55
        && hex(0..2)
        && &b[0..2] != b"ff"
        && (&b[0..2] != b"00" || b.len() == 55)
        && (b.len() == 55 || b[55] == b'-')
        && b[2] == b'-'
        && hex(3..35)
        && b[35] == b'-'
        && hex(36..52)
        && b[52] == b'-'
        && hex(53..55)
}

/// `cx` when the carrier's `traceparent` is well formed, else an empty context.
fn checked(cx: Context, traceparent: Option<&str>) -> Context {
    if traceparent.is_some_and(is_w3c_traceparent) {
        cx
    } else {
        Context::new()
    }
}

/// What goes downstream from `span`: its own context when the OpenTelemetry layer records it,
/// else the remote context [`set_parent`] kept on it or its nearest ancestor, else `None`.
fn valid_context(span: &tracing::Span) -> Option<Context> {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        return Some(cx);
    }
    kept_remote_context(span)
}

/// An incoming context the OpenTelemetry layer did not take (no layer, or the span is not
/// exported), kept in the span's registry extensions to be forwarded as is.
struct KeptRemoteContext(Context);

fn keep_remote_context(span: &tracing::Span, cx: Context) {
    span.with_subscriber(|(id, dispatch)| {
        if let Some(span) = dispatch
            .downcast_ref::<Registry>()
            .and_then(|registry| registry.span(id))
        {
            span.extensions_mut().replace(KeptRemoteContext(cx));
        }
    });
}

/// Walks from `span` to its root: spans are few per request and the walk runs once per
/// outgoing call, not per token.
fn kept_remote_context(span: &tracing::Span) -> Option<Context> {
    span.with_subscriber(|(id, dispatch)| {
        let registry = dispatch.downcast_ref::<Registry>()?;
        registry.span(id)?.scope().find_map(|s| {
            s.extensions()
                .get::<KeptRemoteContext>()
                .map(|kept| kept.0.clone())
        })
    })
    .flatten()
}

// ---- HTTP ----

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// The client's trace context from `traceparent`/`tracestate`. An absent or malformed header
/// gives an empty context, and [`set_parent`] with it leaves the span a new root.
pub fn extract_http(headers: &HeaderMap) -> Context {
    let carrier = HeaderExtractor(headers);
    checked(propagator().extract(&carrier), carrier.get(TRACEPARENT))
}

/// Writes the current span's context into `headers`; writes nothing when there is none.
pub fn inject_http(headers: &mut HeaderMap) {
    if let Some(cx) = valid_context(&tracing::Span::current()) {
        propagator().inject_context(&cx, &mut HeaderInjector(headers));
    }
}

// ---- gRPC ----

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .map(|k| match k {
                KeyRef::Ascii(k) => k.as_str(),
                KeyRef::Binary(k) => k.as_str(),
            })
            .collect()
    }
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(key, value);
        }
    }
}

/// The caller's trace context from a request's metadata (`request.metadata()`).
pub fn extract_grpc(metadata: &MetadataMap) -> Context {
    let carrier = MetadataExtractor(metadata);
    checked(propagator().extract(&carrier), carrier.get(TRACEPARENT))
}

/// Writes the current span's context into outgoing metadata (`request.metadata_mut()`).
pub fn inject_grpc(metadata: &mut MetadataMap) {
    if let Some(cx) = valid_context(&tracing::Span::current()) {
        propagator().inject_context(&cx, &mut MetadataInjector(metadata));
    }
}

/// `tonic::Request::new(message)` carrying the current span's context: call it inside the
/// span the RPC belongs to.
pub fn with_trace<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    inject_grpc(request.metadata_mut());
    request
}

// ---- the KV-transfer frame header ----

/// The current span's `traceparent`, for `LayerHeader::traceparent`.
pub fn current_traceparent() -> Option<String> {
    span_traceparent(&tracing::Span::current())
}

/// `span`'s `traceparent` (`00-<trace id>-<span id>-<flags>`), or `None` when it has no
/// valid context.
pub fn span_traceparent(span: &tracing::Span) -> Option<String> {
    let cx = valid_context(span)?;
    let mut carrier = HashMap::with_capacity(2);
    propagator().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The context a received `traceparent` names (empty when it does not parse).
pub fn context_from_traceparent(traceparent: &str) -> Context {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    checked(propagator().extract(&carrier), Some(traceparent))
}

// ---- spans ----

/// Makes the remote span in `cx` the parent of `span`, and says whether it did. A context
/// without a valid span (no or malformed header) leaves `span`'s parent as it was. Call it
/// before `span` is first entered: a started span keeps its parent.
///
/// When `span` is not exported (no OpenTelemetry layer, or filtered out of export) it cannot
/// have a parent; `cx` is then kept on it and forwarded by the `inject_*` helpers, so the
/// next hop still joins the caller's trace. This returns `false` in that case.
pub fn set_parent(span: &tracing::Span, cx: Context) -> bool {
    if !cx.span().span_context().is_valid() {
        return false;
    }
    match span.set_parent(cx.clone()) {
        Ok(()) => true,
        Err(_) => {
            keep_remote_context(span, cx);
            false
        }
    }
}

/// Links `span` to the span in `to` (a batch span to each request span it serves).
pub fn add_link(span: &tracing::Span, to: &Context) {
    let target = to.span().span_context().clone();
    if target.is_valid() {
        span.add_link(target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::layer::SubscriberExt;

    const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const SPAN_ID: &str = "00f067aa0ba902b7";
    const TRACEPARENT_SAMPLED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    /// A subscriber with the OpenTelemetry layer and no exporter: spans get real ids.
    fn with_otel<R>(f: impl FnOnce() -> R) -> R {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, f)
    }

    fn ids(cx: &Context) -> (TraceId, SpanId, bool, bool) {
        let sc = cx.span().span_context().clone();
        (sc.trace_id(), sc.span_id(), sc.is_remote(), sc.is_sampled())
    }

    #[test]
    fn a_known_traceparent_parses() {
        let cx = context_from_traceparent(TRACEPARENT_SAMPLED);
        let (trace, span, remote, sampled) = ids(&cx);
        assert_eq!(trace.to_string(), TRACE_ID);
        assert_eq!(span.to_string(), SPAN_ID);
        assert!(remote && sampled);
    }

    #[test]
    fn malformed_traceparents_give_an_empty_context() {
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            let cx = context_from_traceparent(bad);
            assert!(!cx.span().span_context().is_valid(), "{bad:?}");
            let span = tracing::Span::none();
            assert!(!set_parent(&span, cx), "{bad:?}");
        }
    }

    #[test]
    fn later_versions_may_append_fields() {
        let tp = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future";
        assert!(is_w3c_traceparent(tp));
        assert!(!is_w3c_traceparent(&tp[..54]));
        let mut headers = HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0"
                .parse()
                .unwrap(),
        );
        assert!(!extract_http(&headers).span().span_context().is_valid());
    }

    #[test]
    fn http_header_becomes_the_parent_and_travels_on() {
        let mut incoming = HeaderMap::new();
        incoming.insert("traceparent", TRACEPARENT_SAMPLED.parse().unwrap());
        let (outgoing, own_span_id) = with_otel(|| {
            let span = tracing::info_span!("http_request");
            assert!(set_parent(&span, extract_http(&incoming)));
            let _entered = span.enter();
            let mut out = HeaderMap::new();
            inject_http(&mut out);
            (out, span.context().span().span_context().span_id())
        });
        let (trace, parent, ..) = ids(&extract_http(&outgoing));
        assert_eq!(trace.to_string(), TRACE_ID, "same trace");
        assert_eq!(parent, own_span_id, "the outgoing parent is our span");
        assert_ne!(parent.to_string(), SPAN_ID, "not the client's span");
    }

    #[test]
    fn grpc_round_trip_keeps_trace_and_remote_parent() {
        let (request, sent_trace, sent_span) = with_otel(|| {
            let span = tracing::info_span!("route");
            let _entered = span.enter();
            let sc = span.context().span().span_context().clone();
            (with_trace(()), sc.trace_id(), sc.span_id())
        });
        assert!(request.metadata().get("traceparent").is_some());
        let cx = extract_grpc(request.metadata());
        let (trace, parent, remote, sampled) = ids(&cx);
        assert_eq!((trace, parent), (sent_trace, sent_span));
        assert!(remote && sampled);

        // On the server: the handler's span becomes a child of the client's span.
        let (child_trace, child_span) = with_otel(|| {
            let span = tracing::info_span!("prefill");
            assert!(set_parent(&span, cx));
            let _entered = span.enter();
            let sc = span.context().span().span_context().clone();
            (sc.trace_id(), sc.span_id())
        });
        assert_eq!(child_trace, sent_trace);
        assert_ne!(child_span, sent_span);
    }

    #[test]
    fn kv_frame_traceparent_round_trip() {
        let (tp, trace, span_id) = with_otel(|| {
            let span = tracing::info_span!("kv_transfer");
            let _entered = span.enter();
            let sc = span.context().span().span_context().clone();
            (current_traceparent(), sc.trace_id(), sc.span_id())
        });
        let tp = tp.expect("a span with the OpenTelemetry layer has a traceparent");
        assert_eq!(tp, format!("00-{trace}-{span_id}-01"));
        let (t, s, remote, _) = ids(&context_from_traceparent(&tp));
        assert_eq!((t, s, remote), (trace, span_id, true));
    }

    #[test]
    fn without_the_layer_nothing_is_injected() {
        let span = tracing::info_span!("http_request");
        let _entered = span.enter();
        assert_eq!(current_traceparent(), None);
        let request = with_trace(());
        assert!(request.metadata().is_empty());
    }

    /// A process that does not export (no OpenTelemetry layer, only the registry that
    /// `build` installs) still forwards the client's context downstream, unchanged, from the
    /// span that received it and from that span's descendants.
    #[test]
    fn without_the_layer_the_incoming_context_is_forwarded() {
        let mut incoming = HeaderMap::new();
        incoming.insert("traceparent", TRACEPARENT_SAMPLED.parse().unwrap());
        let subscriber = tracing_subscriber::registry();
        let (http, grpc, frame, unrelated) = tracing::subscriber::with_default(subscriber, || {
            let root = tracing::info_span!("http_request");
            assert!(
                !set_parent(&root, extract_http(&incoming)),
                "no layer: no parent"
            );
            let _root = root.enter();
            let mut http = HeaderMap::new();
            inject_http(&mut http);
            let route = tracing::info_span!("route");
            let _route = route.enter();
            let grpc = with_trace(());
            let frame = current_traceparent();
            // A span outside the request's tree forwards nothing.
            let other = tracing::info_span!(parent: None, "decode_batch");
            let unrelated = span_traceparent(&other);
            (http, grpc, frame, unrelated)
        });
        assert_eq!(http["traceparent"], TRACEPARENT_SAMPLED);
        assert_eq!(
            grpc.metadata().get("traceparent").unwrap(),
            TRACEPARENT_SAMPLED
        );
        assert_eq!(frame.as_deref(), Some(TRACEPARENT_SAMPLED));
        assert_eq!(unrelated, None);
        let (trace, span, _, sampled) = ids(&extract_grpc(grpc.metadata()));
        assert_eq!(
            (trace.to_string(), span.to_string()),
            (TRACE_ID.into(), SPAN_ID.into())
        );
        assert!(sampled, "the client's sampling decision travels on");
    }

    #[test]
    fn without_the_layer_or_a_client_context_nothing_is_forwarded() {
        tracing::subscriber::with_default(tracing_subscriber::registry(), || {
            let root = tracing::info_span!("http_request");
            assert!(!set_parent(&root, extract_http(&HeaderMap::new())));
            let _root = root.enter();
            assert_eq!(current_traceparent(), None);
            assert!(with_trace(()).metadata().is_empty());
        });
    }

    #[test]
    fn links_do_not_need_a_valid_target() {
        with_otel(|| {
            let batch = tracing::info_span!("decode_step");
            add_link(&batch, &Context::new());
            add_link(&batch, &context_from_traceparent(TRACEPARENT_SAMPLED));
        });
    }
}
