//! Loopback KV transfer benchmark for the SmolLM2-135M shape.
//!
//!     cargo run --release -p kvtransfer --example bench -- [--reps N] [--warmup N]
//!         [--tokens 128,1024,4096] [--tcp-conns N] [--jumbo] [--os-socket-buffers]
//!
//! `--jumbo` adds a QUIC row with path-MTU discovery allowed up to 8952 bytes (9000-byte
//! jumbo frames), which loopback permits. `--os-socket-buffers` adds a QUIC row that leaves
//! the UDP socket buffers at the OS default instead of 4 MiB.

use anyhow::{bail, Context, Result};
use kvtransfer::bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::QuicConfig;

fn main() -> Result<()> {
    let mut cfg = BenchConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().with_context(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--reps" => cfg.repetitions = value()?.parse()?,
            "--warmup" => cfg.warmup = value()?.parse()?,
            "--tokens" => {
                cfg.prompt_tokens = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--tcp-conns" => {
                let n = value()?.parse()?;
                for b in &mut cfg.backends {
                    if let BenchBackend::Tcp { connections } = b {
                        *connections = n;
                    }
                }
            }
            "--jumbo" => cfg.backends.push(BenchBackend::Quic {
                label: "tuned windows, jumbo mtu".to_owned(),
                config: QuicConfig {
                    mtu_upper_bound: 8952,
                    ..QuicConfig::default()
                },
            }),
            "--experiments" => {
                cfg.backends.push(BenchBackend::Quic {
                    label: "tuned, no fairness".to_owned(),
                    config: QuicConfig {
                        send_fairness: false,
                        ..QuicConfig::default()
                    },
                });
                cfg.backends.push(BenchBackend::Quic {
                    label: "tuned, initial mtu 8952".to_owned(),
                    config: QuicConfig {
                        initial_mtu: 8952,
                        mtu_upper_bound: 8952,
                        ..QuicConfig::default()
                    },
                });
            }
            "--os-socket-buffers" => cfg.backends.push(BenchBackend::Quic {
                label: "tuned windows, OS socket buffers".to_owned(),
                config: QuicConfig {
                    socket_buffer_bytes: 0,
                    ..QuicConfig::default()
                },
            }),
            other => bail!("unknown argument {other}"),
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(run_bench(cfg))?;
    print!("{report}");
    Ok(())
}
