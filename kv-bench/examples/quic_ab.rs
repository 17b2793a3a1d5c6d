//! QUIC settings side by side against raw TCP, in one run (their transfers interleaved): the
//! A/B behind `benchmarks/history/2026-11-29-quic-speed.md`.
//!
//!     cargo run --release -p kv-bench --example quic_ab -- [TOKENS,..] [REPEATS] [CONNS,..]
//!         [MTU,..] [SOCKET_BUFFER_MIB,..]
//!
//! One QUIC row per connection count (`connections_per_endpoint`), `loopback_mtu` (0:
//! quinn's 1452-byte path MTU) and UDP socket buffer size. `QUIC_AB_SHM=1` adds the shm row.

use kv_bench::{run_bench, BenchBackend, BenchConfig};
use kvtransfer::{QuicConfig, LOOPBACK_MTU};

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
    let conns = list(args.next(), "1,2");
    let mtus = list(args.next(), &LOOPBACK_MTU.to_string());
    let buffers_mib = list(args.next(), "4");
    let mut backends = vec![BenchBackend::RawTcp];
    if std::env::var_os("QUIC_AB_SHM").is_some() {
        backends.push(BenchBackend::Shm { connections: 8 });
    }
    for &mib in &buffers_mib {
        for &mtu in &mtus {
            for &n in &conns {
                backends.push(BenchBackend::Quic {
                    label: format!("loopback_mtu {mtu}, {n} conns, {mib} MiB socket buffers"),
                    config: QuicConfig {
                        loopback_mtu: mtu as u16,
                        connections_per_endpoint: n as usize,
                        socket_buffer_bytes: (mib as usize) << 20,
                        ..QuicConfig::default()
                    },
                });
            }
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
