//! The one way the end-to-end tests describe a `fission up` cluster: a builder over
//! [`UpConfig`] with the options the tests vary (node counts, KV transport, KV cache dtype,
//! model, node and cluster flags, environment, log file), and what they ask of the running
//! cluster beyond [`Up`]'s own reads (pushes by transport).

use std::path::PathBuf;

use crate::fission::{Up, UpConfig};

/// Builds an [`UpConfig`]: 1 prefill and 1 decode node serving stories260K, KV over QUIC,
/// until an option says otherwise.
#[derive(Clone, Debug)]
pub struct ClusterBuilder {
    config: UpConfig,
}

impl ClusterBuilder {
    /// `fission` is the binary under test (`env!("CARGO_BIN_EXE_fission")`).
    pub fn new(fission: impl Into<PathBuf>) -> Self {
        ClusterBuilder {
            config: UpConfig::new(fission, 1, 1),
        }
    }

    pub fn nodes(mut self, prefill: usize, decode: usize) -> Self {
        self.config.prefill = prefill;
        self.config.decode = decode;
        self
    }

    /// `--kv-transport`: `quic` (the default), `tcp`, `shm` or `ucx`.
    pub fn transport(mut self, transport: &str) -> Self {
        self.config.kv_transport = transport.into();
        self
    }

    /// Every node's `--kv-cache-dtype` (`f32`, `bf16`, `int8`).
    pub fn kv_dtype(self, dtype: &str) -> Self {
        self.node_arg(format!("--kv-cache-dtype={dtype}"))
    }

    /// The model directory every node and the gateway serve (stories260K by default).
    pub fn model(mut self, dir: impl Into<PathBuf>) -> Self {
        self.config.model = dir.into();
        self
    }

    /// Every node's `--num-kv-blocks` (512 by default).
    pub fn num_kv_blocks(mut self, blocks: usize) -> Self {
        self.config
            .node_args
            .retain(|a| !a.starts_with("--num-kv-blocks"));
        self.config
            .node_args
            .push(format!("--num-kv-blocks={blocks}"));
        self
    }

    /// A flag for every node (one that [`Self::num_kv_blocks`] or [`Self::kv_dtype`] does not
    /// set: a node takes each flag once).
    pub fn node_arg(mut self, arg: impl Into<String>) -> Self {
        self.config.node_args.push(arg.into());
        self
    }

    /// A flag of `fission up` itself (`--prefill-arg=...` reaches only the prefill nodes).
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.config.args.push(arg.into());
        self
    }

    /// An environment variable for `fission up` and the processes it starts.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.config.env.push((key.into(), value.into()));
        self
    }

    /// Where the cluster's stderr goes (inherited otherwise).
    pub fn log(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.log = Some(path.into());
        self
    }

    /// The configuration, for a test that needs an option no method above sets.
    pub fn config_mut(&mut self) -> &mut UpConfig {
        &mut self.config
    }

    /// Starts the cluster and returns once the gateway lists every node as ready.
    pub fn start(&self) -> Up {
        Up::start(&self.config)
    }
}

impl Up {
    /// KV pushes `node` (a prefill node) made over `transport`, by its
    /// `fission_prefill_kv_pushes_total{transport=...}` counter.
    pub fn kv_pushes(&self, node: &str, transport: &str) -> f64 {
        self.metric(
            node,
            &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
        )
    }
}
