//! Picking a loopback TCP port for another process to bind: the one home of "find a free port".
//!
//! The usual trick, binding port 0 and closing the socket, hands out a port from the kernel's
//! ephemeral range. Between the check and the child's own bind, any outgoing connection on the
//! machine may take that very port as its source port, and the child then fails with "address
//! in use". A busy test run opens thousands of connections, and CI saw it happen. So the ports
//! given out here lie outside `ip_local_port_range`, where the kernel never picks source ports,
//! and one process hands out each port at most once per cycle through the range.

use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// The kernel's source-port range when it cannot be read (Linux's default).
const DEFAULT_EPHEMERAL: (u16, u16) = (32768, 60999);
/// Never below this: the well-known and registered ports that local services tend to hold.
const LOWEST: u16 = 10_000;

/// A TCP port on 127.0.0.1 that was free a moment ago and lies outside the kernel's ephemeral
/// range, for a child process to bind.
pub fn free_port() -> std::io::Result<u16> {
    let candidates = candidates();
    let next = cursor();
    for _ in 0..candidates.len().min(512) {
        let i = next.fetch_add(1, Ordering::Relaxed) as usize % candidates.len();
        let port = candidates.port(i);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    // Every candidate tried was taken: fall back to the kernel's choice, race and all.
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The ports outside the ephemeral range: below it down to [`LOWEST`], and above it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Candidates {
    below: (u16, u16),
    above: (u16, u16),
}

impl Candidates {
    fn from_ephemeral((lo, hi): (u16, u16)) -> Candidates {
        let below = (LOWEST, lo.max(LOWEST));
        let above = (hi.saturating_add(1).max(LOWEST), u16::MAX);
        let above = if hi == u16::MAX { (0, 0) } else { above };
        Candidates { below, above }
    }

    fn len(&self) -> usize {
        (self.below.1 - self.below.0) as usize + (self.above.1 - self.above.0) as usize
    }

    fn port(&self, i: usize) -> u16 {
        let below = (self.below.1 - self.below.0) as usize;
        if i < below {
            self.below.0 + i as u16
        } else {
            self.above.0 + (i - below) as u16
        }
    }
}

fn candidates() -> Candidates {
    static CANDIDATES: OnceLock<Candidates> = OnceLock::new();
    *CANDIDATES.get_or_init(|| {
        let c = Candidates::from_ephemeral(ephemeral_range().unwrap_or(DEFAULT_EPHEMERAL));
        // A kernel configured to use every port leaves nothing outside: use them all.
        if c.len() == 0 {
            Candidates::from_ephemeral((LOWEST, LOWEST))
        } else {
            c
        }
    })
}

/// Where this process starts in the candidates: random, so that processes picking at the
/// same time (test binaries, `fission up` and its tests) rarely pick the same port.
fn cursor() -> &'static AtomicU32 {
    static CURSOR: OnceLock<AtomicU32> = OnceLock::new();
    CURSOR.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        AtomicU32::new(h.finish() as u32)
    })
}

fn ephemeral_range() -> Option<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    parse_range(&text)
}

fn parse_range(text: &str) -> Option<(u16, u16)> {
    let mut it = text.split_whitespace().map(str::parse::<u16>);
    let (lo, hi) = (it.next()?.ok()?, it.next()?.ok()?);
    (lo <= hi).then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_avoid_the_ephemeral_range() {
        let c = Candidates::from_ephemeral((32768, 60999));
        assert_eq!(c.len(), (32768 - 10_000) + (65535 - 61000));
        assert_eq!(c.port(0), 10_000);
        assert_eq!(c.port(32768 - 10_000 - 1), 32767);
        assert_eq!(c.port(32768 - 10_000), 61000);
        assert_eq!(c.port(c.len() - 1), 65534);
        for i in (0..c.len()).step_by(97) {
            let p = c.port(i);
            assert!(!(32768..=60999).contains(&p), "{p}");
        }
    }

    #[test]
    fn odd_ranges_still_leave_ports() {
        assert_eq!(Candidates::from_ephemeral((1024, 65535)).len(), 0);
        assert!(Candidates::from_ephemeral((50000, 65535)).len() > 30_000);
        assert_eq!(parse_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_range("9 3"), None);
        assert_eq!(parse_range(""), None);
    }

    #[test]
    fn ports_are_free_distinct_and_outside_the_range() {
        let (lo, hi) = ephemeral_range().unwrap_or(DEFAULT_EPHEMERAL);
        let ports: Vec<u16> = (0..50).map(|_| free_port().expect("a port")).collect();
        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), ports.len(), "{ports:?}");
        for p in ports {
            assert!(!(lo..=hi).contains(&p) || lo <= LOWEST, "{p} in {lo}-{hi}");
            TcpListener::bind(("127.0.0.1", p)).expect("still free");
        }
    }
}
