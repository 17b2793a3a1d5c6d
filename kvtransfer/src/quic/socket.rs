//! The UDP socket under a KV endpoint: quinn's own, with its GSO batches capped at 64 KiB.

use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, Runtime, UdpPoller};

/// The most UDP payload one send may carry over IPv4 (65,535 less the IP and UDP headers).
pub const MAX_UDP_SEND: usize = 65_507;

/// quinn's socket, reporting at most `max_segments` datagrams per GSO send.
///
/// quinn batches up to 10 datagrams of the path MTU in one `sendmsg`, and the kernel refuses a
/// batch over [`MAX_UDP_SEND`] with `EMSGSIZE`, which quinn-udp drops silently as it would an
/// MTU probe: with datagrams over 6,500 bytes every full batch was lost. Capping the batch at
/// `MAX_UDP_SEND / datagram size` keeps GSO for any datagram size up to 64 KiB.
pub(super) struct GsoCapped {
    inner: Arc<dyn AsyncUdpSocket>,
    max_segments: usize,
}

impl GsoCapped {
    /// Wraps `socket` for datagrams of up to `max_datagram` bytes.
    pub(super) fn wrap(
        socket: std::net::UdpSocket,
        max_datagram: u16,
    ) -> io::Result<Arc<dyn AsyncUdpSocket>> {
        let inner = quinn::TokioRuntime.wrap_udp_socket(socket)?;
        let max_segments = (MAX_UDP_SEND / usize::from(max_datagram.max(1))).max(1);
        Ok(Arc::new(Self {
            inner,
            max_segments,
        }))
    }
}

impl fmt::Debug for GsoCapped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GsoCapped")
            .field("inner", &self.inner)
            .field("max_segments", &self.max_segments)
            .finish()
    }
}

impl AsyncUdpSocket for GsoCapped {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        self.inner.try_send(transmit)
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments().min(self.max_segments)
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}
