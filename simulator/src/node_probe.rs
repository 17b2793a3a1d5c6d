//! What a serving node's steps cost beyond the same steps of the engine alone, measured through
//! running clusters and folded into a calibrated profile.
//!
//! A node's step is the engine's, but it runs beside the node's own threads (gRPC, the KV push
//! and its receiver), the gateway's and the clients', and it samples as the requests ask. On
//! this 2-core machine that made a node's batch-1 decode step 10-15% slower than the engine's
//! and a prefill node's 128-token step ~35 ms slower, which a profile fitted on the engine alone
//! charged to the simulator. Here lone requests go through a one-node colocated cluster (and a
//! 1P+1D cluster, for the push), the nodes' own step histograms time them, and the engine times
//! the same steps in between, alternating, so that the machine's drift falls on both.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use engine::ids::SeqId;
use engine::model::LoadedModel;

use crate::calibrate::{median, time_decode_steps, time_prefill};
use crate::cost::{CostModel, StepCost};
use loadgen::client::Client;
use loadgen::config::{Api, Target};
use loadgen::error::LoadError;
use loadgen::prompt::exact_prompt;
use loadgen::workload::RequestSpec;

/// A running cluster: its gateway, and the metrics of the node whose steps are read.
#[derive(Debug, Clone)]
pub struct NodeEndpoint {
    pub gateway: String,
    pub metrics: String,
}

/// What to measure.
pub struct NodeProbe<'a> {
    pub model: &'a LoadedModel,
    /// A cluster of one colocated node: its prefill and decode steps.
    pub colocated: NodeEndpoint,
    /// A 1P+1D cluster, metrics of its prefill node: the step that pushes.
    pub disaggregated: Option<NodeEndpoint>,
    /// The prompt of every request, in tokens.
    pub prompt_tokens: usize,
    /// New tokens of the decode request: its decode steps run at batch 1 over the prompt
    /// and these.
    pub new_tokens: usize,
    pub rounds: usize,
    /// New tokens of each sequence of the decode batch a prefill step is timed beside
    /// (prompts of `prompt_tokens`): enough to outlast that step several times over.
    pub beside_new_tokens: usize,
    /// KV bytes a prompt of `prompt_tokens` pushes.
    pub prompt_kv_bytes: f64,
    /// `--prompt-style extra`'s ids, as the load generator sends them.
    pub first_extra_id: usize,
    pub vocab: usize,
}

/// Sequences in the decode batch a prefill step is timed beside.
const BESIDE_BATCH: usize = 4;

/// Node step ÷ engine step, the prefill node's extra seconds per pushed byte, and the cores
/// a decode step takes from a prefill beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeFactors {
    pub prefill: f64,
    pub decode: f64,
    pub push_step_s_per_byte: Option<f64>,
    /// [`CostModel::decode_step_cores`], from the prefill node's step beside a decoding
    /// node over its step alone.
    pub decode_step_cores: Option<f64>,
    pub report: String,
}

impl NodeFactors {
    /// Scales the profile's fitted steps to the node's, and prices the push as the prefill
    /// node paid it (replacing the loopback measure, which misses the receiver's process).
    pub fn apply(&self, profile: &mut CostModel) {
        if let StepCost::Linear(l) = &mut profile.step {
            for (fit, f) in [(&mut l.prefill, self.prefill), (&mut l.decode, self.decode)] {
                fit.a *= f;
                fit.b *= f;
                fit.c *= f;
            }
        }
        if let Some(p) = self.push_step_s_per_byte {
            profile.link.push_step_s_per_byte = p;
        }
        if self.decode_step_cores.is_some() {
            profile.decode_step_cores = self.decode_step_cores;
        }
    }
}

/// The cores a decode step asks of a host of `cores` whose nodes run a thread per core, from
/// a prefill step's time beside it over its time alone: processor sharing stretches both by
/// (cores + decode cores) / cores.
fn decode_step_cores(stretch: f64, cores: f64) -> f64 {
    (cores * (stretch - 1.0)).clamp(0.0, cores)
}

fn failed(reason: String) -> LoadError {
    LoadError::RequestFailed {
        what: "timing a node's steps".into(),
        reason,
    }
}

/// `name`'s `_sum` and `_count` in a Prometheus text page.
fn sum_count(page: &str, name: &str) -> Option<(f64, f64)> {
    let value = |suffix: &str| {
        page.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((value("_sum")?, value("_count")?))
}

impl NodeProbe<'_> {
    pub async fn run(&self) -> Result<NodeFactors, LoadError> {
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(LoadError::Client)?;
        let colocated = self.client(&self.colocated)?;
        let disaggregated = match &self.disaggregated {
            Some(e) => Some(self.client(e)?),
            None => None,
        };
        // First requests open connections and touch pages: not step time.
        self.send(&colocated, 2, 0).await?;
        if let Some(c) = &disaggregated {
            self.send(c, 2, 1).await?;
        }
        let mut rows = Vec::new();
        for r in 0..self.rounds.max(1) {
            let (l, n) = (self.prompt_tokens, self.new_tokens);
            let engine_prefill = self.blocking(move |m| time_prefill(m, l, r, None)).await?;
            let engine_decode = self
                .blocking(move |m| {
                    let mut id = 0;
                    let mut next_id = || {
                        id += 1;
                        SeqId(id)
                    };
                    let steps = time_decode_steps(m, 1, l + n / 2, 9, &mut next_id)?;
                    Ok(median(steps.into_iter().map(|t| t.0).collect()))
                })
                .await?;
            // One request of one new token is one prefill step on the node.
            let (sum, count) = self
                .node_steps(
                    &http,
                    &colocated,
                    &self.colocated,
                    "fission_decode_step_seconds",
                    1,
                    2 + 3 * r,
                )
                .await?;
            let prefill = sum / count;
            let (sum, count) = self
                .node_steps(
                    &http,
                    &colocated,
                    &self.colocated,
                    "fission_decode_step_seconds",
                    n,
                    3 + 3 * r,
                )
                .await?;
            // The decode request's steps less its one prefill step.
            let decode = (sum - prefill) / (count - 1.0).max(1.0);
            let pushing = match (&disaggregated, &self.disaggregated) {
                // Two new tokens: the prompt's KV is pushed to the decode node.
                (Some(c), Some(e)) => {
                    let (sum, count) = self
                        .node_steps(&http, c, e, "fission_prefill_step_seconds", 2, 4 + 3 * r)
                        .await?;
                    Some(sum / count)
                }
                _ => None,
            };
            let beside = match (&disaggregated, &self.disaggregated) {
                (Some(c), Some(e)) => Some(
                    self.prefill_beside_decodes(&http, &colocated, c, e, r)
                        .await?,
                ),
                _ => None,
            };
            rows.push((
                engine_prefill,
                prefill,
                engine_decode,
                decode,
                pushing,
                beside,
            ));
        }
        let mut report = format!(
            "node steps against the engine's (prompt {} tokens, decode batch 1 over {}-{} tokens):\n\
             | round | engine prefill ms | node prefill ms | engine decode ms | node decode ms | prefill node ms | beside a decode batch of {BESIDE_BATCH} ms |\n\
             |---:|---:|---:|---:|---:|---:|---:|\n",
            self.prompt_tokens,
            self.prompt_tokens,
            self.prompt_tokens + self.new_tokens
        );
        let ms = |v: &Option<f64>| v.map_or("-".into(), |p| format!("{:.1}", p * 1e3));
        for (i, (ep, np, ed, nd, pp, bp)) in rows.iter().enumerate() {
            let _ = writeln!(
                report,
                "| {} | {:.1} | {:.1} | {:.2} | {:.2} | {} | {} |",
                i + 1,
                ep * 1e3,
                np * 1e3,
                ed * 1e3,
                nd * 1e3,
                ms(pp),
                ms(bp)
            );
        }
        let push = rows
            .iter()
            .map(|r| r.4.map(|p| (p - r.1) / self.prompt_kv_bytes))
            .collect::<Option<Vec<f64>>>()
            .map(|v| median(v).max(0.0));
        // The nodes run a thread per core (their default), as this process's pool does.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let decode_cores = rows
            .iter()
            .map(|r| Some(r.5? / r.4?))
            .collect::<Option<Vec<f64>>>()
            .map(|v| decode_step_cores(median(v), cores));
        Ok(NodeFactors {
            prefill: median(rows.iter().map(|r| r.1 / r.0).collect()),
            decode: median(rows.iter().map(|r| r.3 / r.2).collect()),
            push_step_s_per_byte: push,
            decode_step_cores: decode_cores,
            report,
        })
    }

    fn client(&self, e: &NodeEndpoint) -> Result<Client, LoadError> {
        Client::new(
            Target {
                base_url: e.gateway.clone(),
                api: Api::OpenaiCompletions,
                model: None,
                api_key: None,
            },
            Duration::from_secs(120),
        )
    }

    /// The engine on a blocking thread, so the runtime's threads stay free.
    async fn blocking(
        &self,
        f: impl FnOnce(&LoadedModel) -> Result<f64, LoadError> + Send + 'static,
    ) -> Result<f64, LoadError> {
        let model = self.model.clone();
        tokio::task::spawn_blocking(move || f(&model))
            .await
            .map_err(|e| failed(e.to_string()))?
    }

    /// One request of `new_tokens` through `client`; fails unless it streamed them all.
    /// Every request has a prompt of its own (`seed`): a prompt seen before would be found in
    /// the node's prefix cache, and its prefill step would be shorter.
    async fn send(&self, client: &Client, new_tokens: usize, seed: usize) -> Result<(), LoadError> {
        let prompt = exact_prompt(
            self.prompt_tokens,
            1000 + seed,
            self.first_extra_id,
            self.vocab,
        );
        let spec = RequestSpec {
            index: seed as u64,
            prompt: prompt.clone(),
            system: None,
            user: prompt,
            input_len: self.prompt_tokens,
            output_len: new_tokens,
        };
        let record = client.send(&spec, Instant::now()).await;
        if !record.ok() || record.output_tokens != new_tokens {
            return Err(failed(format!(
                "a request of {new_tokens} new tokens to {} ended with {:?} after {} tokens",
                client.target().base_url,
                record.error,
                record.output_tokens
            )));
        }
        Ok(())
    }

    /// The histogram `name` on `e`'s metrics page now: (sum, count).
    async fn read(
        &self,
        http: &reqwest::Client,
        e: &NodeEndpoint,
        name: &str,
    ) -> Result<(f64, f64), LoadError> {
        let page = http
            .get(&e.metrics)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .map_err(LoadError::Client)?
            .text()
            .await
            .map_err(LoadError::Client)?;
        sum_count(&page, name).ok_or_else(|| failed(format!("no {name} at {}", e.metrics)))
    }

    /// The 1P+1D prefill node's step (seconds, a prompt of `prompt_tokens`, pushed) while
    /// the colocated cluster's node decodes a batch of [`BESIDE_BATCH`] on the same host:
    /// over the same step alone, it tells how much of the host a decode step takes.
    async fn prefill_beside_decodes(
        &self,
        http: &reqwest::Client,
        colocated: &Client,
        disaggregated: &Client,
        e: &NodeEndpoint,
        round: usize,
    ) -> Result<f64, LoadError> {
        const STEPS: &str = "fission_decode_step_seconds";
        let start = self.read(http, &self.colocated, STEPS).await?.1;
        let load_done = AtomicBool::new(false);
        let load = async {
            let batch = (0..BESIDE_BATCH)
                .map(|i| self.send(colocated, self.beside_new_tokens, 10_000 + 10 * round + i));
            let sent = futures::future::try_join_all(batch).await;
            load_done.store(true, Ordering::Release);
            sent
        };
        let measure = async {
            // The batch's prompts take a step or a few; past that, its node only decodes.
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.read(http, &self.colocated, STEPS).await?.1
                < start + (BESIDE_BATCH + 4) as f64
            {
                if Instant::now() > deadline {
                    return Err(failed("the colocated node took no decode steps".into()));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let (sum, count) = self
                .node_steps(
                    http,
                    disaggregated,
                    e,
                    "fission_prefill_step_seconds",
                    2,
                    20_000 + round,
                )
                .await?;
            if load_done.load(Ordering::Acquire) {
                return Err(failed(format!(
                    "the decode batch ended before the prefill step beside it ({} new tokens)",
                    self.beside_new_tokens
                )));
            }
            Ok(sum / count)
        };
        let (sent, measured) = tokio::join!(load, measure);
        sent?;
        measured
    }

    /// The step histogram `name` on `e` across one request of `new_tokens`: (seconds, steps),
    /// at least one step.
    async fn node_steps(
        &self,
        http: &reqwest::Client,
        client: &Client,
        e: &NodeEndpoint,
        name: &str,
        new_tokens: usize,
        seed: usize,
    ) -> Result<(f64, f64), LoadError> {
        let before = self.read(http, e, name).await?;
        self.send(client, new_tokens, seed).await?;
        let after = self.read(http, e, name).await?;
        let (sum, count) = (after.0 - before.0, after.1 - before.1);
        if count < 1.0 {
            return Err(failed(format!("{name} counted no step at {}", e.metrics)));
        }
        Ok((sum, count))
    }
}

#[cfg(test)]
mod tests {
    use super::{decode_step_cores, sum_count};

    #[test]
    fn a_prefills_stretch_beside_a_decode_step_gives_the_cores_that_step_took() {
        // 2 cores, a prefill on both: a decode step on 1 more core stretches it to 1.5.
        assert!((decode_step_cores(1.5, 2.0) - 1.0).abs() < 1e-12);
        assert_eq!(decode_step_cores(2.0, 2.0), 2.0);
        // Noise either side of the possible range is clamped into it.
        assert_eq!(decode_step_cores(0.9, 2.0), 0.0);
        assert_eq!(decode_step_cores(2.6, 2.0), 2.0);
    }

    #[test]
    fn a_histograms_sum_and_count_are_read_and_its_buckets_are_not() {
        let page = "# TYPE x histogram\n\
                    fission_decode_step_seconds_bucket{le=\"0.1\"} 3\n\
                    fission_decode_step_seconds_sum 0.25\n\
                    fission_decode_step_seconds_count 4\n\
                    fission_decode_step_seconds_other_sum 9\n";
        assert_eq!(
            sum_count(page, "fission_decode_step_seconds"),
            Some((0.25, 4.0))
        );
        assert_eq!(sum_count(page, "fission_prefill_step_seconds"), None);
    }
}
