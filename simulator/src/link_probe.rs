//! The KV link of a calibrated profile, measured here with the nodes' own transport over
//! loopback: its bandwidth (`kvtransfer`'s bench, as `fission bench kvtransfer` runs it), and
//! what a push costs the prefill step it runs beside (`Link::push_step_s_per_byte`). On a
//! CPU engine the push's encryption and copies take cores from the step, and on a one-host
//! cluster the receiver's do too, as they do here, where both ends share this process's host.

use std::fmt::Write as _;

use bytes::{Bytes, BytesMut};
use engine::engine::LayerDone;
use engine::model::LoadedModel;
use kv_bench::LoopbackLink;
use kv_bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::{KvDtype, KvLayout, QuicConfig, TcpConfig};
use tokio::sync::mpsc::UnboundedSender;

use crate::calibrate::{median, time_prefill};
use crate::cost::{Link, ModelShape};
use loadgen::error::LoadError;

/// Which of the nodes' KV transports to measure (`fission up --kv-transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LinkTransport {
    /// QUIC with mutual TLS, the nodes' default.
    Quic,
    /// TCP (`--kv-transport tcp`).
    Tcp,
}

/// Prompt lengths pushed for the bandwidth: the validation workload's median and its tail.
const BANDWIDTH_TOKENS: [usize; 2] = [128, 1024];

/// The measured link, and the tables behind it for the record.
pub struct MeasuredLink {
    pub link: Link,
    pub report: String,
}

/// What to measure.
pub struct LinkProbe<'a> {
    pub model: &'a LoadedModel,
    pub shape: &'a ModelShape,
    pub block_size: usize,
    pub transport: LinkTransport,
    pub latency_s: f64,
    /// Prompt lengths whose prefill steps are timed alone and beside their push.
    pub step_tokens: Vec<usize>,
    /// Pairs (alone, beside) timed per length, alternating; the medians are kept.
    pub repeats: usize,
}

fn failed(reason: String) -> LoadError {
    LoadError::RequestFailed {
        what: "measuring the KV link".into(),
        reason,
    }
}

impl LinkProbe<'_> {
    fn layout(&self) -> Result<KvLayout, LoadError> {
        let dtype = match self.shape.dtype_bytes {
            4 => KvDtype::F32,
            2 => KvDtype::Bf16,
            other => return Err(failed(format!("no KV dtype of {other} bytes"))),
        };
        Ok(KvLayout {
            dtype,
            num_layers: self.shape.num_layers as u32,
            block_size: self.block_size as u32,
            num_kv_heads: self.shape.num_kv_heads as u32,
            head_dim: self.shape.head_dim as u32,
            windows: Default::default(),
        })
    }

    /// The bandwidth of the longest bench prompt, then each step length's slowdown beside
    /// its push, pooled into seconds per byte (a line through the origin).
    pub async fn run(&self) -> Result<MeasuredLink, LoadError> {
        let layout = self.layout()?;
        let quic = self.transport == LinkTransport::Quic;
        let backend = if quic {
            BenchBackend::Quic {
                label: "the nodes' settings".into(),
                config: QuicConfig::default(),
            }
        } else {
            BenchBackend::Tcp {
                connections: TcpConfig::default().connections_per_endpoint,
            }
        };
        let bench = run_bench(BenchConfig {
            layout,
            prompt_tokens: BANDWIDTH_TOKENS.to_vec(),
            repetitions: 10,
            warmup: 2,
            backends: vec![backend],
        })
        .await
        .map_err(|e| failed(e.to_string()))?;
        let longest = bench
            .rows
            .iter()
            .max_by_key(|r| r.prompt_tokens)
            .ok_or_else(|| failed("the bench measured nothing".into()))?;
        let mut report = bench.to_string();

        let link = LoopbackLink::open(quic, layout)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (mut slowdown_s, mut bytes) = (0.0, 0.0);
        report.push_str(
            "\nprefill steps alone and pushing their layers as computed (medians):\n\
             | tokens | MB pushed | alone ms | pushing ms | + ms |\n|---:|---:|---:|---:|---:|\n",
        );
        let max_ctx = self.model.config().max_context;
        for &len in self.step_tokens.iter().filter(|&&n| n + 1 < max_ctx) {
            let prompt_bytes = self.shape.kv_bytes_per_token() as f64
                * (len.div_ceil(self.block_size) * self.block_size) as f64;
            let (mut alone, mut pushing) = (Vec::new(), Vec::new());
            for r in 0..self.repeats.max(1) {
                // Alternating, so that the machine's drift falls on both.
                alone.push(self.step(len, r, None).await?);
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let (pushed, stepped) =
                    tokio::join!(link.push_as_computed(len, rx), self.step(len, r, Some(tx)));
                pushing.push(stepped?);
                pushed.map_err(|e| failed(e.to_string()))?;
            }
            let (a, b) = (median(alone), median(pushing));
            slowdown_s += b - a;
            bytes += prompt_bytes;
            let _ = writeln!(
                report,
                "| {len} | {:.2} | {:.1} | {:.1} | {:.1} |",
                prompt_bytes / 1e6,
                a * 1e3,
                b * 1e3,
                (b - a) * 1e3
            );
        }
        link.close().await;
        Ok(MeasuredLink {
            link: Link {
                bandwidth_bytes_per_s: longest.gbps * 1e9,
                latency_s: self.latency_s,
                layerwise: true,
                push_step_s_per_byte: (slowdown_s / bytes.max(1.0)).max(0.0),
            },
            report,
        })
    }

    /// One prefill step of `len` tokens, on a blocking thread so that a push can run beside
    /// it on the runtime's. With `layers`, each layer's KV is exported and handed over as
    /// the prefill node's layer hook does it.
    async fn step(
        &self,
        len: usize,
        variant: usize,
        layers: Option<UnboundedSender<(u32, Bytes)>>,
    ) -> Result<f64, LoadError> {
        let model = self.model.clone();
        tokio::task::spawn_blocking(move || {
            let Some(tx) = layers else {
                return time_prefill(&model, len, variant, None);
            };
            let mut hook = |done: LayerDone<'_>| {
                for (_, blocks) in done.completing {
                    let mut buf = BytesMut::zeroed(done.cache.export_len(blocks.len()));
                    done.cache.export_blocks(done.layer, blocks, &mut buf)?;
                    let _ = tx.send((done.layer as u32, buf.freeze()));
                }
                Ok(())
            };
            time_prefill(&model, len, variant, Some(&mut hook))
        })
        .await
        .map_err(|e| failed(e.to_string()))?
    }
}
