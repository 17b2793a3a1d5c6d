//! An in-process [`Backend`] for tests and demos: it "generates" a scripted token sequence with a
//! delay per token, can fail mid-stream or end without a finish reason, and counts what happened
//! to its streams (finished, failed, cancelled by a drop) so tests can wait on it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use proto::ErrorCode;
use tokio::sync::watch;

use crate::backend::Backend;
use crate::error::GatewayError;
use crate::request::{FinishReason, GeneratedToken, TokenStream, ValidRequest};

/// What the fake generates.
#[derive(Debug, Clone)]
pub struct FakeScript {
    /// `(id, text)` emitted in turn, cycling, up to `max_new_tokens`. A token whose id is one of
    /// the request's stop tokens ends the stream with `Eos` (unless `ignore_eos`).
    pub tokens: Vec<(u32, String)>,
    /// Waited before each token.
    pub token_delay: Duration,
    /// Yield an error instead of token number `n` (0-based), then end.
    pub fail_at: Option<usize>,
    /// End the stream without a finish reason instead of token number `n`.
    pub end_early_at: Option<usize>,
    /// Refuse every request in `generate` with this code.
    pub refuse_with: Option<ErrorCode>,
}

impl Default for FakeScript {
    fn default() -> Self {
        let words = [" Once", " upon", " a", " time", ","];
        Self {
            tokens: words
                .iter()
                .enumerate()
                .map(|(i, w)| (100 + i as u32, w.to_string()))
                .collect(),
            token_delay: Duration::from_millis(1),
            fail_at: None,
            end_early_at: None,
            refuse_with: None,
        }
    }
}

/// What happened to the fake's streams so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeCounts {
    /// Streams handed out.
    pub started: usize,
    /// Streams alive now.
    pub active: usize,
    /// Streams that yielded their last token.
    pub finished: usize,
    /// Streams that yielded an error or ended early.
    pub failed: usize,
    /// Streams dropped before their end: the request was cancelled.
    pub cancelled: usize,
}

pub struct FakeBackend {
    script: FakeScript,
    ready: std::sync::atomic::AtomicBool,
    counts: Arc<watch::Sender<FakeCounts>>,
    last_request: Mutex<Option<ValidRequest>>,
    /// What [`Backend::max_context`] answers; 0 for "unknown".
    max_context: std::sync::atomic::AtomicUsize,
}

impl FakeBackend {
    pub fn new(script: FakeScript) -> Self {
        Self {
            script,
            ready: true.into(),
            counts: Arc::new(watch::channel(FakeCounts::default()).0),
            last_request: Mutex::new(None),
            max_context: 0.into(),
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, std::sync::atomic::Ordering::SeqCst);
    }

    /// Pretends the nodes hold at most `tokens` tokens of context (0: unknown).
    pub fn set_max_context(&self, tokens: usize) {
        self.max_context
            .store(tokens, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn counts(&self) -> FakeCounts {
        *self.counts.borrow()
    }

    /// Waits until `condition` holds for the counts; `Err` with the last counts after `timeout`.
    pub async fn wait_for(
        &self,
        condition: impl FnMut(&FakeCounts) -> bool,
        timeout: Duration,
    ) -> Result<FakeCounts, FakeCounts> {
        let mut rx = self.counts.subscribe();
        let met = tokio::time::timeout(timeout, rx.wait_for(condition))
            .await
            .is_ok_and(|r| r.is_ok());
        if met {
            Ok(self.counts())
        } else {
            Err(self.counts())
        }
    }

    /// The last request `generate` was given.
    pub fn last_request(&self) -> Option<ValidRequest> {
        self.last_request
            .lock()
            .map(|r| r.clone())
            .unwrap_or_else(|poisoned| poisoned.into_inner().clone())
    }
}

impl Backend for FakeBackend {
    fn generate(
        &self,
        request: ValidRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>> {
        if let Ok(mut last) = self.last_request.lock() {
            *last = Some(request.clone());
        }
        let refused = self.script.refuse_with;
        let run = (refused.is_none() && !self.script.tokens.is_empty()).then(|| {
            self.counts.send_modify(|c| {
                c.started += 1;
                c.active += 1;
            });
            FakeRun {
                script: self.script.clone(),
                request,
                counts: Arc::clone(&self.counts),
                index: 0,
                text: String::new(),
                done: false,
            }
        });
        Box::pin(async move {
            let Some(run) = run else {
                let code = refused.unwrap_or(ErrorCode::Internal);
                return Err(GatewayError::backend(
                    code,
                    "the fake backend refused the request",
                ));
            };
            let tokens = futures::stream::unfold(run, |mut run| async move {
                if run.done {
                    return None;
                }
                tokio::time::sleep(run.script.token_delay).await;
                run.step().map(|item| (item, run))
            });
            Ok(Box::pin(tokens) as TokenStream)
        })
    }

    fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn max_context(&self) -> Option<usize> {
        Some(self.max_context.load(std::sync::atomic::Ordering::SeqCst)).filter(|&c| c > 0)
    }

    fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "kind": "fake",
            "tokens": self.script.tokens.len(),
            "token_delay_ms": self.script.token_delay.as_millis() as u64,
        })
    }
}

/// One request's generation; counts itself cancelled when dropped before its end.
struct FakeRun {
    script: FakeScript,
    request: ValidRequest,
    counts: Arc<watch::Sender<FakeCounts>>,
    index: usize,
    /// Text emitted so far, for stop strings.
    text: String,
    done: bool,
}

impl FakeRun {
    /// The next item, or `None` to end the stream without a finish reason.
    fn step(&mut self) -> Option<Result<GeneratedToken, GatewayError>> {
        let index = self.index;
        if self.script.end_early_at == Some(index) {
            self.end(|c| c.failed += 1);
            return None;
        }
        if self.script.fail_at == Some(index) {
            self.end(|c| c.failed += 1);
            return Some(Err(GatewayError::backend(
                ErrorCode::Internal,
                format!("the fake backend failed at token {index}"),
            )));
        }
        let (id, word) = self.script.tokens[index % self.script.tokens.len()].clone();
        let stopping = &self.request.stopping;
        let mut text = word;
        let mut finish_reason = None;
        // Stop strings are matched without holding text back: a stop string spanning tokens
        // may leave its beginning in the output.
        let candidate = format!("{}{}", self.text, text);
        if let Some(at) = stopping
            .stop_strings
            .iter()
            .filter_map(|s| candidate.find(s.as_str()))
            .min()
        {
            text = candidate[self.text.len().min(at)..at].to_string();
            finish_reason = Some(FinishReason::Stop);
        }
        let special = stopping.stop_token_ids.contains(&id);
        if finish_reason.is_none() && special && !stopping.ignore_eos {
            finish_reason = Some(FinishReason::Eos);
        }
        if finish_reason.is_none() && index + 1 >= stopping.max_new_tokens {
            finish_reason = Some(FinishReason::Length);
        }
        self.text.push_str(&text);
        self.index += 1;
        if finish_reason.is_some() {
            self.end(|c| c.finished += 1);
        }
        let top_n = self.request.sampling.top_n_logprobs as u32;
        Some(Ok(GeneratedToken {
            id,
            text,
            logprob: -0.5,
            top_logprobs: (0..top_n).map(|k| (id + k, -0.5 - k as f32)).collect(),
            index,
            finish_reason,
            // A fixed figure per prompt token after the first, on the first token only.
            prompt_logprobs: if index == 0 && self.request.prompt_logprobs {
                vec![-1.0; self.request.prompt_ids.len() - 1]
            } else {
                Vec::new()
            },
        }))
    }

    fn end(&mut self, count: impl FnOnce(&mut FakeCounts)) {
        self.done = true;
        self.counts.send_modify(|c| {
            count(c);
            c.active -= 1;
        });
    }
}

impl Drop for FakeRun {
    fn drop(&mut self) {
        if !self.done {
            self.counts.send_modify(|c| {
                c.cancelled += 1;
                c.active -= 1;
            });
        }
    }
}
