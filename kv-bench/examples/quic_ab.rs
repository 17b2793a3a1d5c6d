//! QUIC settings side by side against raw TCP and shm, in one run (their transfers
//! interleaved): the A/B behind `benchmarks/history/2026-11-29-quic-shm.md`.
//!
//!     cargo run --release -p kv-bench --example quic_ab -- [TOKENS,..] [REPEATS] [MTU,..]
//!
//! Each MTU is a `loopback_mtu` row (0: quinn's 1452-byte path MTU, as before issue 34; at
//! most `MAX_GSO_MTU`), each with Cubic and with BBR (`loopback_bbr`).

use kv_bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::QuicConfig;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let list = |s: Option<String>, default: &str| -> Vec<u64> {
        s.unwrap_or_else(|| default.to_owned())
            .split(',')
            .filter_map(|t| t.trim().parse().ok())
            .collect()
    };
    let tokens = list(args.next(), "1024,4096");
    let repeats = list(args.next(), "7").first().copied().unwrap_or(7) as usize;
    let mtus = list(args.next(), "0,4096,6500");
    let mut backends = vec![BenchBackend::RawTcp, BenchBackend::Shm { connections: 8 }];
    for mtu in mtus {
        for bbr in [false, true] {
            if mtu == 0 && bbr {
                continue;
            }
            backends.push(BenchBackend::Quic {
                label: format!("loopback_mtu {mtu}{}", if bbr { ", bbr" } else { "" }),
                config: QuicConfig {
                    loopback_mtu: mtu as u16,
                    loopback_bbr: bbr,
                    ..QuicConfig::default()
                },
            });
        }
    }
    let cfg = BenchConfig {
        prompt_tokens: tokens.into_iter().map(|t| t as usize).collect(),
        repetitions: repeats,
        backends,
        ..BenchConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    println!("{}", rt.block_on(run_bench(cfg))?);
    Ok(())
}
