//! `fission-loadtest`: load an LLM server over its streaming API and report TTFT, TPOT,
//! throughput and goodput under SLOs (see the library's doc). The old subcommands, `ttft`,
//! `closed-loop` and `open-loop`, still print what the scenario scripts parse. `simulate`
//! runs the same levels against a simulated cluster, plans P:D splits and calibrates cost
//! profiles (`simulate_cli` over the `simulator` crate, with the default `sim` feature). The
//! load generator itself is the `loadgen` crate.

#[cfg(feature = "sim")]
mod simulate_cli;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};
use loadgen::config::parse_duration;
use loadgen::legacy::Legacy;
use loadgen::prompt::PromptStyle;
use loadgen::sweep::SweepSpec;
use loadgen::{
    Api, Bounds, LoadConfig, LoadPlan, LoadShape, Slo, Target, WorkloadConfig, WorkloadKind,
};

#[derive(Parser)]
#[command(
    name = "fission-loadtest",
    about = "Load an LLM server (OpenAI or TGI streaming API) and measure TTFT, TPOT and goodput",
    after_help = "Examples:\n  fission-loadtest --url http://127.0.0.1:8080 --rate 2 --duration 20s --input-len 128 --output-len 32 --slo-ttft-ms 500 --slo-tpot-ms 50 --json out.json\n  fission-loadtest --sweep 0.5:2:8 --bisect 2 --workload sharegpt --plot plots/"
)]
struct Cli {
    /// The server's base URL; requests go to it and nowhere else.
    #[arg(long, env = "LOADTEST_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long, env = "LOADTEST_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// `--prompt-style extra`: the first `<extra_N>` id of the padded benchmark tokenizer.
    #[arg(long, env = "LOADTEST_FIRST_EXTRA_ID", default_value_t = 512)]
    first_extra_id: usize,
    /// `--prompt-style extra`: the vocabulary size.
    #[arg(long, env = "LOADTEST_VOCAB", default_value_t = 49152)]
    vocab: usize,
    #[command(subcommand)]
    legacy: Option<LegacyMode>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Args)]
struct RunArgs {
    #[arg(
        long,
        env = "LOADTEST_API",
        value_enum,
        default_value = "openai-completions"
    )]
    api: Api,
    /// The `model` of OpenAI requests; by default the first id of `GET /v1/models`.
    #[arg(long, env = "LOADTEST_MODEL")]
    model: Option<String>,
    /// Open loop: requests per second (gamma arrivals, Poisson by default).
    #[arg(long, env = "LOADTEST_RATE", conflicts_with_all = ["concurrency", "sweep"])]
    rate: Option<f64>,
    /// Closed loop: clients each sending their next request when the last ends.
    #[arg(long, env = "LOADTEST_CONCURRENCY", conflicts_with = "sweep")]
    concurrency: Option<usize>,
    /// Open-loop rates to sweep for the goodput: `0.5,1,2,4` or `start:factor:max`.
    #[arg(long, env = "LOADTEST_SWEEP")]
    sweep: Option<SweepSpec>,
    /// Levels bisecting between the last rate that met the SLO and the first that did not.
    #[arg(long, env = "LOADTEST_BISECT", default_value_t = 0)]
    bisect: usize,
    /// Gamma shape of inter-arrival times: 1 is Poisson, below 1 burstier.
    #[arg(long, env = "LOADTEST_BURSTINESS", default_value_t = 1.0)]
    burstiness: f64,
    /// How long each level sends requests (20s, 2m, 500ms).
    #[arg(long, env = "LOADTEST_DURATION", value_parser = parse_duration, default_value = "30s")]
    duration: Duration,
    /// At most this many requests per level.
    #[arg(long, env = "LOADTEST_MAX_REQUESTS", default_value_t = 10_000)]
    max_requests: usize,
    /// A request still streaming after this is cut and counted as a timeout.
    #[arg(long, env = "LOADTEST_REQUEST_TIMEOUT", value_parser = parse_duration, default_value = "60s")]
    request_timeout: Duration,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[arg(long, env = "LOADTEST_SLO_TTFT_MS", default_value_t = 2000.0)]
    slo_ttft_ms: f64,
    #[arg(long, env = "LOADTEST_SLO_TPOT_MS", default_value_t = 200.0)]
    slo_tpot_ms: f64,
    #[arg(long, env = "LOADTEST_SEED", default_value_t = 0)]
    seed: u64,
    /// Unmeasured requests sent one at a time first.
    #[arg(long, env = "LOADTEST_WARMUP_REQUESTS", default_value_t = 1)]
    warmup_requests: usize,
    /// Write the full report (every level and request) as JSON.
    #[arg(long, env = "LOADTEST_JSON")]
    json: Option<PathBuf>,
    /// Write SVG plots into this directory.
    #[arg(long, env = "LOADTEST_PLOT")]
    plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short, env = "LOADTEST_QUIET")]
    quiet: bool,
}

/// The workload flags, shared by load runs and simulations.
#[derive(Args)]
pub(crate) struct WorkloadArgs {
    #[arg(long, env = "LOADTEST_WORKLOAD", value_enum, default_value = "fixed")]
    pub(crate) workload: WorkloadKind,
    /// Prompt tokens (fixed, shared-prefix: default 128; sharegpt, summarise: the mean).
    #[arg(long, env = "LOADTEST_INPUT_LEN")]
    input_len: Option<usize>,
    /// Output tokens asked for (fixed, shared-prefix: default 32; sharegpt, summarise: the mean).
    #[arg(long, env = "LOADTEST_OUTPUT_LEN")]
    output_len: Option<usize>,
    /// Clamp for sampled prompt lengths (fit it to the model's context).
    #[arg(long, env = "LOADTEST_MAX_INPUT_LEN", default_value_t = 4096)]
    max_input_len: usize,
    /// Clamp for sampled output lengths.
    #[arg(long, env = "LOADTEST_MAX_OUTPUT_LEN", default_value_t = 2048)]
    max_output_len: usize,
    /// shared-prefix: system prompts (N).
    #[arg(long, env = "LOADTEST_PREFIXES", default_value_t = 4)]
    prefixes: usize,
    /// shared-prefix: users per system prompt (M); multi-turn: conversations at a time.
    #[arg(long, env = "LOADTEST_USERS", default_value_t = 8)]
    users: usize,
    /// shared-prefix, multi-turn: tokens in each system prompt.
    #[arg(long, env = "LOADTEST_PREFIX_LEN", default_value_t = 256)]
    prefix_len: usize,
    /// `words`: one-token English words (any model); `extra`: `<extra_N>` tokens (exact, for
    /// the padded benchmark tokenizers).
    #[arg(
        long,
        env = "LOADTEST_PROMPT_STYLE",
        value_enum,
        default_value = "words"
    )]
    prompt_style: StyleArg,
}

impl WorkloadArgs {
    pub(crate) fn config(&self, cli_first_extra_id: usize, cli_vocab: usize) -> WorkloadConfig {
        let prompt_style = match self.prompt_style {
            StyleArg::Words => PromptStyle::Words,
            StyleArg::Extra => PromptStyle::Extra {
                first_extra_id: cli_first_extra_id,
                vocab: cli_vocab,
            },
        };
        WorkloadConfig {
            kind: self.workload,
            input_len: self.input_len,
            output_len: self.output_len,
            max_input_len: self.max_input_len,
            max_output_len: self.max_output_len,
            prefixes: self.prefixes,
            users: self.users,
            prefix_len: self.prefix_len,
            prompt_style,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum StyleArg {
    Words,
    Extra,
}

#[derive(Subcommand)]
enum LegacyMode {
    /// Simulate a cluster (P prefill + D decode nodes, or colocated) on a cost profile:
    /// `simulate --cluster 2P+6D --rate 20`, `simulate plan --gpus 8..64`,
    /// `simulate calibrate --model DIR`.
    #[cfg(feature = "sim")]
    Simulate(Box<simulate_cli::SimulateArgs>),
    /// Sequential requests of exact prompt lengths: TTFT and end-to-end medians (CSV).
    Ttft {
        #[arg(long, value_delimiter = ',', default_value = "128,1024,2048")]
        prompt_tokens: Vec<usize>,
        #[arg(long, default_value_t = 3)]
        repeats: usize,
        #[arg(long, default_value_t = 16)]
        max_new_tokens: usize,
    },
    /// `concurrency` clients for `duration_s` after a warm-up: requests/s and tokens/s.
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
        #[arg(long, default_value_t = 2000)]
        slo_ttft_ms: u64,
        #[arg(long, default_value_t = 200)]
        slo_tpot_ms: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(mode) = cli.legacy {
        let legacy = Legacy {
            url: cli.url,
            first_extra_id: cli.first_extra_id,
            vocab: cli.vocab,
            api_key: cli.api_key,
        };
        let out = match mode {
            #[cfg(feature = "sim")]
            LegacyMode::Simulate(args) => {
                return simulate_cli::run(*args, cli.first_extra_id, cli.vocab);
            }
            LegacyMode::Ttft {
                prompt_tokens,
                repeats,
                max_new_tokens,
            } => legacy.ttft(&prompt_tokens, repeats, max_new_tokens).await?,
            LegacyMode::ClosedLoop {
                concurrency,
                duration_s,
                warmup_s,
                prompt_tokens,
                max_new_tokens,
            } => {
                legacy
                    .closed_loop(
                        concurrency,
                        Duration::from_secs(duration_s),
                        Duration::from_secs(warmup_s),
                        prompt_tokens,
                        max_new_tokens,
                    )
                    .await?
            }
            LegacyMode::OpenLoop {
                rate,
                duration_s,
                prompt_tokens,
                max_new_tokens,
                slo_ttft_ms,
                slo_tpot_ms,
            } => {
                let slo = Slo {
                    ttft_ms: slo_ttft_ms as f64,
                    tpot_ms: slo_tpot_ms as f64,
                };
                legacy
                    .open_loop(
                        rate,
                        Duration::from_secs(duration_s),
                        prompt_tokens,
                        max_new_tokens,
                        slo,
                    )
                    .await?
            }
        };
        print!("{out}");
        return Ok(());
    }

    let a = cli.run;
    let plan = match (a.rate, a.concurrency, a.sweep) {
        (Some(rate_rps), None, None) => LoadPlan::Single(LoadShape::Open {
            rate_rps,
            burstiness: a.burstiness,
        }),
        (None, Some(concurrency), None) => LoadPlan::Single(LoadShape::Closed { concurrency }),
        (None, None, Some(rates)) => LoadPlan::Sweep {
            rates,
            burstiness: a.burstiness,
            bisect_steps: a.bisect,
        },
        _ => anyhow::bail!(
            "give one of --rate R, --concurrency C or --sweep RATES (or a subcommand; see --help)"
        ),
    };
    let config = LoadConfig {
        target: Target {
            base_url: cli.url,
            api: a.api,
            model: a.model,
            api_key: cli.api_key,
        },
        plan,
        workload: a.workload.config(cli.first_extra_id, cli.vocab),
        bounds: Bounds {
            duration: a.duration,
            max_requests: a.max_requests,
            request_timeout: a.request_timeout,
        },
        slo: Slo {
            ttft_ms: a.slo_ttft_ms,
            tpot_ms: a.slo_tpot_ms,
        },
        seed: a.seed,
        warmup_requests: a.warmup_requests,
        json_path: a.json,
        plot_dir: a.plot,
        quiet: a.quiet,
    };
    let report = loadgen::run(&config)
        .await
        .with_context(|| format!("load test against {}", config.target.endpoint()))?;
    print!("{}", report.markdown());
    if let Some(path) = &config.json_path {
        eprintln!("wrote {}", path.display());
    }
    if let Some(dir) = &config.plot_dir {
        eprintln!("wrote plots to {}", dir.display());
    }
    Ok(())
}
