//! Load generation and measurement for LLM servers, from the client side: time to first token
//! (TTFT), time per output token (TPOT) and inter-token latency, end-to-end latency,
//! throughput, errors by kind, and goodput under a TTFT and a TPOT SLO (DistServe's
//! definition: the highest rate at which at least 90% of requests meet both).
//!
//! It speaks the streaming APIs that servers share, OpenAI's `/v1/completions` and
//! `/v1/chat/completions` and TGI's `/generate_stream`, so the same workload runs against
//! Fission's gateway, llama.cpp's `llama-server` or vLLM. The load generator knows nothing of
//! Fission's internals and must not: a result it prints is what any client of the server
//! would see: it depends on no other crate of the workspace. The simulator (the `simulator`
//! crate, `fission-loadtest simulate`) builds on this one with the engine's scheduler and the
//! gateway's routing policies.
//!
//! A run ([`run::run`]) is one load level or a rate sweep ([`sweep`]); a level sends
//! requests drawn from a [`workload`] on an open-loop [`arrival`] schedule or from a closed
//! loop of clients ([`driver`]); each request is timed by the [`client`] into a
//! [`record::RequestRecord`]; [`summary`] and [`goodput`] reduce a level's records; [`report`]
//! writes Markdown and JSON and [`plot`] SVG plots. Every level is bounded in time and in
//! requests, and traffic goes only to the given URL. The simulator runs the same levels,
//! sweeps and reports against a simulated cluster, and plans P:D splits.

pub mod arrival;
pub mod client;
pub mod config;
pub mod driver;
pub mod error;
pub mod goodput;
pub mod legacy;
pub mod levels;
pub mod plot;
pub mod progress;
pub mod prompt;
pub mod record;
pub mod report;
pub mod run;
pub mod stats;
pub mod summary;
pub mod sweep;
pub mod workload;

pub use config::{Api, Bounds, LoadConfig, LoadPlan, LoadShape, Target};
pub use error::LoadError;
pub use goodput::Slo;
pub use report::RunReport;
pub use run::run;
pub use workload::{WorkloadConfig, WorkloadKind};
