//! `fission-loadtest`: `ttft` runs prompts of exact lengths one at a time (latency without
//! queueing); `open-loop` sends Poisson arrivals at a fixed rate, whatever the server's pace,
//! and reports TTFT/TPOT percentiles and goodput; `closed-loop` keeps a fixed number of requests
//! in flight and reports throughput (what the server sustains, for A/B comparisons).

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use loadtest::measure::{stream_once, Sample};
use loadtest::prompt::exact_prompt;
use loadtest::stats::{median, percentile};
use rand::Rng;

#[derive(Parser)]
#[command(name = "fission-loadtest", about = "Load over Fission's HTTP API")]
struct Cli {
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// First `<extra_N>` id of the padded benchmark tokenizer, and the vocab size.
    #[arg(long, default_value_t = 512)]
    first_extra_id: usize,
    #[arg(long, default_value_t = 49152)]
    vocab: usize,
    #[command(subcommand)]
    mode: Mode,
}

#[derive(Subcommand)]
enum Mode {
    /// Sequential requests of exact prompt lengths: TTFT and end-to-end medians.
    Ttft {
        #[arg(long, value_delimiter = ',', default_value = "128,1024,2048")]
        prompt_tokens: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long, default_value_t = 16)]
        max_new_tokens: usize,
    },
    /// `concurrency` clients, each sending its next request when the last one ends, for
    /// `duration_s` after a warm-up: requests/s and generated tokens/s.
    ClosedLoop {
        #[arg(long, default_value_t = 8)]
        concurrency: usize,
        #[arg(long, default_value_t = 20)]
        duration_s: u64,
        #[arg(long, default_value_t = 3)]
        warmup_s: u64,
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
    },
    /// Poisson arrivals at `rate` requests/s for `duration_s`.
    OpenLoop {
        #[arg(long, default_value_t = 1.0)]
        rate: f64,
        #[arg(long, default_value_t = 30)]
        duration_s: u64,
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 32)]
        max_new_tokens: usize,
        /// Goodput counts requests meeting both SLOs.
        #[arg(long, default_value_t = 2000)]
        slo_ttft_ms: u64,
        #[arg(long, default_value_t = 200)]
        slo_tpot_ms: u64,
    },
}

fn ms(d: f64) -> String {
    format!("{:.1}", d * 1e3)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let client = reqwest::Client::new();
    match cli.mode {
        Mode::Ttft {
            prompt_tokens,
            repeats,
            max_new_tokens,
        } => {
            println!("prompt_tokens,ttft_ms_median,e2e_ms_median,tokens");
            for (li, &n) in prompt_tokens.iter().enumerate() {
                // One unmeasured request warms every code path for this length.
                let warm = exact_prompt(n, 1_000 + li, cli.first_extra_id, cli.vocab);
                stream_once(&client, &cli.url, &warm, max_new_tokens).await?;
                let mut samples = Vec::new();
                for r in 0..repeats {
                    let p = exact_prompt(n, li * 100 + r, cli.first_extra_id, cli.vocab);
                    let s = stream_once(&client, &cli.url, &p, max_new_tokens).await?;
                    anyhow::ensure!(s.ok, "request of {n} tokens failed");
                    samples.push(s);
                }
                let ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64()).collect();
                let e2e: Vec<f64> = samples.iter().map(|s| s.e2e.as_secs_f64()).collect();
                println!(
                    "{n},{},{},{}",
                    ms(median(&ttft)),
                    ms(median(&e2e)),
                    samples[0].tokens
                );
            }
        }
        Mode::ClosedLoop {
            concurrency,
            duration_s,
            warmup_s,
            prompt_tokens,
            max_new_tokens,
        } => {
            let start = Instant::now();
            let measure_from = start + Duration::from_secs(warmup_s);
            let end = measure_from + Duration::from_secs(duration_s);
            let workers: Vec<_> = (0..concurrency)
                .map(|w| {
                    let (client, url) = (client.clone(), cli.url.clone());
                    let (first_extra_id, vocab) = (cli.first_extra_id, cli.vocab);
                    tokio::spawn(async move {
                        let (mut ok, mut failed, mut tokens) = (0usize, 0usize, 0usize);
                        let mut i = 0;
                        while Instant::now() < end {
                            let p = exact_prompt(
                                prompt_tokens,
                                100_000 * (w + 1) + i,
                                first_extra_id,
                                vocab,
                            );
                            i += 1;
                            let s = stream_once(&client, &url, &p, max_new_tokens).await?;
                            // Only requests that both start and end in the window count.
                            let done = Instant::now();
                            if done - s.e2e >= measure_from && done <= end {
                                if s.ok {
                                    ok += 1;
                                    tokens += s.tokens;
                                } else {
                                    failed += 1;
                                }
                            }
                        }
                        anyhow::Ok((ok, failed, tokens))
                    })
                })
                .collect();
            let (mut ok, mut failed, mut tokens) = (0, 0, 0);
            for w in workers {
                let (o, f, t) = w.await??;
                ok += o;
                failed += f;
                tokens += t;
            }
            let secs = duration_s as f64;
            println!(
                "requests ok {ok} failed {failed} in {duration_s} s, concurrency {concurrency}"
            );
            println!(
                "throughput req_per_s {:.2} tokens_per_s {:.1}",
                ok as f64 / secs,
                tokens as f64 / secs
            );
        }
        Mode::OpenLoop {
            rate,
            duration_s,
            prompt_tokens,
            max_new_tokens,
            slo_ttft_ms,
            slo_tpot_ms,
        } => {
            let start = Instant::now();
            let mut tasks = Vec::new();
            let mut next = Duration::ZERO;
            let mut i = 0;
            while next < Duration::from_secs(duration_s) {
                tokio::time::sleep_until((start + next).into()).await;
                let (client, url) = (client.clone(), cli.url.clone());
                let p = exact_prompt(prompt_tokens, 10_000 + i, cli.first_extra_id, cli.vocab);
                tasks.push(tokio::spawn(async move {
                    stream_once(&client, &url, &p, max_new_tokens).await
                }));
                // Exponential inter-arrival times: arrivals do not wait for the server.
                let u: f64 = rand::rng().random_range(f64::EPSILON..1.0);
                next += Duration::from_secs_f64(-u.ln() / rate);
                i += 1;
            }
            let mut samples: Vec<Sample> = Vec::new();
            for t in tasks {
                samples.push(t.await??);
            }
            let wall = start.elapsed().as_secs_f64();
            let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
            let ttft: Vec<f64> = ok.iter().map(|s| s.ttft.as_secs_f64()).collect();
            let tpot: Vec<f64> = ok
                .iter()
                .filter_map(|s| s.tpot())
                .map(|d| d.as_secs_f64())
                .collect();
            let good = ok
                .iter()
                .filter(|s| {
                    s.ttft.as_millis() as u64 <= slo_ttft_ms
                        && s.tpot().is_none_or(|t| t.as_millis() as u64 <= slo_tpot_ms)
                })
                .count();
            let tokens: usize = ok.iter().map(|s| s.tokens).sum();
            println!(
                "requests {} ok {} failed {}",
                samples.len(),
                ok.len(),
                samples.len() - ok.len()
            );
            println!(
                "ttft_ms p50 {} p90 {} p99 {}",
                ms(percentile(&ttft, 50.0)),
                ms(percentile(&ttft, 90.0)),
                ms(percentile(&ttft, 99.0))
            );
            println!(
                "tpot_ms p50 {} p90 {} p99 {}",
                ms(percentile(&tpot, 50.0)),
                ms(percentile(&tpot, 90.0)),
                ms(percentile(&tpot, 99.0))
            );
            println!("throughput {:.1} tok/s, goodput {:.2} req/s (SLO ttft<={slo_ttft_ms}ms tpot<={slo_tpot_ms}ms)", tokens as f64 / wall, good as f64 / wall);
        }
    }
    Ok(())
}
