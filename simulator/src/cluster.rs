//! What cluster is simulated: its shape (P prefill + D decode nodes, or N colocated nodes),
//! each node's scheduler settings (Fission's defaults), the gateway's routing policy and
//! limits, and the cost model.

use std::fmt;
use std::str::FromStr;

use engine::engine::EngineConfig;
use engine::scheduler::SchedulerConfig;
use routing_policy::PolicyKind;
use serde::Serialize;

use crate::cost::CostModel;

/// The nodes of the cluster, one GPU each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum Topology {
    /// Prefill nodes compute prompts and push their KV to decode nodes.
    Disaggregated { prefill: usize, decode: usize },
    /// Every node prefills (chunked, mixed into its decode steps) and decodes: Fission with
    /// `--prefill 0`, each decode node prefilling locally.
    Colocated { nodes: usize },
}

impl Topology {
    pub fn gpus(&self) -> usize {
        match *self {
            Topology::Disaggregated { prefill, decode } => prefill + decode,
            Topology::Colocated { nodes } => nodes,
        }
    }

    pub fn decode_nodes(&self) -> usize {
        match *self {
            Topology::Disaggregated { decode, .. } => decode,
            Topology::Colocated { nodes } => nodes,
        }
    }

    pub fn prefill_nodes(&self) -> usize {
        match *self {
            Topology::Disaggregated { prefill, .. } => prefill,
            Topology::Colocated { .. } => 0,
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Disaggregated { prefill, decode } => write!(f, "{prefill}P+{decode}D"),
            Topology::Colocated { nodes } => write!(f, "{nodes} colocated"),
        }
    }
}

/// `2P+6D` (or `2p6d`), or `8C` / `colocated:8`.
impl FromStr for Topology {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        let num = |x: &str| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("`{s}`: `{x}` is not a positive node count"))
        };
        if let Some(n) = t.strip_prefix("colocated:") {
            return Ok(Topology::Colocated { nodes: num(n)? });
        }
        if let Some(n) = t.strip_suffix('c') {
            return Ok(Topology::Colocated { nodes: num(n)? });
        }
        if let Some((p, d)) = t.split_once('p') {
            let d = d.trim_start_matches('+');
            if let Some(d) = d.strip_suffix('d') {
                return Ok(Topology::Disaggregated {
                    prefill: num(p)?,
                    decode: num(d)?,
                });
            }
        }
        Err(format!(
            "`{s}` is not a cluster: give P+D as `2P+6D`, or colocated nodes as `8C`"
        ))
    }
}

/// Each node's engine settings, by default the engine's (which the node binaries' flags,
/// `node-common`'s `EngineArgs`, default to).
#[derive(Debug, Clone, Serialize)]
pub struct NodeSettings {
    pub max_batch_prefill_tokens: usize,
    /// Defaults to every token the KV cache holds, as the engine does.
    pub max_batch_total_tokens: Option<usize>,
    pub max_num_seqs: usize,
    pub max_prefill_chunk_tokens: usize,
    pub enable_prefix_caching: bool,
    /// Decode nodes: the share of KV blocks that reservations for incoming pushes may hold.
    pub reservation_fraction: f64,
    /// KV blocks per node; the profile's when `None`.
    pub kv_blocks: Option<usize>,
    /// Every node runs on one machine and shares its cores (a test cluster on one host, as
    /// the validation runs are); `None` gives each node its own hardware, as a deployment does.
    pub shared_host: Option<SharedHost>,
}

/// One machine shared by all the simulated nodes: its cores, and its memory bandwidth. While
/// the steps computing ask for more of either than the host has, each advances at
/// 1 / [`Self::stretch`] of its speed alone (processor sharing, re-timed whenever a step
/// starts or ends). The profile's times are those of one node alone with `threads_per_node`
/// threads.
///
/// Two resources, because the steps differ: a prefill step keeps all its threads computing,
/// while a decode step of the small batches such a host serves streams every weight at the
/// host's read bandwidth (a batch-1 step measured at 99-104% of it) with its threads partly
/// idle. So two decode steps halve each other's speed (the bandwidth), a prefill beside a
/// decode step loses only the cores that step takes (`decode_step_cores`, measured), and two
/// prefills halve each other's speed (the cores).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SharedHost {
    pub cores: f64,
    pub threads_per_node: f64,
    /// Cores a decode-only step asks for, at most `threads_per_node`: the profile's
    /// `decode_step_cores` where calibration measured it.
    pub decode_step_cores: f64,
}

/// What a step asks of a [`SharedHost`]: cores, and the share of its read bandwidth.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Demand {
    pub cores: f64,
    pub bandwidth: f64,
}

impl std::ops::Add for Demand {
    type Output = Demand;
    fn add(self, o: Demand) -> Demand {
        Demand {
            cores: self.cores + o.cores,
            bandwidth: self.bandwidth + o.bandwidth,
        }
    }
}

impl SharedHost {
    /// A host of `cores` whose nodes run `threads_per_node` threads, each decode-only step
    /// asking for `decode_step_cores` of them (all when `None`).
    pub fn new(cores: f64, threads_per_node: f64, decode_step_cores: Option<f64>) -> SharedHost {
        SharedHost {
            cores,
            threads_per_node,
            decode_step_cores: decode_step_cores
                .unwrap_or(threads_per_node)
                .clamp(0.0, threads_per_node),
        }
    }

    /// What a step asks for: every thread's core while it computes prompt tokens (their
    /// weight reads are spread over many tokens' work); the measured cores and all the
    /// bandwidth for a decode-only step.
    pub fn demand(&self, prefill_tokens: usize) -> Demand {
        if prefill_tokens > 0 {
            Demand {
                cores: self.threads_per_node,
                bandwidth: 0.0,
            }
        } else {
            Demand {
                cores: self.decode_step_cores,
                bandwidth: 1.0,
            }
        }
    }

    /// The factor each step's time is stretched by while the steps computing ask for
    /// `demand` in all (this one's included).
    pub fn stretch(&self, demand: Demand) -> f64 {
        (demand.cores / self.cores).max(demand.bandwidth).max(1.0)
    }
}

impl Default for NodeSettings {
    /// The engine's own defaults ([`EngineConfig::default`]), which the node binaries' flags
    /// read too: one source, so a simulated node schedules as a node started without flags.
    fn default() -> Self {
        let e = EngineConfig::default();
        NodeSettings {
            max_batch_prefill_tokens: e.max_batch_prefill_tokens,
            max_batch_total_tokens: e.max_batch_total_tokens,
            max_num_seqs: e.max_num_seqs,
            max_prefill_chunk_tokens: e.max_prefill_chunk_tokens,
            enable_prefix_caching: e.enable_prefix_caching,
            reservation_fraction: e.reservation_fraction,
            kv_blocks: None,
            shared_host: None,
        }
    }
}

impl NodeSettings {
    pub fn scheduler_config(&self, kv_blocks: usize, block_size: usize) -> SchedulerConfig {
        SchedulerConfig {
            max_batch_prefill_tokens: self.max_batch_prefill_tokens,
            max_batch_total_tokens: self
                .max_batch_total_tokens
                .unwrap_or(kv_blocks * block_size),
            max_num_seqs: self.max_num_seqs,
            max_prefill_chunk_tokens: self.max_prefill_chunk_tokens,
            enable_prefix_caching: self.enable_prefix_caching,
        }
    }
}

/// The gateway's part: routing and admission, with its flags' defaults.
#[derive(Debug, Clone, Serialize)]
pub struct GatewaySettings {
    #[serde(serialize_with = "policy_name")]
    pub routing: PolicyKind,
    /// Disaggregated clusters: prompts shorter than this are prefilled on the decode node.
    pub max_local_prefill_tokens: usize,
    /// Requests on the nodes at once; the rest wait in the FIFO queue. `None`: no limit (the
    /// gateway's default is 128, which a large cluster raises).
    pub max_concurrent_requests: Option<usize>,
    /// Longest prompt + output accepted; longer requests fail validation (422).
    pub max_total_tokens: usize,
}

impl Default for GatewaySettings {
    /// The gateway's defaults (its `--routing`, `ClusterConfig::default` and
    /// `GatewayConfig::default`), but with no limit on requests at once. The simulator does not
    /// link the gateway, so they are written here and a test holds them to the gateway's.
    fn default() -> Self {
        GatewaySettings {
            routing: PolicyKind::CacheAware,
            max_local_prefill_tokens: 0,
            max_concurrent_requests: None,
            max_total_tokens: 4096,
        }
    }
}

fn policy_name<S: serde::Serializer>(p: &PolicyKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.as_str())
}

/// Everything one simulation needs besides the load.
#[derive(Debug, Clone, Serialize)]
pub struct SimCluster {
    pub topology: Topology,
    #[serde(skip)]
    pub cost: CostModel,
    pub profile: String,
    pub node: NodeSettings,
    pub gateway: GatewaySettings,
}

impl SimCluster {
    pub fn new(topology: Topology, cost: CostModel) -> Self {
        SimCluster {
            topology,
            profile: cost.name.clone(),
            cost,
            node: NodeSettings::default(),
            gateway: GatewaySettings::default(),
        }
    }

    pub fn kv_blocks(&self) -> usize {
        self.node.kv_blocks.unwrap_or(self.cost.node.kv_blocks)
    }

    pub fn label(&self) -> String {
        format!("{} ({})", self.topology, self.profile)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topologies_parse_and_print() {
        let t: Topology = "2P+6D".parse().expect("valid");
        assert_eq!(
            t,
            Topology::Disaggregated {
                prefill: 2,
                decode: 6
            }
        );
        assert_eq!(t.to_string(), "2P+6D");
        assert_eq!(
            "1p1d".parse::<Topology>(),
            Ok(Topology::Disaggregated {
                prefill: 1,
                decode: 1
            })
        );
        assert_eq!(
            "8C".parse::<Topology>(),
            Ok(Topology::Colocated { nodes: 8 })
        );
        assert_eq!(
            "colocated:2".parse::<Topology>(),
            Ok(Topology::Colocated { nodes: 2 })
        );
        assert!("0P+2D".parse::<Topology>().is_err());
        assert!("banana".parse::<Topology>().is_err());
        assert_eq!(t.gpus(), 8);
    }
}
