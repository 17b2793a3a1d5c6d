//! The simulator behind `fission-loadtest simulate`: a discrete-event simulation of a Fission
//! cluster (P prefill + D decode nodes, or N colocated nodes) on a virtual clock.
//!
//! It reuses rather than re-implements: each simulated node owns the engine's real
//! [`engine::scheduler::Scheduler`] (block accounting, chunked prefill, preemption, prefix
//! cache), driven through `schedule()` and `commit()` as the engine's step loop drives it; the
//! gateway's real routing policy ([`routing_policy`], the crate the gateway ranks with) ranks
//! the nodes. Only the model is replaced: a [`cost::CostModel`] turns each planned batch into a duration and each
//! prompt's KV into a transfer time. The load is the load generator's own: the same workloads,
//! arrival schedules, seeds, summaries, goodput, sweep, reports and plots, so a simulated level
//! reads like a measured one ([`loadgen`]).
//!
//! - [`cost`]: the KV link's timing, and the cost model with its JSON format and built-in
//!   profiles (`h100-llama8b`), re-exported from [`engine::cost`] where the mock engine shares
//!   them;
//! - [`fit`] and [`calibrate`]: fitting a linear cost model to measured engine step times;
//!   [`link_probe`]: measuring the KV link it gets; [`node_probe`]: what a node adds to the
//!   engine's steps;
//! - [`cluster`]: what is simulated; [`node`], [`events`] and [`simulate`]: the event loop;
//! - [`level`]: levels and sweeps as reports; [`plan`]: the P:D planner.
//!
//! The simulator is tooling: nothing that serves depends on it. The link it calibrates on is
//! [`kv_bench`]'s.
//!
//! Same seed, same result: the loop is single-threaded, events at equal times keep their push
//! order, and nothing reads a real clock except to report how long simulating took.

pub mod calibrate;
pub mod cluster;
pub mod cost;
pub(crate) mod events;
pub mod fit;
pub mod level;
pub mod link_probe;
pub(crate) mod node;
pub mod node_probe;
pub mod plan;
pub mod simulate;
#[cfg(test)]
mod tests;

pub use cluster::{GatewaySettings, NodeSettings, SimCluster, Topology};
pub use cost::CostModel;
pub use level::{simulate_level, simulate_run};
pub use plan::{plan, PlanConfig, PlanReport};
pub use routing_policy::PolicyKind;
