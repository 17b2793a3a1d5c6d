//! Resuming a request whose prefill node died after answering but before its KV push ended.
//!
//! Until the decode stream's first item arrives, the decode node is waiting for KV that the
//! prefill node pushes after it has answered. If the prefill node dies in that window (its
//! connection breaks), the push will never finish, and the decode node would only give up when
//! the reservation's lease runs out. So the gateway releases the reservation and generates the
//! rest on a decode node, with the prompt plus the first token as the prompt. Positions are
//! unchanged, and a request's random draws depend only on its seed and the position, so the
//! tokens are those the interrupted run would have produced.

use std::sync::Arc;

use futures::StreamExt;
use tracing::Instrument;

use super::calls::colocated;
use super::cancel::RemoteCancel;
use super::pool::Node;
use crate::request::{TokenStream, ValidRequest};

/// The decode stream after the first token, watched until its first item arrives; see the
/// module docs.
pub(crate) fn watch_push(
    mut rest: TokenStream,
    mut lost: tokio::sync::watch::Receiver<u64>,
    resume: Resume,
) -> TokenStream {
    let continuation = async move {
        let mut watching = true;
        let head = loop {
            tokio::select! {
                biased;
                item = rest.next() => break Some(item),
                changed = lost.changed(), if watching => match changed {
                    Ok(()) => break None,
                    // The node left the pool cleanly; nothing more to watch.
                    Err(_) => watching = false,
                },
            }
        };
        match head {
            Some(item) => Box::pin(futures::stream::iter(item).chain(rest)) as TokenStream,
            None => resume.run().await,
        }
    }
    .instrument(tracing::Span::current());
    Box::pin(futures::stream::once(continuation).flatten())
}

/// What it takes to resume a request whose prefill node died before its KV push finished.
pub(crate) struct Resume {
    pub(crate) decodes: Vec<Arc<Node>>,
    pub(crate) request: ValidRequest,
    pub(crate) first_id: u32,
    /// The interrupted reservation, released first.
    pub(crate) cancel: RemoteCancel,
    pub(crate) prefill_node: String,
}

impl Resume {
    async fn run(self) -> TokenStream {
        self.cancel.fire();
        metrics::counter!("fission_gateway_resumed_total", "reason" => "prefill_lost").increment(1);
        tracing::warn!(
            request_id = %self.request.request_id,
            prefill_node = %self.prefill_node,
            "prefill node lost before its KV push finished; resuming on a decode node"
        );
        let mut r = self.request;
        r.prompt_ids.push(self.first_id);
        r.stopping.max_new_tokens = r.stopping.max_new_tokens.saturating_sub(1);
        match colocated(&self.decodes, &r).await {
            Ok(stream) => Box::pin(stream.map(|t| {
                t.map(|mut t| {
                    t.index += 1;
                    t
                })
            })),
            Err(e) => Box::pin(futures::stream::once(async move { Err(e) })),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::Backend;
    use crate::cluster::fake_nodes::{self, drain, request, PrefillScript, ReserveScript};
    use crate::request::FinishReason;

    #[tokio::test]
    async fn a_prefill_node_lost_before_its_push_ends_is_resumed_on_the_decode_node() {
        let dying = fake_nodes::prefill(PrefillScript::AnswerThenDie(100)).await;
        // The decode stream never yields: the KV of the dead node's push never arrives.
        let decode = fake_nodes::decode(ReserveScript::Reserve, None).await;
        let backend = fake_nodes::backend(&[&dying], &[&decode]).await;

        let (ids, indices, finish) =
            drain(backend.generate(request()).await.expect("served")).await;
        // The first token from the prefill node, then the rest generated on the decode node
        // from the prompt plus that token, at the positions they would have had.
        assert_eq!(
            decode.calls.of("local_generate"),
            vec!["11,12,13,14,15,100"]
        );
        assert_eq!(ids, vec![100, 200, 201, 202]);
        assert_eq!(indices, vec![0, 1, 2, 3]);
        assert_eq!(finish, Some(FinishReason::Length));
        // The interrupted reservation is released.
        testkit::wait_until_async(
            "the reservation's cancel",
            std::time::Duration::from_secs(5),
            || {
                let cancels = decode.calls.of("cancel");
                async move { cancels == ["1"] }
            },
        )
        .await;
    }
}
