//! Who is on the other end of a UCX control connection, before it learns anything that lets
//! it write.
//!
//! A TCP socket has no `SO_PEERCRED`, but a peer on this host (in this network namespace)
//! has its end of the connection in `/proc/net/tcp` or `tcp6`, with the uid that owns it:
//! the entry whose local address is the peer's and whose remote address is ours. Finding it
//! proves the peer is local and says its user; not finding it means the peer is on another
//! host (or in another network namespace), which only insecure mode accepts.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Where the peer of an accepted connection runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PeerOrigin {
    /// On this host, as this user.
    Local { uid: u32 },
    /// Not in this host's socket table.
    Remote,
}

/// Looks up the peer's socket: `peer` is the accepted connection's remote address, `local`
/// its local one.
pub(crate) fn peer_origin(peer: SocketAddr, local: SocketAddr) -> PeerOrigin {
    let (peer, local) = (canonical(peer), canonical(local));
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        if let Some(uid) = find_uid(&text, peer, local) {
            return PeerOrigin::Local { uid };
        }
    }
    PeerOrigin::Remote
}

/// An IPv4-mapped IPv6 address as the IPv4 one, so both tables compare alike.
fn canonical(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), addr.port()),
            None => addr,
        },
        IpAddr::V4(_) => addr,
    }
}

/// The uid of the entry whose local address is `peer` and remote address is `local`.
fn find_uid(table: &str, peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (l, r, uid) = (fields.get(1)?, fields.get(2)?, fields.get(7)?);
        (parse_addr(l)? == peer && parse_addr(r)? == local)
            .then(|| uid.parse().ok())
            .flatten()
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6): the kernel prints each 32-bit
/// word of the address as a host-order integer, and the port in host order.
fn parse_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut octets = [0u8; 16];
            for i in 0..4 {
                octets[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_table() {
        // x86-64 (little-endian) output: 127.0.0.1:8080 talking to 127.0.0.1:40000, uid 1000.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
            \x20  0: 0100007F:1F90 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 1234 1 0 20 4 30 10 -1\n";
        if cfg!(target_endian = "little") {
            let a: SocketAddr = "127.0.0.1:8080".parse().unwrap();
            let b: SocketAddr = "127.0.0.1:40000".parse().unwrap();
            assert_eq!(find_uid(table, a, b), Some(1000));
            assert_eq!(find_uid(table, b, a), None);
        }
        assert_eq!(
            parse_addr("00000000000000000000000001000000:0050"),
            Some("[::1]:80".parse().unwrap()).filter(|_| cfg!(target_endian = "little"))
        );
    }

    #[test]
    fn finds_a_connection_of_this_process_as_local_and_this_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        assert_eq!(
            peer_origin(peer, accepted.local_addr().unwrap()),
            PeerOrigin::Local { uid }
        );
        drop(client);
        // An address no socket here has.
        assert_eq!(
            peer_origin(
                "10.255.0.9:1".parse().unwrap(),
                accepted.local_addr().unwrap()
            ),
            PeerOrigin::Remote
        );
    }
}
