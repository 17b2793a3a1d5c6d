//! Several sequences from one prompt: OpenAI's `n` and `best_of`, TGI's `best_of`.
//!
//! The prompt is validated once, and the first sequence runs alone until its first token. By
//! then the node that prefilled the prompt holds its full KV blocks in its prefix cache (blocks
//! are hashed as they fill, see `engine::kv::allocator`), so the other sequences, which the
//! cache-aware policy routes to that node, share those blocks and compute only the last,
//! partial block: the prompt is prefilled about once, not `count` times. Each sequence has its
//! own request id and seed (`seed + i`), so sampled sequences differ and a seeded request
//! still repeats.

use futures::stream::BoxStream;
use futures::StreamExt;

use crate::error::GatewayError;
use crate::generation::Completed;
use crate::request::{GeneratedToken, RequestId, ValidRequest};
use crate::state::AppState;

/// One sequence's tokens, as [`crate::generation::Generation`] yields them.
pub(crate) type TokenItems = BoxStream<'static, Result<GeneratedToken, GatewayError>>;

/// Sequences started from one validated prompt.
pub(crate) struct Sequences {
    /// The first sequence's id: the one the response is named after.
    pub request_id: RequestId,
    pub prompt_ids: Vec<u32>,
    /// Each sequence's seed, when the request samples.
    pub seeds: Vec<Option<u64>>,
    /// In sequence order; the first is started, the others start when first polled.
    pub streams: Vec<TokenItems>,
}

impl Sequences {
    /// Starts `count` sequences of `request` (`count >= 1`). Fails as a single request would
    /// when the first sequence cannot start or fails before its first token; a later
    /// sequence's failure arrives on its stream.
    pub(crate) async fn start(
        state: &AppState,
        request: ValidRequest,
        count: usize,
    ) -> Result<Self, GatewayError> {
        let (mut requests, seeds) = per_sequence(&request, count);
        let others = requests.split_off(1);
        let first = requests.pop().expect("count is at least 1");
        let mut generation = state.start(first).await?;
        let mut streams = Vec::with_capacity(count);
        if others.is_empty() {
            streams.push(generation.tokens);
        } else {
            // The first token means the prompt is prefilled and its blocks are cached.
            let head = match generation.tokens.next().await {
                Some(Ok(token)) => token,
                Some(Err(error)) => return Err(error),
                None => {
                    return Err(GatewayError::StreamEndedEarly {
                        request_id: generation.request_id,
                        generated_tokens: 0,
                    })
                }
            };
            streams.push(
                futures::stream::once(async move { Ok(head) })
                    .chain(generation.tokens)
                    .boxed(),
            );
        }
        streams.extend(others.into_iter().map(|r| start_when_polled(state, r)));
        Ok(Self {
            request_id: request.request_id,
            prompt_ids: request.prompt_ids,
            seeds,
            streams,
        })
    }

    /// Like [`Sequences::start`], but nothing starts until its stream is first polled: for the
    /// second and later prompts of one request. Started eagerly, each would take a
    /// concurrency slot and hold it while nothing read its tokens, so a request with more
    /// prompts than slots waited on itself until the queue timed it out; a failure to start
    /// arrives on the sequence's stream instead.
    pub(crate) fn when_polled(state: &AppState, request: ValidRequest, count: usize) -> Self {
        let (requests, seeds) = per_sequence(&request, count);
        Self {
            request_id: request.request_id,
            prompt_ids: request.prompt_ids,
            seeds,
            streams: requests
                .into_iter()
                .map(|r| start_when_polled(state, r))
                .collect(),
        }
    }

    /// Every sequence collected to its end, concurrently; the first error fails them all.
    pub(crate) async fn collect(self) -> Result<Vec<Completed>, GatewayError> {
        let request_id = self.request_id;
        let collected = futures::future::join_all(
            self.streams
                .into_iter()
                .map(|tokens| Completed::collect(request_id.clone(), tokens)),
        )
        .await;
        collected.into_iter().collect()
    }

    /// The sequences' tokens as they come, each tagged with its sequence's index.
    pub(crate) fn merged(
        self,
    ) -> BoxStream<'static, (usize, Result<GeneratedToken, GatewayError>)> {
        futures::stream::select_all(
            self.streams
                .into_iter()
                .enumerate()
                .map(|(i, tokens)| tokens.map(move |item| (i, item)).boxed()),
        )
        .boxed()
    }
}

/// The `count` sequences' requests (each after the first with its own id and seed) and their
/// seeds, when the request samples.
fn per_sequence(request: &ValidRequest, count: usize) -> (Vec<ValidRequest>, Vec<Option<u64>>) {
    let samples = request.sampling.temperature > 0.0;
    let requests: Vec<ValidRequest> = (0..count.max(1))
        .map(|i| {
            let mut r = request.clone();
            if i > 0 {
                r.request_id = RequestId::new_random();
                r.sampling.seed = r.sampling.seed.wrapping_add(i as u64);
                // Same prompt, same logprobs: the first sequence reports them, and the
                // others keep taking its blocks from the prefix cache.
                r.prompt_logprobs = false;
            }
            r
        })
        .collect();
    let seeds = requests
        .iter()
        .map(|r| samples.then_some(r.sampling.seed))
        .collect();
    (requests, seeds)
}

/// A sequence that starts when its stream is first polled; a failure to start is its one item.
fn start_when_polled(state: &AppState, request: ValidRequest) -> TokenItems {
    let state = state.clone();
    futures::stream::once(async move { state.start(request).await })
        .flat_map(|started| match started {
            Ok(generation) => generation.tokens,
            Err(error) => futures::stream::iter([Err(error)]).boxed(),
        })
        .boxed()
}

/// The mean logprob per token: OpenAI's and TGI's measure of the best of several sequences.
pub(crate) fn mean_logprob(completed: &Completed) -> f32 {
    let n = completed.tokens.len().max(1) as f32;
    completed.tokens.iter().map(|t| t.logprob).sum::<f32>() / n
}

/// The indices of `completed` best first by [`mean_logprob`] (ties keep their order).
pub(crate) fn best_first(completed: &[Completed]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..completed.len()).collect();
    order.sort_by(|&a, &b| {
        mean_logprob(&completed[b])
            .partial_cmp(&mean_logprob(&completed[a]))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    order
}
