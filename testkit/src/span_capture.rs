//! A `tracing` layer that keeps every span's name, fields (with their types), parent and
//! events, and whether it closed, so tests can check what an exported trace would hold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    I64(i64),
    U64(u64),
    F64(f64),
    Bool(bool),
    Str(String),
}

impl Value {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct SpanRec {
    pub name: String,
    /// Index of the parent in [`Captured::spans`].
    pub parent: Option<usize>,
    pub fields: HashMap<String, Value>,
    /// Each event's fields, plus `target` and `level`.
    pub events: Vec<HashMap<String, Value>>,
    pub closed: bool,
}

impl SpanRec {
    pub fn field(&self, name: &str) -> Option<&Value> {
        self.fields.get(name)
    }
}

/// Keeps a [`Captured`] installed: see [`Captured::install`].
pub struct CaptureGuard {
    _default: tracing::subscriber::DefaultGuard,
    _anchor: tracing::Dispatch,
}

#[derive(Clone, Default)]
pub struct Captured {
    spans: Arc<Mutex<Vec<SpanRec>>>,
    /// Live span ids to indices (the registry reuses ids of closed spans).
    live: Arc<Mutex<HashMap<u64, usize>>>,
}

impl Captured {
    /// A subscriber that feeds this capture; scope it with [`Captured::install`].
    pub fn subscriber(&self) -> impl Subscriber + Send + Sync {
        tracing_subscriber::registry().with(self.clone())
    }

    /// Makes this capture the thread's subscriber until the guard drops.
    ///
    /// tracing caches each callsite's interest process-wide, computed when the callsite is
    /// first hit. While only one dispatcher is registered it asks just the thread that hits
    /// it: a parallel test with no subscriber then caches "never" for a span this test waits
    /// for, and the span is lost (one run in a dozen of prefill-node's push tests). A second,
    /// always-interested dispatcher held for the guard's life makes tracing ask every live
    /// dispatcher, this capture included; registering them rebuilds the callsites cached
    /// before.
    pub fn install(&self) -> CaptureGuard {
        let anchor = tracing::Dispatch::new(tracing_subscriber::registry());
        let default = tracing::subscriber::set_default(self.subscriber());
        tracing::callsite::rebuild_interest_cache();
        CaptureGuard {
            _default: default,
            _anchor: anchor,
        }
    }

    pub fn spans(&self) -> Vec<SpanRec> {
        self.spans
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn named(&self, name: &str) -> Vec<(usize, SpanRec)> {
        self.spans()
            .into_iter()
            .enumerate()
            .filter(|(_, s)| s.name == name)
            .collect()
    }

    fn index(&self, id: &Id) -> Option<usize> {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id.into_u64())
            .copied()
    }

    fn with_span(&self, id: &Id, f: impl FnOnce(&mut SpanRec)) {
        if let Some(i) = self.index(id) {
            if let Some(s) = self
                .spans
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(i)
            {
                f(s);
            }
        }
    }
}

struct Fields<'a>(&'a mut HashMap<String, Value>);

impl Visit for Fields<'_> {
    fn record_i64(&mut self, f: &Field, v: i64) {
        self.0.insert(f.name().into(), Value::I64(v));
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        self.0.insert(f.name().into(), Value::U64(v));
    }
    fn record_f64(&mut self, f: &Field, v: f64) {
        self.0.insert(f.name().into(), Value::F64(v));
    }
    fn record_bool(&mut self, f: &Field, v: bool) {
        self.0.insert(f.name().into(), Value::Bool(v));
    }
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().into(), Value::Str(v.into()));
    }
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().into(), Value::Str(format!("{v:?}")));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Captured {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let parent = if attrs.is_root() {
            None
        } else if let Some(p) = attrs.parent() {
            self.index(p)
        } else {
            ctx.current_span().id().and_then(|p| self.index(p))
        };
        let mut rec = SpanRec {
            name: attrs.metadata().name().into(),
            parent,
            ..Default::default()
        };
        attrs.record(&mut Fields(&mut rec.fields));
        let mut spans = self.spans.lock().unwrap_or_else(PoisonError::into_inner);
        spans.push(rec);
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.into_u64(), spans.len() - 1);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _ctx: Context<'_, S>) {
        self.with_span(id, |s| values.record(&mut Fields(&mut s.fields)));
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let parent = if let Some(p) = event.parent() {
            Some(p.clone())
        } else if event.is_contextual() {
            ctx.current_span().id().cloned()
        } else {
            None
        };
        let Some(parent) = parent else {
            return;
        };
        let mut fields = HashMap::new();
        event.record(&mut Fields(&mut fields));
        let meta = event.metadata();
        fields.insert("target".into(), Value::Str(meta.target().into()));
        fields.insert("level".into(), Value::Str(meta.level().to_string()));
        self.with_span(&parent, |s| s.events.push(fields));
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        self.with_span(&id, |s| s.closed = true);
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id.into_u64());
    }
}
