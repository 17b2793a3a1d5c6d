//! Which failures cost a retry: a node that fails a call as a dead, restarting or draining
//! node does is skipped for the next one, while a request a node refuses for what it is (a
//! validation error) fails at once, since every node would refuse it.

/// Prefill attempts for one request before the decode node prefills it itself.
pub(crate) const MAX_PREFILL_ATTEMPTS: usize = 3;

/// Codes a dead, restarting or draining node produces, or a broken connection to it; the
/// request itself was fine.
pub(crate) fn node_failed(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    ) || connection_broke(s)
}

/// Whether the gateway's own HTTP/2 client made `s` from a connection error rather than
/// the node sending it. tonic maps a GOAWAY ENHANCE_YOUR_CALM to RESOURCE_EXHAUSTED, which
/// from a node means "out of KV blocks": read so, it held requests in the queue as if the
/// pool were full, or failed them as 429 "overloaded".
fn connection_broke(s: &tonic::Status) -> bool {
    let mut source = std::error::Error::source(s);
    while let Some(e) = source {
        if e.is::<h2::Error>() {
            return true;
        }
        source = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::node_failed;

    #[test]
    fn a_goaway_is_a_node_failure_but_a_node_out_of_room_is_not() {
        let goaway =
            tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::ENHANCE_YOUR_CALM)));
        assert_eq!(goaway.code(), tonic::Code::ResourceExhausted);
        assert!(node_failed(&goaway));
        assert!(!node_failed(&tonic::Status::resource_exhausted(
            "out of KV blocks"
        )));
        assert!(!node_failed(&tonic::Status::invalid_argument("bad prompt")));
        assert!(node_failed(&tonic::Status::unavailable("draining")));
    }
}
