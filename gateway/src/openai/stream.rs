//! Streaming an OpenAI response: each token of each choice as one chunk, then the usage chunk
//! and `data: [DONE]`. Completions and chat differ only in what a chunk's choice holds, which
//! the caller makes; the envelope, the order and the ending are written once, here.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use serde::Serialize;

use super::{CommonFields, Usage};
use crate::error::GatewayError;
use crate::request::GeneratedToken;
use crate::sequences::Sequences;
use crate::sse::json_event;
use crate::state::{unix_now, AppState};

/// What every chunk of one streamed response repeats.
#[derive(Debug, Clone)]
pub(crate) struct ChunkHeader {
    pub id: String,
    /// `text_completion` or `chat.completion.chunk`.
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
}

/// One chunk as OpenAI spells it.
#[derive(Serialize)]
struct Chunk<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: &'a str,
    choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
}

impl ChunkHeader {
    /// The header of a response made now by this gateway's model.
    pub(crate) fn new(state: &AppState, id: String, object: &'static str) -> Self {
        ChunkHeader {
            id,
            object,
            created: unix_now(),
            model: state.config().model_id.clone(),
            system_fingerprint: state.system_fingerprint(),
        }
    }

    /// A chunk with these choices, and the usage when given.
    pub(crate) fn event<C: Serialize>(&self, choices: Vec<C>, usage: Option<Usage>) -> Event {
        json_event(&Chunk {
            id: &self.id,
            object: self.object,
            created: self.created,
            model: &self.model,
            system_fingerprint: &self.system_fingerprint,
            choices,
            usage,
        })
    }
}

/// The SSE response streaming every choice of `groups` (see [`merge_choices`]): `choice`
/// makes each token's choice, which goes out alone in a chunk under `header`; then the
/// ending [`sse_response`] describes.
pub(crate) fn stream_choices<C, F>(
    groups: Vec<Sequences>,
    header: ChunkHeader,
    common: &CommonFields,
    mut choice: F,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    C: Serialize + 'static,
    F: FnMut(usize, &GeneratedToken) -> C + Send + 'static,
{
    let (tokens, choices, prompt_tokens) = merge_choices(groups);
    let usage_header = header.clone();
    sse_response(
        tokens,
        choices,
        prompt_tokens,
        common,
        move |index, token| header.event(vec![choice(index, token)], None),
        move |usage| usage_header.event(Vec::<C>::new(), Some(usage)),
    )
}

/// Every choice's tokens as they come, each tagged with its choice's index.
type ChoiceTokens = BoxStream<'static, (usize, Result<GeneratedToken, GatewayError>)>;

/// The SSE response of a streaming request with `choices` choices, whose tokens `tokens`
/// yields tagged with their choice's index: `chunk` gives each token's event (with
/// `finish_reason` on a choice's last); after every choice's last, `usage_chunk` gives a final
/// chunk with `choices: []` and the usage when `include_usage`, then `data: [DONE]` (see
/// [`CommonFields::sends_done`]). A failed
/// stream ends with the error event instead, and no `[DONE]`; the other choices are dropped,
/// which cancels them upstream.
fn sse_response<C, U>(
    tokens: ChoiceTokens,
    choices: usize,
    prompt_tokens: usize,
    common: &CommonFields,
    mut chunk: C,
    usage_chunk: U,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>>
where
    C: FnMut(usize, &GeneratedToken) -> Event + Send + 'static,
    U: Fn(Usage) -> Event + Send + 'static,
{
    let include_usage = common.include_usage();
    let sends_done = common.sends_done();
    let mut completion_tokens = 0;
    let mut finished = 0;
    let mut failed = false;
    let events = tokens
        .map(move |(choice, item)| {
            if failed {
                return None;
            }
            Some(match item {
                Ok(token) => {
                    completion_tokens += 1;
                    let mut events = vec![chunk(choice, &token)];
                    if token.finish_reason.is_some() {
                        finished += 1;
                    }
                    if token.finish_reason.is_some() && finished == choices {
                        if include_usage {
                            events.push(usage_chunk(Usage::new(prompt_tokens, completion_tokens)));
                        }
                        if sends_done {
                            events.push(Event::default().data("[DONE]"));
                        }
                    }
                    events
                }
                Err(error) => {
                    failed = true;
                    vec![error.to_openai_sse_event()]
                }
            })
        })
        .take_while(|events| futures::future::ready(events.is_some()))
        .flat_map(|events| futures::stream::iter(events.unwrap_or_default().into_iter().map(Ok)));
    Sse::new(events).keep_alive(KeepAlive::default())
}

/// The choices of every group as one stream, tagged with their index in the response, and
/// the prompts' tokens together.
fn merge_choices(groups: Vec<Sequences>) -> (ChoiceTokens, usize, usize) {
    let per_group = groups.first().map_or(1, |g| g.streams.len());
    let choices = groups.len() * per_group;
    let prompt_tokens = groups.iter().map(|g| g.prompt_ids.len()).sum();
    let merged = futures::stream::select_all(groups.into_iter().enumerate().map(|(i, group)| {
        group
            .merged()
            .map(move |(j, item)| (i * per_group + j, item))
            .boxed()
    }))
    .boxed();
    (merged, choices, prompt_tokens)
}
