//! Reading a node's Prometheus exposition in tests: `GET /metrics` over a plain socket, one
//! sample's value out of the text, and the check that the text holds given lines and passes
//! promtool.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET /metrics` at `addr`; empty when the answer has none.
pub async fn scrape(addr: SocketAddr) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("response");
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

/// The value of the unlabelled sample `name` in an exposition text; 0 when it is absent.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Checks that `text` holds each of `lines` and passes `promtool check metrics` (skipped, loudly,
/// where promtool is not installed and not required).
pub fn assert_exposition(text: &str, lines: &[&str]) {
    for line in lines {
        assert!(text.contains(line), "{line} in\n{text}");
    }
    if let Some(report) = crate::promtool::check(text).expect("promtool passes") {
        println!("promtool check metrics: ok {report}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_reads_the_named_line_only() {
        let text = "# TYPE x_seconds histogram\nx_seconds_count 3\nx_seconds_sum 0.5\n";
        assert_eq!(sample(text, "x_seconds_count"), 3.0);
        assert_eq!(sample(text, "x_seconds_sum"), 0.5);
        assert_eq!(sample(text, "x_seconds"), 0.0);
    }
}
