//! Fission's gRPC contracts and its one error-code table.
//!
//! This crate holds wire types only: no service logic, no engine, no networking beyond what
//! tonic generates. The KV vocabulary's conversions to and from the wire are in [`convert`].

pub mod convert;
mod error_code;

pub use error_code::ErrorCode;

/// Generated messages and clients/servers of `fission.v1`.
pub mod v1 {
    tonic::include_proto!("fission.v1");

    impl Token {
        /// The alternatives as `(token_id, logprob)`, most likely first.
        pub fn top_logprob_pairs(&self) -> Vec<(u32, f32)> {
            self.top_logprobs
                .iter()
                .map(|x| (x.token_id, x.logprob))
                .collect()
        }
    }
}

/// The W3C trace-context key carried in gRPC metadata and KV frame headers.
pub const TRACEPARENT: &str = "traceparent";
