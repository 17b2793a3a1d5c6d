//! The `Node` gRPC service every node serves beside its role's: `Info`, `Drain` and
//! `CacheEvents`, written once for both roles.

use std::sync::Arc;

use proto::v1::node_server::Node;
use proto::v1::{self, CacheEventsRequest, DrainRequest, DrainResponse, InfoRequest, NodeInfo};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cache_events::{CacheEventLog, CacheEventStream};

pub struct NodeService {
    pub(crate) info: NodeInfo,
    pub(crate) cache_log: Arc<CacheEventLog>,
    /// Cancelled by the Drain RPC: the same path as SIGTERM.
    pub(crate) drain: CancellationToken,
    /// Cancelled when the gRPC server stops: ends the streams that never end by themselves.
    pub(crate) stop_streams: CancellationToken,
}

/// Answers the Drain RPC: starts the same drain as SIGTERM by cancelling `shutdown`.
pub fn request_drain(shutdown: &CancellationToken, node_id: &str) -> DrainResponse {
    let started = !shutdown.is_cancelled();
    tracing::info!(%node_id, started, "drain requested over gRPC");
    shutdown.cancel();
    DrainResponse { started }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn info(&self, _: Request<InfoRequest>) -> Result<Response<NodeInfo>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<DrainResponse>, Status> {
        Ok(Response::new(request_drain(
            &self.drain,
            &self.info.node_id,
        )))
    }

    type CacheEventsStream = CacheEventStream;

    async fn cache_events(
        &self,
        _: Request<CacheEventsRequest>,
    ) -> Result<Response<CacheEventStream>, Status> {
        Ok(Response::new(
            self.cache_log.stream_until(self.stop_streams.clone()),
        ))
    }
}

impl NodeService {
    pub(crate) fn into_server(self) -> v1::node_server::NodeServer<NodeService> {
        v1::node_server::NodeServer::new(self)
    }
}
