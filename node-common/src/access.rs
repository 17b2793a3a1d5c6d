//! Which peer may call which node method: the per-call half of the trust boundary (the TLS
//! handshake already refused anyone without a certificate from the cluster CA).
//!
//! Only the gateway starts work (Generate, Prefill) or drains a node; only a prefill node renews
//! and completes the reservations it fills; the gateway and operators' tools (`admin`) read a
//! node's info. A method missing from [`POLICY`] is refused to everyone, so a new RPC is closed
//! until someone decides who may call it.

use std::task::{Context, Poll};

use futures::future::{ready, Either, Ready};
use identity::{GrpcSecurity, PeerRole};
use proto::v1::{decode_server, node_server, prefill_server};
use tonic::body::Body;

use PeerRole::{Admin, Gateway, Prefill};

/// `(service, method, roles allowed)`, for every method of every node service.
pub const POLICY: &[(&str, &str, &[PeerRole])] = &[
    (node_server::SERVICE_NAME, "Info", &[Gateway, Admin]),
    (node_server::SERVICE_NAME, "Drain", &[Gateway, Admin]),
    (node_server::SERVICE_NAME, "CacheEvents", &[Gateway]),
    (decode_server::SERVICE_NAME, "Generate", &[Gateway]),
    (decode_server::SERVICE_NAME, "Done", &[Prefill]),
    (decode_server::SERVICE_NAME, "Renew", &[Prefill]),
    (prefill_server::SERVICE_NAME, "Prefill", &[Gateway]),
];

/// Whether a peer of `role` may call the gRPC `path` (`/service/method`); the refusal says
/// why.
pub fn check(path: &str, role: Option<PeerRole>) -> Result<(), tonic::Status> {
    let (service, method) = path
        .strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .unwrap_or(("", path));
    let allowed = POLICY
        .iter()
        .find(|(s, m, _)| *s == service && *m == method)
        .map_or(&[][..], |(_, _, roles)| *roles);
    match role {
        Some(role) if allowed.contains(&role) => Ok(()),
        Some(role) => Err(tonic::Status::permission_denied(format!(
            "a {role} certificate may not call {service}/{method}"
        ))),
        None => Err(tonic::Status::permission_denied(format!(
            "the peer's certificate names no role (SAN URI urn:fission:role:...), so it may not call {service}/{method}"
        ))),
    }
}

/// Checks every call against [`POLICY`] when the server is mutual TLS; lets everything through
/// on an `--insecure` server, which has no peer identity to check.
#[derive(Clone, Copy, Debug)]
pub struct AccessLayer {
    enforce: bool,
}

impl AccessLayer {
    pub fn new(security: &GrpcSecurity) -> Self {
        Self {
            enforce: !security.is_insecure(),
        }
    }
}

impl<S> tower::Layer<S> for AccessLayer {
    type Service = Access<S>;

    fn layer(&self, inner: S) -> Access<S> {
        Access {
            inner,
            enforce: self.enforce,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Access<S> {
    inner: S,
    enforce: bool,
}

impl<S, B> tower::Service<http::Request<B>> for Access<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Either<Ready<Result<http::Response<Body>, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if self.enforce {
            let role = GrpcSecurity::peer_role(request.extensions());
            if let Err(status) = check(request.uri().path(), role) {
                metrics::counter!(
                    "fission_node_grpc_denied_total",
                    "method" => request.uri().path().to_owned(),
                    "peer_role" => role.map_or("none", PeerRole::as_str),
                )
                .increment(1);
                tracing::warn!(
                    path = request.uri().path(),
                    peer_role = role.map_or("none", PeerRole::as_str),
                    "grpc call refused"
                );
                return Either::Left(ready(Ok(status.into_http())));
            }
        }
        Either::Right(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `rpc` of a node service in the proto has a policy entry: a method added to the
    /// proto without one would be refused to everyone, the gateway included.
    #[test]
    fn every_node_method_has_a_policy() {
        let proto = include_str!("../../proto/proto/fission.proto");
        let mut service = "";
        let mut methods = 0;
        for line in proto.lines().map(str::trim) {
            if let Some(rest) = line.strip_prefix("service ") {
                service = rest.split_whitespace().next().unwrap_or("");
            } else if let Some(rest) = line.strip_prefix("rpc ") {
                let method = rest.split('(').next().unwrap_or("").trim();
                let full = format!("fission.v1.{service}");
                assert!(
                    POLICY.iter().any(|(s, m, _)| *s == full && *m == method),
                    "{full}/{method} has no access policy"
                );
                methods += 1;
            }
        }
        assert_eq!(
            methods,
            POLICY.len(),
            "a policy entry names no proto method"
        );
    }

    #[test]
    fn only_the_gateway_starts_work_and_only_prefill_completes_it() {
        let ok = |path: &str, role| check(path, Some(role)).is_ok();
        assert!(ok("/fission.v1.Decode/Generate", Gateway));
        assert!(!ok("/fission.v1.Decode/Generate", Prefill));
        assert!(!ok("/fission.v1.Decode/Generate", Admin));
        assert!(ok("/fission.v1.Decode/Renew", Prefill));
        assert!(!ok("/fission.v1.Decode/Renew", Gateway));
        assert!(!ok("/fission.v1.Prefill/Prefill", PeerRole::Decode));
        assert!(ok("/fission.v1.Node/Drain", Admin));
        assert!(!ok("/fission.v1.Node/Drain", PeerRole::Decode));
        assert!(!ok("/fission.v1.Node/CacheEvents", Admin));
        assert!(!ok("/fission.v1.Other/Thing", Gateway));
        assert!(check("/fission.v1.Node/Info", None).is_err());
    }
}
