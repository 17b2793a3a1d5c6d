//! Cancelling upstream: a reservation or running sequence on a decode node is cancelled when
//! the request that holds it gives up, and a client that drops its stream before the last
//! token cancels what the stream holds.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use proto::v1;

use super::pool::{InFlight, Node};
use crate::error::GatewayError;
use crate::request::{GeneratedToken, TokenStream};

/// Cancels a reservation or sequence on a decode node, without waiting.
#[derive(Clone)]
pub(crate) struct RemoteCancel {
    node: Arc<Node>,
    xfer_id: u64,
    /// The request's span, so the cancel joins its trace even when it fires from a `Drop`.
    span: tracing::Span,
}

impl RemoteCancel {
    pub(crate) fn new(node: Arc<Node>, xfer_id: u64) -> Self {
        RemoteCancel {
            node,
            xfer_id,
            span: tracing::Span::current(),
        }
    }

    pub(crate) fn fire(&self) {
        let mut client = self.node.decode_client();
        let request = self.span.in_scope(|| {
            telemetry::with_trace(v1::CancelRequest {
                request_id: String::new(),
                xfer_id: self.xfer_id,
            })
        });
        tokio::spawn(async move {
            let _ = client.cancel(request).await;
        });
    }
}

/// A token stream that cancels upstream when the client drops it before its last token, and
/// counts against its nodes while it lives.
pub(crate) struct Guarded {
    inner: TokenStream,
    cancel: Option<RemoteCancel>,
    finished: bool,
    _in_flight: Vec<InFlight>,
}

impl Guarded {
    /// `cancel` is `None` when nothing upstream needs cancelling (a local stream cancels
    /// itself when dropped) or when the request already ended.
    pub(crate) fn new(
        inner: TokenStream,
        cancel: Option<RemoteCancel>,
        finished: bool,
        in_flight: Vec<InFlight>,
    ) -> Self {
        Guarded {
            inner,
            cancel,
            finished,
            _in_flight: in_flight,
        }
    }
}

impl Stream for Guarded {
    type Item = Result<GeneratedToken, GatewayError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        match &polled {
            Poll::Ready(Some(Ok(t))) if t.finish_reason.is_some() => self.finished = true,
            Poll::Ready(Some(Err(_))) | Poll::Ready(None) => self.finished = true,
            _ => {}
        }
        polled
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        if !self.finished {
            if let Some(c) = &self.cancel {
                metrics::counter!("fission_gateway_client_cancelled_total").increment(1);
                c.fire();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use crate::backend::Backend;
    use crate::cluster::fake_nodes::{self, request, PrefillScript, ReserveScript};

    #[tokio::test]
    async fn a_client_that_leaves_mid_stream_cancels_the_decode_sequence() {
        let prefill = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let decode = fake_nodes::decode(ReserveScript::Reserve, None).await;
        let backend = fake_nodes::backend(&[&prefill], &[&decode]).await;

        let mut stream = backend.generate(request()).await.expect("served");
        let first = stream.next().await.expect("a token").expect("ok");
        assert_eq!(first.id, 100);
        assert!(decode.calls.of("cancel").is_empty());
        drop(stream);
        testkit::wait_until_async(
            "the cancel reaches the decode node",
            std::time::Duration::from_secs(5),
            || {
                let cancels = decode.calls.of("cancel");
                async move { cancels == ["1"] }
            },
        )
        .await;
    }

    #[tokio::test]
    async fn a_finished_stream_cancels_nothing() {
        let prefill = fake_nodes::prefill(PrefillScript::Answer(100)).await;
        let decode = fake_nodes::decode(ReserveScript::Reserve, Some(3)).await;
        let backend = fake_nodes::backend(&[&prefill], &[&decode]).await;

        let mut stream = backend.generate(request()).await.expect("served");
        while stream.next().await.is_some() {}
        drop(stream);
        // A second request's cancel would be "2": waiting for it shows the first never came.
        let mut again = backend.generate(request()).await.expect("served");
        again.next().await.expect("a token").expect("ok");
        drop(again);
        testkit::wait_until_async(
            "the second request's cancel",
            std::time::Duration::from_secs(5),
            || {
                let cancels = decode.calls.of("cancel");
                async move { !cancels.is_empty() }
            },
        )
        .await;
        assert_eq!(decode.calls.of("cancel"), vec!["2"]);
    }
}
