//! Which failures cost a retry: a node that fails a call as a dead, restarting or draining
//! node does is skipped for the next one, while a request a node refuses for what it is (a
//! validation error) fails at once, since every node would refuse it.

/// Prefill attempts for one request before the decode node prefills it itself.
pub(crate) const MAX_PREFILL_ATTEMPTS: usize = 3;

/// Codes a dead, restarting or draining node produces; the request itself was fine.
pub(crate) fn node_failed(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}
