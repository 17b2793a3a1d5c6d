//! How the cluster backend treats nodes: stall deadlines, migration and local prefill. A leaf:
//! the backend, the route, placement and the driver all read it, and it reads none of them.

#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Prompts shorter than this are prefilled on the decode node itself.
    pub max_local_prefill_tokens: usize,
    /// How long a node working on a request may send nothing (and, while generating, no
    /// token) before it is suspect and the request moves on.
    pub max_stall: std::time::Duration,
    /// How many times one request may move to another decode node.
    pub migration_limit: usize,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            max_local_prefill_tokens: 0,
            max_stall: std::time::Duration::from_secs(3),
            migration_limit: 2,
        }
    }
}
