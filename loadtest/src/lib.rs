//! Load generation over Fission's public HTTP API (TGI's `/generate_stream`), measured from the
//! client side: time to first token, time per output token, end-to-end latency and goodput.
//! It knows nothing of the cluster's internals.

pub mod measure;
pub mod prompt;
pub mod stats;
