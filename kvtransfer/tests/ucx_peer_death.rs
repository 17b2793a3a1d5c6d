//! UCX endpoints run without UCX's peer-failure mode (kvtransfer/src/ucx/worker.rs says why):
//! a peer process SIGKILLed in the middle of 16 MiB transfers must fail only what was in
//! flight to it, within the timeouts, and the surviving process must serve a new peer with
//! bit-exact layers.
//!
//! The killed peer is a child process running this same binary, so the test has its own
//! `main` (`harness = false` in Cargo.toml): `FISSION_UCX_PEER_ROLE` picks a child's role.

// Helpers outside test functions unwrap too; a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_types::{KvDtype, KvLayout, LayerWindows, TransferId};
use kvtransfer::{
    send_all_layers, DiscardSink, KvConnection, KvServer, KvTransferError, KvTransport,
    LayerHeader, MemorySink, Reservation, TransferRegistry, TransferStatus, UcxConfig, UcxServer,
    UcxTransport, Verdict,
};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// 64 KiB per block and layer: 256 blocks make a 16 MiB layer.
const LAYOUT: KvLayout = KvLayout {
    dtype: KvDtype::Bf16,
    num_layers: 4,
    block_size: 16,
    num_kv_heads: 8,
    head_dim: 128,
    windows: LayerWindows::NONE,
};
const BLOCKS: u32 = 256;
/// Frames at once from one sender.
const SENDERS: usize = 4;
/// Frames that must have crossed before the kill, so it lands with transfers under way.
const BEFORE_KILL: u64 = 8;
/// How long anything in flight to the killed peer may take to fail: a few put timeouts.
const FAIL_WITHIN: Duration = Duration::from_secs(20);
const ROLE: &str = "FISSION_UCX_PEER_ROLE";
const ENDPOINT: &str = "FISSION_UCX_PEER_ENDPOINT";

fn config() -> UcxConfig {
    UcxConfig {
        connections_per_endpoint: SENDERS,
        put_timeout_ms: 5_000,
        transports: Some("tcp".to_owned()),
        ..UcxConfig::default()
    }
}

fn header(xfer_id: u64, layer: u32) -> LayerHeader {
    LayerHeader {
        xfer_id: TransferId(xfer_id),
        epoch: 1,
        layer,
        layout: LAYOUT,
        block_ids: (0..BLOCKS).collect::<Vec<_>>().into(),
        traceparent: None,
    }
}

fn payload(seed: u8) -> Bytes {
    let len = LAYOUT.layer_payload_bytes(BLOCKS as usize).unwrap() as usize;
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect::<Vec<u8>>()
        .into()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// This binary as a child in `role`, with its stdout piped.
fn spawn_child(role: &str, endpoint: Option<&str>) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, role).stdout(Stdio::piped());
    if let Some(endpoint) = endpoint {
        cmd.env(ENDPOINT, endpoint);
    }
    cmd.spawn().unwrap()
}

fn kill(child: &mut Child) {
    // SAFETY: a signal to a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGKILL) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
}

/// Frames sent at once, each to an unknown transfer (the child receiver registers none):
/// every whole payload crosses, and each exchange ends in an `UnknownTransfer` verdict.
/// Counts the exchanges in `crossed`; returns each sender's first other outcome.
async fn send_until_failure(
    conn: kvtransfer::UcxConnection,
    crossed: Arc<AtomicU64>,
) -> Vec<Result<(), KvTransferError>> {
    let mut tasks = JoinSet::new();
    for s in 0..SENDERS {
        let (conn, crossed) = (conn.clone(), crossed.clone());
        tasks.spawn(async move {
            let data = payload(s as u8);
            loop {
                match conn
                    .send_layer(header(1_000 + s as u64, 0), data.clone())
                    .await
                {
                    Err(KvTransferError::Rejected {
                        verdict: Verdict::UnknownTransfer,
                        ..
                    }) => {
                        crossed.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
        });
    }
    let mut outcomes = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        outcomes.push(joined.unwrap());
    }
    outcomes
}

/// A server in this process whose layers land in memory, with one transfer registered.
struct Receiver {
    registry: TransferRegistry,
    sink: Arc<MemorySink>,
    endpoint: String,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), KvTransferError>>,
    free_regions: Box<dyn Fn() -> usize + Send + Sync>,
}

async fn receiver() -> Receiver {
    let server = UcxServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config())
        .await
        .unwrap();
    let endpoint = server.local_addr().unwrap().to_string();
    let free_regions = Box::new(server.free_regions());
    let registry = TransferRegistry::default();
    let sink = Arc::new(MemorySink::new(LAYOUT.num_layers, BLOCKS as usize, LAYOUT));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(server.serve(registry.clone(), sink.clone(), shutdown.clone()));
    Receiver {
        registry,
        sink,
        endpoint,
        shutdown,
        task,
        free_regions,
    }
}

/// Sends a whole registered transfer over `transport` and checks every layer bit for bit.
async fn transfer_lands_exactly(transport: &UcxTransport, r: &Receiver) {
    let id = TransferId(7);
    let blocks: Vec<u32> = (0..BLOCKS).collect();
    r.registry
        .register(Reservation {
            xfer_id: id,
            epoch: 1,
            block_ids: blocks.clone().into(),
            layout: LAYOUT,
        })
        .await
        .unwrap();
    let data: Vec<Bytes> = (0..LAYOUT.num_layers)
        .map(|l| payload(100 + l as u8))
        .collect();
    let conn = transport.connect(&r.endpoint).await.unwrap();
    send_all_layers(&conn, &header(7, 0), data.clone())
        .await
        .unwrap();
    r.registry
        .wait_complete(id, Duration::from_secs(10))
        .await
        .unwrap();
    for (layer, want) in data.iter().enumerate() {
        let got = r.sink.read_layer(layer as u32, &blocks).unwrap();
        assert!(got == want[..], "layer {layer} differs");
    }
    assert!(matches!(
        r.registry.deregister(id).await,
        Some(TransferStatus::Complete(_))
    ));
}

fn a_sender_survives_its_receiver_killed_mid_transfer() {
    runtime().block_on(async {
        let mut child = spawn_child("receiver", None);
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let endpoint = line.trim().to_owned();
        let transport = UcxTransport::new(config());
        let conn = transport.connect(&endpoint).await.unwrap();
        let crossed = Arc::new(AtomicU64::new(0));
        let sending = tokio::spawn(send_until_failure(conn, crossed.clone()));
        testkit::wait_until_async("frames crossing to the child", FAIL_WITHIN, || {
            let n = crossed.load(Ordering::Relaxed);
            async move { n >= BEFORE_KILL }
        })
        .await;
        let killed = Instant::now();
        kill(&mut child);
        let outcomes = tokio::time::timeout(FAIL_WITHIN, sending)
            .await
            .expect("sends to the killed receiver did not fail in time")
            .unwrap();
        let failed_after = killed.elapsed();
        eprintln!(
            "{} frames crossed; every sender failed within {failed_after:?} of the kill",
            crossed.load(Ordering::Relaxed),
        );
        // UCX failed them on the peer's death, not the put timeout.
        assert!(
            failed_after < Duration::from_millis(config().put_timeout_ms),
            "the sends failed only by timing out, after {failed_after:?}"
        );
        assert_eq!(outcomes.len(), SENDERS);
        for outcome in outcomes {
            assert!(outcome.is_err(), "a send to a dead peer succeeded");
        }
        // The same transport, so the same UCX worker, serves a new receiver exactly.
        let r = receiver().await;
        transfer_lands_exactly(&transport, &r).await;
        r.shutdown.cancel();
        r.task.await.unwrap().unwrap();
    });
}

fn a_receiver_survives_its_sender_killed_mid_transfer() {
    runtime().block_on(async {
        let r = receiver().await;
        let mut child = spawn_child("sender", Some(&r.endpoint));
        testkit::wait_until_async("frames from the child", FAIL_WITHIN, || {
            let n = r.registry.stats().frames_rejected;
            async move { n >= BEFORE_KILL }
        })
        .await;
        kill(&mut child);
        eprintln!(
            "{} frames crossed before the kill",
            r.registry.stats().frames_rejected
        );
        // Each of the dead sender's connections held a region with a receive posted in it:
        // every one comes back once UCX has failed or finished that receive.
        testkit::wait_until_async("the dead sender's regions freed", FAIL_WITHIN, || {
            let free = (r.free_regions)();
            async move { free == SENDERS }
        })
        .await;
        // A new sender, over the connections the dead one left behind, lands exactly.
        transfer_lands_exactly(&UcxTransport::new(config()), &r).await;
        r.shutdown.cancel();
        tokio::time::timeout(FAIL_WITHIN, r.task)
            .await
            .expect("the server did not stop after its sender died")
            .unwrap()
            .unwrap();
    });
}

/// Child: a receiver with no transfer registered; prints its endpoint, then serves until
/// killed.
fn child_receiver() {
    runtime().block_on(async {
        let server = UcxServer::bind(SocketAddr::from(([127, 0, 0, 1], 0)), config())
            .await
            .unwrap();
        println!("{}", server.local_addr().unwrap());
        server
            .serve(
                TransferRegistry::default(),
                Arc::new(DiscardSink::default()),
                CancellationToken::new(),
            )
            .await
            .unwrap();
    });
}

/// Child: sends frames to the receiver at `FISSION_UCX_PEER_ENDPOINT` until killed.
fn child_sender() {
    runtime().block_on(async {
        let endpoint = std::env::var(ENDPOINT).unwrap();
        let transport = UcxTransport::new(config());
        let conn = transport.connect(&endpoint).await.unwrap();
        let outcomes = send_until_failure(conn, Arc::new(AtomicU64::new(0))).await;
        panic!("the sender stopped before it was killed: {outcomes:?}");
    });
}

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("receiver") => return child_receiver(),
        Ok("sender") => return child_sender(),
        _ => {}
    }
    // Like libtest: the first free argument filters the tests by name; libtest's options
    // that take a value are skipped with it.
    let mut filter = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if [
            "--test-threads",
            "--skip",
            "--format",
            "--color",
            "--logfile",
            "-Z",
        ]
        .contains(&arg.as_str())
        {
            args.next();
        } else if !arg.starts_with('-') && filter.is_none() {
            filter = Some(arg);
        }
    }
    let tests: [(&str, fn()); 2] = [
        (
            "a_sender_survives_its_receiver_killed_mid_transfer",
            a_sender_survives_its_receiver_killed_mid_transfer,
        ),
        (
            "a_receiver_survives_its_sender_killed_mid_transfer",
            a_receiver_survives_its_sender_killed_mid_transfer,
        ),
    ];
    for (name, test) in tests {
        if filter.as_deref().is_some_and(|f| !name.contains(f)) {
            continue;
        }
        eprintln!("test {name} ...");
        test();
        eprintln!("test {name} ... ok");
    }
}
