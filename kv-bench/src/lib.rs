//! Tooling over [`kvtransfer`], kept out of the library the nodes link: the loopback benchmark
//! of whole transfers over each backend ([`bench`], `fission bench kvtransfer`), and a
//! loopback link that pushes a prompt's layers as they are computed ([`loopback`], timed by
//! `fission-loadtest simulate calibrate`).
//!
//! Both run a receiver and a sender in this process with the nodes' transports and default
//! settings. [`bench`] builds on [`loopback`]'s transfer and server, not the other way round.

pub mod bench;
pub mod loopback;

pub use bench::{run_bench, BenchBackend, BenchConfig, BenchReport, BenchRow};
pub use loopback::LoopbackLink;
