//! The progress bar: one per level on stderr, drawn only for a terminal and never with
//! `--quiet`, so piped output and tests stay clean.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::record::RequestRecord;

#[derive(Debug, Clone, Copy)]
pub struct Progress {
    visible: bool,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        Self {
            visible: !quiet && std::io::stderr().is_terminal(),
        }
    }

    pub fn hidden() -> Self {
        Self { visible: false }
    }

    /// A bar for a level of `duration`, filled by elapsed time; its message counts requests.
    pub fn level(&self, label: &str, duration: Duration) -> LevelProgress {
        let counts = Arc::new(Counts::default());
        if !self.visible {
            return LevelProgress {
                bar: ProgressBar::hidden(),
                counts,
                ticker: None,
            };
        }
        let tenths = (duration.as_millis() / 100).max(1) as u64;
        let bar = ProgressBar::with_draw_target(Some(tenths), ProgressDrawTarget::stderr());
        let style =
            ProgressStyle::with_template("{prefix:>16} [{elapsed_precise}] {wide_bar} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_prefix(label.to_string());
        // The bar moves with time, not with requests: a level at 0.1 req/s still shows life.
        let ticker = {
            let (bar, counts) = (bar.clone(), counts.clone());
            tokio::spawn(async move {
                let start = tokio::time::Instant::now();
                let mut tick = tokio::time::interval(Duration::from_millis(200));
                loop {
                    tick.tick().await;
                    let t = (start.elapsed().as_millis() / 100) as u64;
                    bar.set_position(t.min(tenths));
                    bar.set_message(counts.message());
                }
            })
        };
        LevelProgress {
            bar,
            counts,
            ticker: Some(ticker),
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    sent: AtomicUsize,
    done: AtomicUsize,
    failed: AtomicUsize,
}

impl Counts {
    fn message(&self) -> String {
        let (s, d, f) = (
            self.sent.load(Ordering::Relaxed),
            self.done.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        );
        format!(
            "sent {s} done {d} failed {f} in flight {}",
            s.saturating_sub(d)
        )
    }
}

/// Counts one level's requests; cheap to clone into request tasks.
#[derive(Debug)]
pub struct LevelProgress {
    bar: ProgressBar,
    counts: Arc<Counts>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

#[derive(Debug, Clone)]
pub struct RequestCounter {
    counts: Arc<Counts>,
}

impl RequestCounter {
    pub fn sent(&self) {
        self.counts.sent.fetch_add(1, Ordering::Relaxed);
    }

    pub fn done(&self, r: &RequestRecord) {
        self.counts.done.fetch_add(1, Ordering::Relaxed);
        if !r.ok() {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl LevelProgress {
    pub fn counter(&self) -> RequestCounter {
        RequestCounter {
            counts: self.counts.clone(),
        }
    }

    /// Marks the sending done: the rest of the time is waiting for answers.
    pub fn draining(&self) {
        if let Some(len) = self.bar.length() {
            self.bar.set_position(len);
        }
        self.bar
            .set_message(format!("{} (draining)", self.counts.message()));
    }

    pub fn finish(self) {
        if let Some(t) = &self.ticker {
            t.abort();
        }
        self.bar.finish_and_clear();
    }
}

impl Drop for LevelProgress {
    fn drop(&mut self) {
        if let Some(t) = &self.ticker {
            t.abort();
        }
    }
}
