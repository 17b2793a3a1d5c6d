//! Which backend reaches a decode node: shared memory for one on the sender's own host, the
//! configured network backend otherwise, with no flag (issue 34).
//!
//! A decode node serves shared memory beside its network endpoint and names both, with its
//! host id (membership's `host_id`: machine id and boot id), in each reservation. The sender
//! compares that host id with its own: equal and non-empty, it pushes through shared memory;
//! otherwise over the network. Shared memory that cannot be dialled (two containers that share
//! a kernel and an image's machine id but not `/dev/shm`) falls back to the network, with a
//! warning, so a wrong guess costs speed, never the request.
//!
//! Shared memory as the configured backend (`--kv-transport shm`) is refused for a decode
//! node whose reservation names another host: its socket would not be there on a real second
//! host, and between network namespaces on one kernel it would be, unauthenticated as across
//! hosts (issue 34).

use std::sync::atomic::{AtomicBool, Ordering};

use kv_types::KvBackend;

use crate::backend::{BackendConnection, BackendTransport};
use crate::error::KvTransferError;
use crate::shm::ShmTransport;
use crate::transport::KvTransport;

/// Where a reservation says its KV goes.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvRoute<'a> {
    /// The network endpoint (`host:port`, or `unix:` for an shm-only node).
    pub kv_endpoint: &'a str,
    /// The shared-memory endpoint served beside it; empty when none is.
    pub kv_shm_endpoint: &'a str,
    /// The decode node's host id; empty when unknown.
    pub host_id: &'a str,
}

/// The configured backend plus, where allowed, shared memory for peers on this host.
pub struct PickingTransport {
    network: BackendTransport,
    same_host: Option<SameHost>,
    /// This node's host id, where known: an shm network backend reaches only it.
    host_id: String,
}

struct SameHost {
    shm: ShmTransport,
    host_id: String,
    /// Whether a failed shm dial was already logged at warn (later ones go to debug).
    warned: AtomicBool,
}

impl From<BackendTransport> for PickingTransport {
    fn from(network: BackendTransport) -> Self {
        Self {
            network,
            same_host: None,
            host_id: String::new(),
        }
    }
}

impl PickingTransport {
    /// Pushes through `shm` to decode nodes whose reservations name `host_id`, this host.
    /// An empty `host_id` (neither file readable) never matches.
    pub fn with_same_host_shm(mut self, shm: ShmTransport, host_id: String) -> Self {
        if !host_id.is_empty() {
            self.same_host = Some(SameHost {
                shm,
                host_id,
                warned: AtomicBool::new(false),
            });
        }
        self
    }

    /// Names this node's host, so that an shm network backend refuses decode nodes whose
    /// reservations name another one.
    pub fn on_host(mut self, host_id: String) -> Self {
        self.host_id = host_id;
        self
    }

    /// The configured backend.
    pub fn network(&self) -> &BackendTransport {
        &self.network
    }

    /// The backend a push to `route` would take, before any dial.
    pub fn pick(&self, route: &KvRoute<'_>) -> KvBackend {
        match &self.same_host {
            Some(s)
                if !route.kv_shm_endpoint.is_empty()
                    && !route.host_id.is_empty()
                    && route.host_id == s.host_id =>
            {
                KvBackend::Shm
            }
            _ => self.network.backend(),
        }
    }

    /// Connects to `route` by [`PickingTransport::pick`]; returns the connection and the
    /// backend it runs on.
    pub async fn connect_route(
        &self,
        route: &KvRoute<'_>,
    ) -> Result<(BackendConnection, KvBackend), KvTransferError> {
        if let (KvBackend::Shm, Some(s)) = (self.pick(route), &self.same_host) {
            // The receiver's certificate is checked by the name QUIC would check.
            let server_name = host_of(route.kv_endpoint);
            match s.shm.connect_as(route.kv_shm_endpoint, server_name).await {
                Ok(conn) => return Ok((BackendConnection::Shm(conn), KvBackend::Shm)),
                Err(e) => {
                    if s.warned.swap(true, Ordering::Relaxed) {
                        tracing::debug!(endpoint = route.kv_shm_endpoint, error = %e, "kv shm dial failed; pushing over the network");
                    } else {
                        tracing::warn!(endpoint = route.kv_shm_endpoint, error = %e, "kv shm dial failed for a decode node on this host; pushing over the network");
                    }
                }
            }
        }
        if self.network.backend() == KvBackend::Shm
            && !self.host_id.is_empty()
            && !route.host_id.is_empty()
            && route.host_id != self.host_id
        {
            return Err(KvTransferError::Connect {
                endpoint: route.kv_endpoint.to_owned(),
                reason: format!(
                    "the shm KV transport reaches only decode nodes on this host ({}), and this one is on host {}; use --kv-transport quic, tcp or ucx across hosts",
                    self.host_id, route.host_id
                ),
            });
        }
        let conn = self.network.connect(route.kv_endpoint).await?;
        Ok((conn, self.network.backend()))
    }
}

/// The host of `host:port` (`[v6]:port` too); `localhost` for anything else.
fn host_of(endpoint: &str) -> &str {
    let Some((host, _port)) = endpoint.rsplit_once(':') else {
        return "localhost";
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() || endpoint.starts_with(crate::shm::SHM_SCHEME) {
        "localhost"
    } else {
        host
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::TcpTransport;

    fn picker() -> PickingTransport {
        PickingTransport::from(BackendTransport::Tcp(TcpTransport::default()))
            .with_same_host_shm(ShmTransport::default(), "m/b".into())
    }

    #[test]
    fn shm_only_for_a_reservation_naming_this_host_and_an_shm_endpoint() {
        let p = picker();
        let route = |shm, host| KvRoute {
            kv_endpoint: "10.0.0.2:7000",
            kv_shm_endpoint: shm,
            host_id: host,
        };
        assert_eq!(
            p.pick(&route("unix:/dev/shm/x.sock", "m/b")),
            KvBackend::Shm
        );
        assert_eq!(
            p.pick(&route("unix:/dev/shm/x.sock", "m/c")),
            KvBackend::Tcp
        );
        assert_eq!(p.pick(&route("", "m/b")), KvBackend::Tcp);
        assert_eq!(p.pick(&route("unix:/dev/shm/x.sock", "")), KvBackend::Tcp);
        let off = PickingTransport::from(BackendTransport::Tcp(TcpTransport::default()));
        assert_eq!(
            off.pick(&route("unix:/dev/shm/x.sock", "m/b")),
            KvBackend::Tcp
        );
        let unknown_host = PickingTransport::from(BackendTransport::Tcp(TcpTransport::default()))
            .with_same_host_shm(ShmTransport::default(), String::new());
        assert_eq!(
            unknown_host.pick(&route("unix:/dev/shm/x.sock", "")),
            KvBackend::Tcp
        );
    }

    #[test]
    fn the_server_name_is_the_network_endpoints_host() {
        assert_eq!(host_of("decode-0.svc:7000"), "decode-0.svc");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("unix:/dev/shm/x.sock"), "localhost");
        assert_eq!(host_of("nohost"), "localhost");
    }

    #[tokio::test]
    async fn an_shm_transport_refuses_a_decode_node_on_another_host() {
        let shm = || PickingTransport::from(BackendTransport::Shm(ShmTransport::default()));
        let route = |host| KvRoute {
            kv_endpoint: "unix:/nonexistent/fission-kv.sock",
            kv_shm_endpoint: "",
            host_id: host,
        };
        let Err(err) = shm()
            .on_host("m/b".into())
            .connect_route(&route("m/c"))
            .await
        else {
            panic!("an shm push to another host was dialled");
        };
        assert!(
            err.to_string()
                .contains("reaches only decode nodes on this host"),
            "{err}"
        );
        // The same host (or an unknown one) is dialled: here a missing socket, not the rule.
        for (own, theirs) in [("m/b", "m/b"), ("", "m/c"), ("m/b", "")] {
            let Err(err) = shm()
                .on_host(own.into())
                .connect_route(&route(theirs))
                .await
            else {
                panic!("{own} -> {theirs}: a missing socket was dialled");
            };
            assert!(
                !err.to_string().contains("reaches only decode nodes"),
                "{own} -> {theirs}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn an_shm_endpoint_that_cannot_be_dialled_falls_back_to_the_network() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let route = KvRoute {
            kv_endpoint: &addr,
            kv_shm_endpoint: "unix:/nonexistent/fission-kv.sock",
            host_id: "m/b",
        };
        let (_conn, backend) = picker().connect_route(&route).await.unwrap();
        assert_eq!(backend, KvBackend::Tcp);
    }
}
