//! Loopback KV transfer benchmark for the SmolLM2-135M shape.
//!
//!     cargo run --release -p kv-bench --example bench -- [--reps N] [--warmup N]
//!         [--tokens 128,1024,4096] [--tcp-conns N] [--fairness]
//!         [--os-socket-buffers] [--windows STREAM,CONN,SEND (MiB)]...
//!
//! The optional rows: `--fairness`, QUIC with stream round-robin on;
//! `--os-socket-buffers`, QUIC with the OS-default UDP socket buffers instead of 4 MiB.

use anyhow::{bail, Context, Result};
use kv_bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::{QuicConfig, QuicWindows};

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
            "--fairness" => cfg.backends.push(BenchBackend::Quic {
                label: "tuned windows, send fairness on".to_owned(),
                config: QuicConfig {
                    send_fairness: true,
                    ..QuicConfig::default()
                },
            }),
            "--windows" => {
                // stream,connection,send windows in MiB, e.g. 4,32,32
                let v = value()?;
                let mib: Vec<u64> = v.split(',').map(str::parse).collect::<Result<_, _>>()?;
                let [stream, conn, send] = mib[..] else {
                    bail!("--windows takes three numbers, got {v}");
                };
                cfg.backends.push(BenchBackend::Quic {
                    label: format!("windows {stream}/{conn}/{send} MiB"),
                    config: QuicConfig {
                        windows: QuicWindows {
                            stream_receive_window_bytes: stream << 20,
                            receive_window_bytes: conn << 20,
                            send_window_bytes: send << 20,
                        },
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
