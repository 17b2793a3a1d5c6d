//! Pluggable routing policies: which prefill node computes a prompt and which decode node
//! generates from it. A leaf crate, so that the gateway and the simulator
//! (`fission-loadtest simulate`) rank nodes with the same code and the simulator needs no
//! gateway.
//!
//! A policy ranks the ready nodes of one role, best first; the caller tries them in that order,
//! so a node that refuses (a decode node out of blocks by the time `Reserve` arrives) costs
//! one retry instead of the request. Policies only read the [`Candidate`] figures they are
//! given and keep no per-node state, so they are easy to test and to swap with `--routing`.
//!
//! Figures per candidate: `free`/`total` KV blocks, `running` sequences and `queued` prefill
//! tokens as the node last published them (up to 500 ms old), `in_flight` requests the gateway
//! has sent there and not finished (fresh, so it covers what the published figures miss), and
//! `cached` blocks: the leading run of the prompt's block hashes the node holds (the gateway's
//! prefix index). For a prompt of `prompt_tokens` tokens,
//! `needed = ceil(prompt_tokens / block_size)` blocks, and a decode node has room when
//! `total > 0 && free >= needed`.
//!
//! - `round-robin`: candidates sorted by node id, rotated one step per call (decode and
//!   prefill rotate separately). Ignores load and room on purpose: it is the baseline.
//! - `least-loaded`:
//!   - decode: nodes without room last, then by `in_flight + running`, then most `free`.
//!   - prefill: by `queued + in_flight * prompt_tokens` (other in-flight prompts are assumed
//!     to be as long as this one, since the gateway does not track their length).
//! - `cache-aware`:
//!   - decode: nodes without room last, then by
//!     `cost = 0.5 * (total - free + needed) / total + 0.5 * batch / max_batch`,
//!     where `batch = running + in_flight` and `max_batch` is the largest `batch` among the
//!     candidates (at least 1). The first term is the block use after admitting this prompt
//!     (high use means preemption soon), the second the relative batch size (a bigger batch
//!     means slower steps for every sequence in it); both lie in `[0, 1]`.
//!   - prefill: by `cost = queued + in_flight * prompt_tokens + prompt_tokens - cached_tokens`
//!     with `cached_tokens = min(cached * block_size, prompt_tokens)`: the tokens the node
//!     must compute before this prompt's first token. This is
//!     `queued + in_flight_tokens - cached_tokens` plus a term equal for every candidate, so it
//!     ranks the same without needing a clamp at 0 that would tie a busy node holding a long
//!     prefix with an idle one. The prefix holder wins unless its queue exceeds the others'
//!     by more than the tokens it saves.
//!
//! Every policy breaks ties by node id, so equal nodes are picked in a stable order.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

/// One ready node of the role being routed, with the figures policies rank by.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Candidate {
    pub node_id: String,
    pub free_blocks: u64,
    pub total_blocks: u64,
    pub running_sequences: u64,
    pub queued_prefill_tokens: u64,
    /// Requests the gateway has sent to this node and not seen finish.
    pub in_flight: u64,
    /// Leading prompt blocks this node holds in its prefix cache.
    pub cached_prefix_blocks: usize,
}

/// Candidates in the order to try them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ranking {
    /// Indices into the candidates, best first; empty only when there were none.
    pub order: Vec<usize>,
    /// Why the first was chosen, for logs and the `route` span.
    pub reason: String,
}

impl Ranking {
    fn none() -> Self {
        Ranking {
            order: Vec::new(),
            reason: "no candidates".to_string(),
        }
    }
}

pub trait RoutingPolicy: Send + Sync {
    fn name(&self) -> &'static str;
    fn rank_decode(&self, prompt_tokens: usize, block_size: usize, c: &[Candidate]) -> Ranking;
    fn rank_prefill(&self, prompt_tokens: usize, block_size: usize, c: &[Candidate]) -> Ranking;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum PolicyKind {
    RoundRobin,
    LeastLoaded,
    CacheAware,
}

impl PolicyKind {
    /// The name `--routing` and [`FromStr`] take.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoaded => "least-loaded",
            PolicyKind::CacheAware => "cache-aware",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown routing policy {given:?}: expected round-robin, least-loaded or cache-aware")]
pub struct UnknownPolicy {
    pub given: String,
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [
            PolicyKind::RoundRobin,
            PolicyKind::LeastLoaded,
            PolicyKind::CacheAware,
        ]
        .into_iter()
        .find(|kind| kind.as_str() == s)
        .ok_or_else(|| UnknownPolicy {
            given: s.to_string(),
        })
    }
}

pub fn policy(kind: PolicyKind) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::LeastLoaded => Box::new(LeastLoaded),
        PolicyKind::CacheAware => Box::new(CacheAware),
    }
}

/// Takes turns over the candidates sorted by node id.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next_decode: AtomicUsize,
    next_prefill: AtomicUsize,
}

impl RoundRobin {
    fn rotate(&self, next: &AtomicUsize, c: &[Candidate]) -> Ranking {
        if c.is_empty() {
            return Ranking::none();
        }
        let mut order = rank_by_key(c, |_| ());
        // Relaxed: concurrent callers only need distinct turns, not an order between them.
        let turn = next.fetch_add(1, AtomicOrdering::Relaxed) % order.len();
        order.rotate_left(turn);
        let reason = format!(
            "round-robin: node {} has turn {turn} of {}",
            c[order[0]].node_id,
            order.len()
        );
        Ranking { order, reason }
    }
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        PolicyKind::RoundRobin.as_str()
    }

    fn rank_decode(&self, _prompt_tokens: usize, _block_size: usize, c: &[Candidate]) -> Ranking {
        self.rotate(&self.next_decode, c)
    }

    fn rank_prefill(&self, _prompt_tokens: usize, _block_size: usize, c: &[Candidate]) -> Ranking {
        self.rotate(&self.next_prefill, c)
    }
}

/// Fewest requests on decode nodes, fewest queued tokens on prefill nodes.
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl RoutingPolicy for LeastLoaded {
    fn name(&self) -> &'static str {
        PolicyKind::LeastLoaded.as_str()
    }

    fn rank_decode(&self, prompt_tokens: usize, block_size: usize, c: &[Candidate]) -> Ranking {
        if c.is_empty() {
            return Ranking::none();
        }
        let needed = blocks_needed(prompt_tokens, block_size);
        let order = rank_by_key(c, |n| {
            (
                !has_room(n, needed),
                n.in_flight + n.running_sequences,
                u64::MAX - n.free_blocks,
            )
        });
        let best = &c[order[0]];
        let reason = format!(
            "least-loaded: node {} has {} running or in flight and {} free blocks{}",
            best.node_id,
            best.in_flight + best.running_sequences,
            best.free_blocks,
            no_room_note(best, needed),
        );
        Ranking { order, reason }
    }

    fn rank_prefill(&self, prompt_tokens: usize, _block_size: usize, c: &[Candidate]) -> Ranking {
        if c.is_empty() {
            return Ranking::none();
        }
        let load = |n: &Candidate| {
            n.queued_prefill_tokens
                .saturating_add(in_flight_tokens(n, prompt_tokens))
        };
        let order = rank_by_key(c, load);
        let best = &c[order[0]];
        let reason = format!(
            "least-loaded: node {} has {} prefill tokens queued or in flight",
            best.node_id,
            load(best)
        );
        Ranking { order, reason }
    }
}

/// Weighs block use against batch size on decode nodes, less the share of the prompt a
/// decode node already caches (it links those blocks instead of receiving them), and
/// discounts the prompt tokens a prefill node already caches.
#[derive(Debug, Default)]
pub struct CacheAware;

/// Weight of the block-use term of the decode cost.
const BLOCK_USE_WEIGHT: f64 = 0.5;
/// Weight of the batch-size term of the decode cost.
const BATCH_WEIGHT: f64 = 0.5;
/// Weight of the share of the prompt a decode node caches, taken off its cost: a later turn of
/// a chat goes back to the node holding the conversation, whose push then carries only the new
/// blocks (issue 34), unless that node is much busier (a whole prompt cached is worth half
/// the batch range).
const CACHED_WEIGHT: f64 = 0.25;

impl RoutingPolicy for CacheAware {
    fn name(&self) -> &'static str {
        PolicyKind::CacheAware.as_str()
    }

    fn rank_decode(&self, prompt_tokens: usize, block_size: usize, c: &[Candidate]) -> Ranking {
        if c.is_empty() {
            return Ranking::none();
        }
        let needed = blocks_needed(prompt_tokens, block_size);
        let batch = |n: &Candidate| n.running_sequences + n.in_flight;
        let max_batch = c.iter().map(batch).max().unwrap_or(0).max(1);
        let block_use = |n: &Candidate| {
            if n.total_blocks == 0 {
                // A node that has not published its size is treated as full.
                return 1.0;
            }
            let used = n.total_blocks.saturating_sub(n.free_blocks) + needed;
            used as f64 / n.total_blocks as f64
        };
        // The push always carries the prompt's last block.
        let cached_share = |n: &Candidate| {
            (n.cached_prefix_blocks as u64).min(needed.saturating_sub(1)) as f64
                / needed.max(1) as f64
        };
        let cost = |n: &Candidate| {
            BLOCK_USE_WEIGHT * block_use(n) + BATCH_WEIGHT * batch(n) as f64 / max_batch as f64
                - CACHED_WEIGHT * cached_share(n)
        };
        let order = rank_by_key(c, |n| (!has_room(n, needed), Cost(cost(n))));
        let best = &c[order[0]];
        let reason = format!(
            "cache-aware: node {} has decode cost {:.3} (block use {:.2} after {needed} more blocks, batch {} of max {max_batch}, {:.0}% of the prompt cached){}",
            best.node_id,
            cost(best),
            block_use(best),
            batch(best),
            100.0 * cached_share(best),
            no_room_note(best, needed),
        );
        Ranking { order, reason }
    }

    fn rank_prefill(&self, prompt_tokens: usize, block_size: usize, c: &[Candidate]) -> Ranking {
        if c.is_empty() {
            return Ranking::none();
        }
        let prompt = prompt_tokens as u64;
        let cached_tokens = |n: &Candidate| {
            ((n.cached_prefix_blocks as u64).saturating_mul(block_size as u64)).min(prompt)
        };
        let cost = |n: &Candidate| {
            n.queued_prefill_tokens
                .saturating_add(in_flight_tokens(n, prompt_tokens))
                .saturating_add(prompt - cached_tokens(n))
        };
        let order = rank_by_key(c, cost);
        let best = &c[order[0]];
        let reason = format!(
            "cache-aware: node {} has {} tokens to compute first ({} queued, {} in flight, {} of {prompt} prompt tokens cached)",
            best.node_id,
            cost(best),
            best.queued_prefill_tokens,
            in_flight_tokens(best, prompt_tokens),
            cached_tokens(best),
        );
        Ranking { order, reason }
    }
}

/// Blocks the prompt's KV occupies on a decode node.
fn blocks_needed(prompt_tokens: usize, block_size: usize) -> u64 {
    // A block size of 0 is a misconfiguration; counting one token per block keeps the room
    // check conservative instead of dividing by zero.
    prompt_tokens.div_ceil(block_size.max(1)) as u64
}

fn has_room(n: &Candidate, needed: u64) -> bool {
    n.total_blocks > 0 && n.free_blocks >= needed
}

/// Estimated prompt tokens of the requests in flight to a prefill node.
fn in_flight_tokens(n: &Candidate, prompt_tokens: usize) -> u64 {
    n.in_flight.saturating_mul(prompt_tokens as u64)
}

/// Marks a pick that is only the least bad: it is still tried, since its published free
/// blocks may be stale.
fn no_room_note(best: &Candidate, needed: u64) -> &'static str {
    if has_room(best, needed) {
        ""
    } else {
        "; no node has room for the prompt"
    }
}

/// Indices of `c` sorted by `key`, ties by node id.
fn rank_by_key<K: Ord>(c: &[Candidate], key: impl Fn(&Candidate) -> K) -> Vec<usize> {
    let mut order: Vec<usize> = (0..c.len()).collect();
    order.sort_by(|&a, &b| {
        key(&c[a])
            .cmp(&key(&c[b]))
            .then_with(|| c[a].node_id.cmp(&c[b].node_id))
    });
    order
}

/// A cost that sorts by [`f64::total_cmp`], so NaN cannot break the sort.
#[derive(Debug, Clone, Copy)]
struct Cost(f64);

impl PartialEq for Cost {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Cost {}

impl PartialOrd for Cost {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cost {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    /// An idle node with 100 free blocks of 100.
    fn node(id: &str) -> Candidate {
        Candidate {
            node_id: id.to_string(),
            free_blocks: 100,
            total_blocks: 100,
            ..Default::default()
        }
    }

    fn first(ranking: &Ranking, c: &[Candidate]) -> String {
        c[ranking.order[0]].node_id.clone()
    }

    fn ids(ranking: &Ranking, c: &[Candidate]) -> Vec<String> {
        ranking
            .order
            .iter()
            .map(|&i| c[i].node_id.clone())
            .collect()
    }

    #[test]
    fn policy_names_parse_and_match_clap() {
        for kind in PolicyKind::value_variants() {
            let clap_name = kind.to_possible_value().expect("no variant is skipped");
            assert_eq!(clap_name.get_name(), kind.as_str());
            assert_eq!(kind.as_str().parse::<PolicyKind>(), Ok(*kind));
            assert_eq!(policy(*kind).name(), kind.as_str());
            assert_eq!(kind.to_string(), kind.as_str());
        }
        let err = "fastest".parse::<PolicyKind>().unwrap_err();
        assert_eq!(err.given, "fastest");
    }

    #[test]
    fn every_policy_ranks_every_candidate_once_and_none_when_empty() {
        let c = [node("b"), node("a"), node("c")];
        for kind in PolicyKind::value_variants() {
            let p = policy(*kind);
            for ranking in [p.rank_decode(32, 16, &c), p.rank_prefill(32, 16, &c)] {
                let mut order = ranking.order.clone();
                order.sort_unstable();
                assert_eq!(order, vec![0, 1, 2], "{kind}");
                assert!(
                    ranking.reason.starts_with(kind.as_str()),
                    "{}",
                    ranking.reason
                );
            }
            let empty = p.rank_decode(32, 16, &[]);
            assert!(empty.order.is_empty());
            assert!(p.rank_prefill(32, 16, &[]).order.is_empty());
        }
    }

    #[test]
    fn round_robin_rotates_over_sorted_ids() {
        let p = RoundRobin::default();
        let c = [node("c"), node("a"), node("b")];
        let picks: Vec<String> = (0..4)
            .map(|_| first(&p.rank_decode(1, 16, &c), &c))
            .collect();
        assert_eq!(picks, ["a", "b", "c", "a"]);
        // The rest of the order follows the rotation, for retries.
        assert_eq!(ids(&p.rank_decode(1, 16, &c), &c), ["b", "c", "a"]);
        // Prefill keeps its own turn.
        assert_eq!(first(&p.rank_prefill(1, 16, &c), &c), "a");
    }

    #[test]
    fn least_loaded_decode_counts_running_and_in_flight_then_free_blocks() {
        let c = [
            Candidate {
                running_sequences: 3,
                ..node("a")
            },
            Candidate {
                running_sequences: 1,
                in_flight: 1,
                free_blocks: 10,
                ..node("b")
            },
            Candidate {
                in_flight: 2,
                free_blocks: 50,
                ..node("c")
            },
        ];
        let ranking = LeastLoaded.rank_decode(16, 16, &c);
        assert_eq!(ids(&ranking, &c), ["c", "b", "a"]);
        assert!(ranking.reason.contains("node c"), "{}", ranking.reason);
    }

    #[test]
    fn least_loaded_decode_puts_nodes_without_room_last() {
        let c = [
            Candidate {
                free_blocks: 1,
                ..node("idle-but-full")
            },
            Candidate {
                running_sequences: 8,
                ..node("busy")
            },
        ];
        let ranking = LeastLoaded.rank_decode(64, 16, &c);
        assert_eq!(ids(&ranking, &c), ["busy", "idle-but-full"]);
    }

    #[test]
    fn least_loaded_prefill_counts_queued_and_in_flight_tokens() {
        let c = [
            Candidate {
                queued_prefill_tokens: 300,
                ..node("a")
            },
            Candidate {
                in_flight: 2,
                ..node("b")
            },
        ];
        // b: 2 in flight * 100 = 200 < 300.
        assert_eq!(first(&LeastLoaded.rank_prefill(100, 16, &c), &c), "b");
        // b: 2 * 200 = 400 > 300.
        assert_eq!(first(&LeastLoaded.rank_prefill(200, 16, &c), &c), "a");
    }

    #[test]
    fn cache_aware_prefill_prefers_the_prefix_holder() {
        let c = [
            node("cold"),
            Candidate {
                queued_prefill_tokens: 100,
                cached_prefix_blocks: 32,
                ..node("warm")
            },
        ];
        // warm: 100 + 600 - 512 = 188 tokens; cold: 600.
        let ranking = CacheAware.rank_prefill(600, 16, &c);
        assert_eq!(ids(&ranking, &c), ["warm", "cold"]);
        assert!(ranking.reason.contains("512 of 600"), "{}", ranking.reason);
    }

    #[test]
    fn cache_aware_prefill_avoids_a_much_busier_prefix_holder() {
        let c = [
            node("cold"),
            Candidate {
                queued_prefill_tokens: 2000,
                cached_prefix_blocks: 32,
                ..node("warm")
            },
        ];
        // warm: 2000 + 600 - 512 = 2088 tokens; cold: 600.
        assert_eq!(first(&CacheAware.rank_prefill(600, 16, &c), &c), "cold");
    }

    #[test]
    fn cache_aware_prefill_ranks_a_busy_full_hit_below_an_idle_one() {
        // Both hold the whole prompt; with a clamp at 0 they would tie on cost.
        let c = [
            Candidate {
                queued_prefill_tokens: 50,
                cached_prefix_blocks: 100,
                ..node("a")
            },
            Candidate {
                cached_prefix_blocks: 100,
                ..node("b")
            },
        ];
        assert_eq!(first(&CacheAware.rank_prefill(160, 16, &c), &c), "b");
    }

    #[test]
    fn cache_aware_prefill_counts_in_flight_prompts() {
        let c = [
            Candidate {
                in_flight: 3,
                cached_prefix_blocks: 2,
                ..node("warm")
            },
            node("cold"),
        ];
        // warm: 3 * 64 + 64 - 32 = 224; cold: 64.
        assert_eq!(first(&CacheAware.rank_prefill(64, 16, &c), &c), "cold");
    }

    #[test]
    fn cache_aware_decode_puts_a_full_node_last() {
        let c = [
            Candidate {
                free_blocks: 3,
                ..node("full")
            },
            Candidate {
                free_blocks: 20,
                running_sequences: 30,
                in_flight: 2,
                ..node("busy")
            },
            Candidate {
                total_blocks: 0,
                free_blocks: 0,
                ..node("unreported")
            },
        ];
        // 64 tokens need 4 blocks; "full" has 3.
        let ranking = CacheAware.rank_decode(64, 16, &c);
        assert_eq!(ranking.order[0], 1);
        let mut last_two = ranking.order[1..].to_vec();
        last_two.sort_unstable();
        assert_eq!(last_two, [0, 2], "an unreported size counts as full");
        assert!(ranking.reason.contains("node busy"), "{}", ranking.reason);
        assert!(!ranking.reason.contains("no node has room"));

        let all_full = &c[..1];
        let ranking = CacheAware.rank_decode(64, 16, all_full);
        assert_eq!(ranking.order, [0]);
        assert!(
            ranking.reason.contains("no node has room"),
            "{}",
            ranking.reason
        );
    }

    #[test]
    fn cache_aware_decode_weighs_block_use_against_batch_size() {
        let c = [
            Candidate {
                free_blocks: 10,
                running_sequences: 2,
                ..node("a")
            },
            Candidate {
                free_blocks: 60,
                running_sequences: 4,
                ..node("b")
            },
            Candidate {
                free_blocks: 90,
                running_sequences: 8,
                ..node("c")
            },
        ];
        // After 1 block: a 0.5*0.91 + 0.5*0.25 = 0.58, b 0.5*0.41 + 0.5*0.5 = 0.455,
        // c 0.5*0.11 + 0.5*1 = 0.555.
        assert_eq!(
            ids(&CacheAware.rank_decode(16, 16, &c), &c),
            ["b", "c", "a"]
        );
    }

    #[test]
    fn cache_aware_decode_goes_back_to_the_node_holding_the_conversation() {
        let c = [
            Candidate {
                running_sequences: 2,
                ..node("idle")
            },
            Candidate {
                running_sequences: 3,
                cached_prefix_blocks: 9,
                ..node("warm")
            },
        ];
        // 160 tokens: 10 blocks, 9 cached on warm. idle 0.5*0.1 + 0.5*0.67 = 0.383; warm
        // 0.5*0.1 + 0.5*1 - 0.25*0.9 = 0.325.
        let ranking = CacheAware.rank_decode(160, 16, &c);
        assert_eq!(ids(&ranking, &c), ["warm", "idle"]);
        assert!(
            ranking.reason.contains("90% of the prompt cached"),
            "{}",
            ranking.reason
        );
        // A much busier holder loses it: warm 0.5*0.1 + 0.5*1 - 0.225 = 0.325 against idle's
        // 0.5*0.1 + 0.5*0.25 = 0.175.
        let busy = [
            Candidate {
                running_sequences: 2,
                ..node("idle")
            },
            Candidate {
                running_sequences: 8,
                cached_prefix_blocks: 9,
                ..node("warm")
            },
        ];
        assert_eq!(
            first(&CacheAware.rank_decode(160, 16, &busy), &busy),
            "idle"
        );
    }

    #[test]
    fn cache_aware_decode_counts_in_flight_as_batch() {
        let c = [
            Candidate {
                in_flight: 5,
                ..node("a")
            },
            Candidate {
                running_sequences: 1,
                ..node("b")
            },
        ];
        assert_eq!(first(&CacheAware.rank_decode(16, 16, &c), &c), "b");
    }

    #[test]
    fn ties_are_broken_by_node_id_whatever_the_input_order() {
        let forward = [node("a"), node("b"), node("c")];
        let backward = [node("c"), node("b"), node("a")];
        for c in [&forward[..], &backward[..]] {
            for p in [&LeastLoaded as &dyn RoutingPolicy, &CacheAware] {
                assert_eq!(ids(&p.rank_decode(16, 16, c), c), ["a", "b", "c"]);
                assert_eq!(ids(&p.rank_prefill(16, 16, c), c), ["a", "b", "c"]);
            }
        }
    }
}
