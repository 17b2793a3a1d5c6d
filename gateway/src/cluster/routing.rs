//! The routing policies live in the `routing-policy` crate, which the simulator shares; this
//! module keeps their gateway paths (`cluster::routing::...`).

pub use routing_policy::*;
