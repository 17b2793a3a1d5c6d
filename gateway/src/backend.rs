//! The seam between the HTTP front and whatever generates tokens: node routing over gRPC in
//! production, [`crate::fake::FakeBackend`] in tests.

use futures::future::BoxFuture;

use crate::error::GatewayError;
use crate::request::{TokenStream, ValidRequest};

/// Generates tokens for validated requests.
///
/// Contract:
/// - `generate` resolves once the request is accepted upstream (or refused: use
///   [`GatewayError::Backend`] with the upstream [`proto::ErrorCode`], or
///   [`GatewayError::Unavailable`]). It must not wait for the first token.
/// - The stream yields tokens in order and ends right after the token that carries a
///   `finish_reason`, or after an `Err`. Ending without either is reported to the client as an
///   error ("stream ended early").
/// - Dropping the stream cancels the request upstream and frees what it holds (KV blocks on every
///   node). The gateway drops it when the client disconnects, when the request times out, and
///   after the last token. A drop after the last token must be harmless.
/// - Admission, validation, timeouts and the HTTP shapes are the gateway's; a backend only
///   generates.
pub trait Backend: Send + Sync + 'static {
    fn generate(
        &self,
        request: ValidRequest,
    ) -> BoxFuture<'static, Result<TokenStream, GatewayError>>;

    /// Whether the backend can take requests now (`/health`).
    fn is_ready(&self) -> bool;

    /// The smallest context (prompt + generated tokens) among the nodes ready now, when known:
    /// the gateway lowers its limits to it, so it never admits what no node can hold.
    fn max_context(&self) -> Option<usize> {
        None
    }

    /// What `/info` reports under `backend`: nodes, their roles and state, and the like.
    fn describe(&self) -> serde_json::Value;

    /// What the nodes serve, as the first ready node that reports it says (see
    /// [`ModelTypes`]); `None` when no node has said.
    fn model_types(&self) -> Option<ModelTypes> {
        None
    }
}

/// The architecture and the weight and KV cache types the nodes serve: the ones admission
/// holds every member to (issues 32, 33).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ModelTypes {
    pub architecture: String,
    pub weight_dtype: String,
    pub kv_cache_dtype: String,
}

impl ModelTypes {
    /// A node's, from its `Info`; `None` from a node too old to say.
    pub fn of(info: &proto::v1::NodeInfo) -> Option<ModelTypes> {
        let kv_cache_dtype = info
            .layout
            .as_ref()
            .and_then(|l| kv_types::KvLayout::try_from(l).ok())
            .map(|l| l.dtype.to_string())
            .unwrap_or_default();
        (!info.architecture.is_empty()).then(|| ModelTypes {
            architecture: info.architecture.clone(),
            weight_dtype: info.weight_dtype.clone(),
            kv_cache_dtype,
        })
    }
}
