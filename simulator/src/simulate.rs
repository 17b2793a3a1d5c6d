//! The discrete-event loop of one load level: requests arrive on the load generator's
//! schedule, the gateway's real routing policy places them, nodes step their real schedulers
//! on a virtual clock, and each request's TTFT, inter-token gaps and end come out as the load
//! generator's [`RequestRecord`]s.
//!
//! A request's path follows Fission's:
//! 1. the gateway validates it (`max_total_tokens`, else 422) and queues it FIFO, behind at
//!    most `max_concurrent_requests` requests on the nodes;
//! 2. it ranks the decode nodes with the policy and places the request on the first that
//!    takes it: a colocated request (no prefill node, or a prompt under
//!    `max_local_prefill_tokens`) joins that node's waiting queue; a disaggregated one
//!    reserves blocks for its prompt (refused when the node is out of blocks or of its
//!    reservation share). When every decode node refuses, the head of the queue waits;
//! 3. disaggregated: it ranks the prefill nodes and queues the prompt on the first, which
//!    computes it (chunked, batched with other prompts) and samples the first token: that is
//!    the TTFT. The KV is pushed over the prefill node's link (layer by layer during the last
//!    step, or after it) and joins the decode node's running batch when it arrives;
//! 4. every step a node samples one token per sequence whose chunk ends at its last known
//!    token; the request ends with its `output_len`-th token.
//!
//! The client-gateway and gateway-node network hops take no time; a request still unanswered
//! `request_timeout` after its arrival counts as a timeout, as the load generator counts it.

use std::collections::VecDeque;

use engine::ids::{BlockId, SeqId};
use engine::scheduler::NewSequence;
use routing_policy::{policy, RoutingPolicy};

use crate::cluster::{Demand, SimCluster, Topology};
use crate::cost::{kv_arrival_s, StepWork};
use crate::events::{Event, EventQueue};
use crate::node::{NodeRole, SimNode};
use loadgen::goodput::{Slo, ATTAINMENT_TARGET};
use loadgen::record::{ErrorKind, RequestRecord};
use loadgen::workload::RequestPlan;

/// The token every simulated step samples. Its value does not matter: generated blocks are
/// hashed after the prompt's, so they stay unique per request.
const SAMPLED_TOKEN: u32 = 1;

/// One request to simulate: its plan and when it arrives.
#[derive(Debug, Clone)]
pub struct SimRequest {
    pub plan: RequestPlan,
    pub arrival_s: f64,
}

/// How long to let a level run, and whether to stop as soon as it cannot meet the SLO.
#[derive(Debug, Clone, Copy)]
pub struct LevelLimits {
    pub request_timeout_s: f64,
    /// Stop once more than 10% of the level's requests are certain to miss the SLO: enough
    /// for a sweep or a plan, which only ask whether the level met it. The records are then
    /// incomplete (the rest count as timeouts).
    pub stop_when_missed: Option<Slo>,
}

/// A simulated level's records, and how far the virtual clock went.
#[derive(Debug, Clone)]
pub struct SimOutcome {
    pub records: Vec<RequestRecord>,
    pub end_s: f64,
    /// It stopped early: the SLO could no longer be met.
    pub stopped_early: bool,
    pub steps: u64,
}

struct ReqState {
    arrival_s: f64,
    input_len: usize,
    output_len: usize,
    prompt_ids: Vec<u32>,
    decode_node: usize,
    prefill_node: Option<usize>,
    reserved: Vec<BlockId>,
    first_s: Option<f64>,
    last_s: f64,
    tokens: usize,
    itl_s: Vec<f64>,
    done: bool,
    error: Option<ErrorKind>,
}

struct Sim<'a> {
    cluster: &'a SimCluster,
    policy: Box<dyn RoutingPolicy>,
    nodes: Vec<SimNode>,
    /// Indices into `nodes` by role.
    decode: Vec<usize>,
    prefill: Vec<usize>,
    reqs: Vec<ReqState>,
    queue: VecDeque<usize>,
    events: EventQueue,
    on_nodes: usize,
    unfinished: usize,
    steps: u64,
    now_s: f64,
    keep_itl: bool,
    /// Per node: the timing generation of its step (see [`Event::StepDone`]).
    step_gens: Vec<u64>,
    /// Per node, on a shared host: the step in progress as work left at full speed.
    shares: Vec<Option<Share>>,
}

/// A step in progress on a shared host: it advances at `rate` (1 alone, less while other
/// nodes compute: processor sharing) from `since_s`.
#[derive(Debug, Clone, Copy)]
struct Share {
    work_left_s: f64,
    rate: f64,
    since_s: f64,
    /// What the step asks of the host ([`crate::cluster::SharedHost::demand`]).
    demand: Demand,
}

/// Simulates `requests` (sorted by arrival) on `cluster`.
pub fn simulate(cluster: &SimCluster, requests: &[SimRequest], limits: LevelLimits) -> SimOutcome {
    let mut sim = Sim::new(cluster, requests, limits.stop_when_missed.is_none());
    for (i, r) in requests.iter().enumerate() {
        sim.events.push(r.arrival_s, Event::Arrival(i));
    }
    let check_every_s = 0.25;
    if limits.stop_when_missed.is_some() {
        sim.events.push(check_every_s, Event::Check);
    }
    let horizon_s = requests.last().map_or(0.0, |r| r.arrival_s) + limits.request_timeout_s;
    let mut stopped_early = false;
    while let Some((at_s, event)) = sim.events.pop() {
        if at_s > horizon_s {
            break;
        }
        sim.now_s = at_s;
        match event {
            Event::Arrival(i) => {
                sim.queue.push_back(i);
                sim.dispatch();
            }
            Event::StepDone(n, generation) => {
                if sim.step_gens[n] == generation {
                    sim.step_done(n);
                }
            }
            Event::KvArrived(i) => sim.kv_arrived(i),
            Event::Check => {
                if let Some(slo) = limits.stop_when_missed {
                    if sim.certainly_missed(&slo) {
                        stopped_early = true;
                        break;
                    }
                    if sim.unfinished > 0 {
                        sim.events.push(at_s + check_every_s, Event::Check);
                    }
                }
            }
        }
        if sim.unfinished == 0 {
            break;
        }
    }
    let end_s = sim.now_s;
    let timeout_s = limits.request_timeout_s;
    let records = sim
        .reqs
        .into_iter()
        .enumerate()
        .map(|(i, r)| record(i as u64, r, timeout_s))
        .collect();
    SimOutcome {
        records,
        end_s,
        stopped_early,
        steps: sim.steps,
    }
}

fn record(index: u64, r: ReqState, timeout_s: f64) -> RequestRecord {
    let mut error = r.error;
    let mut e2e_s = if r.done {
        r.last_s - r.arrival_s
    } else {
        timeout_s
    };
    if error.is_none() && (!r.done || e2e_s > timeout_s) {
        // The client cuts a request at its timeout.
        error = Some(ErrorKind::Timeout);
        e2e_s = timeout_s;
    }
    RequestRecord {
        index,
        sent_at_s: r.arrival_s,
        input_len: r.input_len,
        prompt_tokens: Some(r.input_len),
        output_len: r.output_len,
        output_tokens: r.tokens,
        // A first token after the client gave up was never seen.
        ttft_s: r
            .first_s
            .map(|f| f - r.arrival_s)
            .filter(|t| *t <= timeout_s),
        e2e_s,
        itl_s: r.itl_s,
        error,
    }
}

impl<'a> Sim<'a> {
    fn new(cluster: &'a SimCluster, requests: &[SimRequest], keep_itl: bool) -> Self {
        let mut nodes = Vec::new();
        let (p, d) = match cluster.topology {
            Topology::Disaggregated { prefill, decode } => (prefill, decode),
            Topology::Colocated { nodes } => (0, nodes),
        };
        for i in 0..p {
            nodes.push(SimNode::new(cluster, NodeRole::Prefill, i));
        }
        for i in 0..d {
            nodes.push(SimNode::new(cluster, NodeRole::Decode, i));
        }
        let vocab = cluster.cost.model.vocab_size as u32;
        let reqs = requests
            .iter()
            .map(|r| ReqState {
                arrival_s: r.arrival_s,
                input_len: r.plan.input_len,
                output_len: r.plan.output_len,
                prompt_ids: r.plan.token_ids(vocab),
                decode_node: usize::MAX,
                prefill_node: None,
                reserved: Vec::new(),
                first_s: None,
                last_s: 0.0,
                tokens: 0,
                itl_s: Vec::new(),
                done: false,
                error: None,
            })
            .collect();
        Sim {
            cluster,
            policy: policy(cluster.gateway.routing),
            nodes,
            prefill: (0..p).collect(),
            decode: (p..p + d).collect(),
            reqs,
            queue: VecDeque::new(),
            events: EventQueue::default(),
            on_nodes: 0,
            unfinished: requests.len(),
            steps: 0,
            now_s: 0.0,
            keep_itl,
            step_gens: vec![0; p + d],
            shares: vec![None; p + d],
        }
    }

    /// Places queued requests, in order, while the concurrency limit and the decode nodes'
    /// room allow.
    fn dispatch(&mut self) {
        while let Some(&i) = self.queue.front() {
            if self
                .cluster
                .gateway
                .max_concurrent_requests
                .is_some_and(|max| self.on_nodes >= max)
            {
                return;
            }
            let r = &self.reqs[i];
            if r.input_len + r.output_len > self.cluster.gateway.max_total_tokens {
                self.queue.pop_front();
                self.fail(i, ErrorKind::Http { status: 422 });
                continue;
            }
            if !self.place(i) {
                // The head keeps its turn while every decode node is out of blocks.
                return;
            }
            self.queue.pop_front();
        }
    }

    fn local_prefill(&self, i: usize) -> bool {
        self.prefill.is_empty()
            || self.reqs[i].input_len < self.cluster.gateway.max_local_prefill_tokens
    }

    fn place(&mut self, i: usize) -> bool {
        let block_size = self.cluster.cost.node.block_size;
        let hashes = prefix_hash::block_hashes(&self.reqs[i].prompt_ids, block_size);
        let prompt_tokens = self.reqs[i].input_len;
        let candidates: Vec<_> = self
            .decode
            .iter()
            .map(|&n| self.nodes[n].candidate(&hashes))
            .collect();
        let ranking = self
            .policy
            .rank_decode(prompt_tokens, block_size, &candidates);
        let local = self.local_prefill(i);
        let seq = NewSequence {
            seq_id: SeqId(i as u64),
            prompt_ids: self.reqs[i].prompt_ids.clone(),
            max_new_tokens: self.reqs[i].output_len,
        };
        for &k in &ranking.order {
            let n = self.decode[k];
            if local {
                if let Err(e) = self.nodes[n].sched.add(seq) {
                    tracing::debug!(error = %e, "a request the decode node cannot take");
                    self.fail(i, ErrorKind::Http { status: 422 });
                    return true;
                }
                self.reqs[i].decode_node = n;
                self.nodes[n].in_flight += 1;
                self.on_nodes += 1;
                self.kick(n);
                return true;
            }
            let Some(blocks) = self.nodes[n].reserve(prompt_tokens) else {
                continue;
            };
            self.reqs[i].decode_node = n;
            self.reqs[i].reserved = blocks;
            self.nodes[n].in_flight += 1;
            self.on_nodes += 1;
            self.start_prefill(i, &hashes);
            return true;
        }
        false
    }

    fn start_prefill(&mut self, i: usize, hashes: &[u64]) {
        let block_size = self.cluster.cost.node.block_size;
        let candidates: Vec<_> = self
            .prefill
            .iter()
            .map(|&n| self.nodes[n].candidate(hashes))
            .collect();
        let ranking = self
            .policy
            .rank_prefill(self.reqs[i].input_len, block_size, &candidates);
        let n = self.prefill[ranking.order[0]];
        let seq = NewSequence {
            seq_id: SeqId(i as u64),
            prompt_ids: self.reqs[i].prompt_ids.clone(),
            max_new_tokens: 1,
        };
        if let Err(e) = self.nodes[n].sched.add(seq) {
            tracing::debug!(error = %e, "a prompt the prefill node cannot take");
            self.release_reservation(i);
            self.fail(i, ErrorKind::Http { status: 422 });
            return;
        }
        self.reqs[i].prefill_node = Some(n);
        self.nodes[n].in_flight += 1;
        self.nodes[n].queued_prefill_tokens += self.reqs[i].input_len as u64;
        self.kick(n);
    }

    /// Starts node `n`'s next step if it is idle and has work.
    fn kick(&mut self, n: usize) {
        let Some(batch) = self.nodes[n].start_step(self.now_s) else {
            return;
        };
        let work = StepWork::of(batch);
        let cost = &self.cluster.cost;
        let mut step_s = cost.step_s(&work);
        if self.nodes[n].role == NodeRole::Prefill {
            // The step pushes its prompts' KV layer by layer as it computes them, on the
            // cores it computes on.
            step_s += cost.kv_bytes(work.prefill_tokens) * cost.link.push_step_s_per_byte;
        }
        self.steps += 1;
        if let Some(host) = self.cluster.node.shared_host {
            self.shares[n] = Some(Share {
                work_left_s: step_s,
                rate: 1.0,
                since_s: self.now_s,
                demand: host.demand(work.prefill_tokens),
            });
            self.reshare();
        } else {
            self.events
                .push(self.now_s + step_s, Event::StepDone(n, self.step_gens[n]));
        }
    }

    /// Shared host: the steps in progress advance at the rate the host now gives them; each
    /// is re-timed from here (its earlier end event goes stale).
    fn reshare(&mut self) {
        let Some(host) = self.cluster.node.shared_host else {
            return;
        };
        let demand = self
            .shares
            .iter()
            .flatten()
            .fold(Demand::default(), |sum, s| sum + s.demand);
        let rate = 1.0 / host.stretch(demand);
        let now = self.now_s;
        for (n, share) in self.shares.iter_mut().enumerate() {
            let Some(s) = share else {
                continue;
            };
            s.work_left_s = (s.work_left_s - (now - s.since_s) * s.rate).max(0.0);
            s.since_s = now;
            s.rate = rate;
            self.step_gens[n] += 1;
            self.events.push(
                now + s.work_left_s / rate,
                Event::StepDone(n, self.step_gens[n]),
            );
        }
    }

    fn step_done(&mut self, n: usize) {
        let now = self.now_s;
        let shared = self.shares[n].take().is_some();
        let (step, sampled) = self.nodes[n].finish_step(SAMPLED_TOKEN);
        for seq_id in sampled {
            let i = seq_id.0 as usize;
            match self.nodes[n].role {
                NodeRole::Prefill => {
                    // The first token goes to the client; the prompt's KV to the decode node.
                    self.nodes[n]
                        .sched
                        .finish(seq_id)
                        .expect("a sampled sequence is tracked");
                    let tokens = self.reqs[i].input_len;
                    self.nodes[n].queued_prefill_tokens -= tokens as u64;
                    self.token(i, now);
                    let (arrive_s, free_s) = kv_arrival_s(
                        &self.cluster.cost,
                        tokens,
                        step.start_s,
                        now,
                        self.nodes[n].link_free_s,
                    );
                    self.nodes[n].link_free_s = free_s;
                    self.events.push(arrive_s, Event::KvArrived(i));
                }
                NodeRole::Decode => {
                    self.token(i, now);
                    let done = self.nodes[n]
                        .sched
                        .sequence(seq_id)
                        .is_none_or(|s| s.is_done());
                    if done {
                        self.nodes[n]
                            .sched
                            .finish(seq_id)
                            .expect("a sampled sequence is tracked");
                        self.finish(i);
                    }
                }
            }
        }
        self.kick(n);
        if shared && self.shares[n].is_none() {
            // One fewer node computes: the others speed up from now.
            self.reshare();
        }
        if !self.queue.is_empty() {
            self.dispatch();
        }
    }

    fn kv_arrived(&mut self, i: usize) {
        let n = self.reqs[i].decode_node;
        if let Some(p) = self.reqs[i].prefill_node {
            self.nodes[p].in_flight -= 1;
        }
        let blocks = std::mem::take(&mut self.reqs[i].reserved);
        let seq = NewSequence {
            seq_id: SeqId(i as u64),
            prompt_ids: std::mem::take(&mut self.reqs[i].prompt_ids),
            max_new_tokens: self.reqs[i].output_len,
        };
        if self.nodes[n].activate(seq, blocks, SAMPLED_TOKEN) {
            self.kick(n);
        } else {
            // One token asked for: the first was all.
            self.finish(i);
            if !self.queue.is_empty() {
                self.dispatch();
            }
        }
    }

    fn release_reservation(&mut self, i: usize) {
        let n = self.reqs[i].decode_node;
        let blocks = std::mem::take(&mut self.reqs[i].reserved);
        self.nodes[n].reserved_blocks -= blocks.len();
        for b in blocks {
            self.nodes[n]
                .sched
                .allocator_mut()
                .free(b)
                .expect("reserved blocks are held once");
        }
    }

    fn token(&mut self, i: usize, now: f64) {
        let r = &mut self.reqs[i];
        if r.first_s.is_none() {
            r.first_s = Some(now);
        } else if self.keep_itl {
            r.itl_s.push(now - r.last_s);
        }
        r.last_s = now;
        r.tokens += 1;
    }

    fn finish(&mut self, i: usize) {
        let r = &mut self.reqs[i];
        r.done = true;
        r.prompt_ids = Vec::new();
        let n = r.decode_node;
        self.nodes[n].in_flight -= 1;
        self.on_nodes -= 1;
        self.unfinished -= 1;
    }

    fn fail(&mut self, i: usize, error: ErrorKind) {
        let r = &mut self.reqs[i];
        r.done = true;
        r.last_s = self.now_s;
        r.error = Some(error);
        r.prompt_ids = Vec::new();
        self.unfinished -= 1;
    }

    /// More than `1 - target` of all requests already miss the SLO, whatever happens next:
    /// finished and bad, or still without a first token past the TTFT SLO, or decoding too
    /// slowly to make the TPOT SLO even if every remaining token came at once.
    fn certainly_missed(&self, slo: &Slo) -> bool {
        let (ttft_s, tpot_s) = (slo.ttft_ms / 1e3, slo.tpot_ms / 1e3);
        let now = self.now_s;
        let bad = self
            .reqs
            .iter()
            .filter(|r| r.arrival_s <= now)
            .filter(|r| match r.first_s {
                None => r.done || now - r.arrival_s > ttft_s,
                Some(first) => {
                    first - r.arrival_s > ttft_s
                        || r.error.is_some()
                        || (r.output_len > 1
                            && (if r.done { r.last_s } else { now }) - first
                                > tpot_s * (r.output_len - 1) as f64)
                }
            })
            .count();
        let allowed = (1.0 - ATTAINMENT_TARGET) * self.reqs.len() as f64;
        bad as f64 > allowed + 1e-9
    }
}
