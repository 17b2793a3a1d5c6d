//! Loopback KV transfer benchmark for the SmolLM2-135M shape.
//!
//!     cargo run --release -p kv-bench --example bench -- [--reps N] [--warmup N]
//!         [--tokens 128,1024,4096] [--tcp-conns N] [--fairness]
//!         [--os-socket-buffers] [--windows STREAM,CONN,SEND (MiB)]... [--mtu BYTES]...
//!         [--only 'PREFIX;PREFIX'] [--ucx-sm]
//!
//! `--mtu`, QUIC with packets of BYTES from the first one (initial MTU and the MTU discovery
//! bound; loopback's MTU is 65536, a jumbo-frame fabric's 9000); `--only`, just the rows whose
//! label starts with one of the prefixes (`raw tcp;shm;quic, tuned`), to keep a run short.
//! The optional rows: `--fairness`, QUIC with stream round-robin on;
//! `--os-socket-buffers`, QUIC with the OS-default UDP socket buffers instead of 4 MiB;
//! `--ucx-sm`, UCX over its shared-memory transports (the default row is UCX over TCP).

use anyhow::{bail, Context, Result};
use kv_bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::{QuicConfig, QuicWindows};

fn main() -> Result<()> {
    let mut cfg = BenchConfig::default();
    let mut args = std::env::args().skip(1);
    let mut only: Option<String> = None;
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
            "--ucx-conns" => cfg.backends.push(BenchBackend::Ucx {
                transports: Some("tcp".to_owned()),
                connections: value()?.parse()?,
            }),
            "--ucx-sm" => cfg.backends.push(BenchBackend::Ucx {
                transports: Some("sm".to_owned()),
                connections: 8,
            }),
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
            "--mtu" => {
                let mtu: u16 = value()?.parse()?;
                cfg.backends.push(BenchBackend::Quic {
                    label: format!("tuned windows, {mtu}-byte packets"),
                    config: QuicConfig {
                        initial_mtu: mtu,
                        mtu_upper_bound: mtu,
                        ..QuicConfig::default()
                    },
                });
            }
            "--only" => only = Some(value()?),
            other => bail!("unknown argument {other}"),
        }
    }
    if let Some(only) = only {
        let prefixes: Vec<&str> = only.split(';').collect();
        cfg.backends
            .retain(|b| prefixes.iter().any(|p| b.label().starts_with(p)));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(run_bench(cfg))?;
    print!("{report}");
    Ok(())
}
