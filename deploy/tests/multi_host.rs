//! The cluster off loopback: etcd, the gateway, 2 prefill and 2 decode nodes, each on its own
//! "host" (a network namespace with its own address on a private subnet, `testkit::netns`),
//! over mutual TLS with certificates issued by `fission certs` for those addresses. The
//! cluster serves the reference ids across the hosts; then one decode host's link is cut
//! mid-stream, and its streams continue elsewhere as from a hung node, with the same text; the
//! link comes back and that node itself serves again (its own counter moves), with every KV
//! gauge back to 0.
//!
//! Needs root (`ip netns`). Skipped with a message where namespaces cannot be made, and
//! required with `FISSION_REQUIRE_TEST_TOOLS=1` (as `./deploy/test.sh` sets).

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testkit::fission::{http_get, metric, stories_dir, KillOnDrop};
use testkit::netns::Lab;
use testkit::streams::{self, Record};
use testkit::wait_until;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const HOSTS: &[&str] = &[
    "etcd",
    "gateway",
    "prefill-0",
    "prefill-1",
    "decode-0",
    "decode-1",
    "client",
];
const GRPC_PORT: u16 = 50051;
const METRICS_PORT: u16 = 9100;
const KV_PORT: u16 = 7000;
const HTTP_PORT: u16 = 8080;
const STALL: Duration = Duration::from_millis(1000);
const STREAMS: usize = 4;
const STREAM_TOKENS: usize = 300;

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lab_or_skip() -> Option<Lab> {
    match Lab::new(HOSTS) {
        Ok(lab) => Some(lab),
        Err(why) if !testkit::phoenix::tools_required() => {
            eprintln!("SKIPPED: network namespaces cannot be made here ({why}); run as root with iproute2");
            None
        }
        Err(why) => panic!("network namespaces are required (FISSION_REQUIRE_TEST_TOOLS=1): {why}"),
    }
}

/// How the nodes' certificates name them.
#[derive(Clone, Copy, PartialEq)]
enum Names {
    /// Each its own certificate for its own address: peers check the address they dial.
    PerHost,
    /// One certificate per role, all with the DNS name [`SHARED_NAME`], which every client
    /// checks instead of the address (`--tls-server-name`): a pool behind one Secret.
    Shared,
}

const SHARED_NAME: &str = "fission-node";

/// `fission certs init`, then the certificates `names` asks for.
fn issue_certs(lab: &Lab, dir: &Path, names: Names) {
    let run = |args: &[&str]| {
        let out = Command::new(FISSION).args(args).output().unwrap();
        assert!(out.status.success(), "fission {args:?}: {out:?}");
    };
    let out = dir.to_str().unwrap();
    run(&["certs", "init", "--out", out]);
    let (ca, key) = (format!("{out}/ca.pem"), format!("{out}/ca.key"));
    for host in ["gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"] {
        let role = host.split('-').next().unwrap();
        let (name, san) = match names {
            Names::PerHost => (host.to_string(), lab.host(host).ip.to_string()),
            Names::Shared => (role.to_string(), SHARED_NAME.to_string()),
        };
        run(&[
            "certs",
            "issue",
            "--ca-cert",
            &ca,
            "--ca-key",
            &key,
            "--role",
            role,
            "--name",
            &name,
            "--san",
            &san,
            "--out",
            out,
        ]);
    }
}

fn tls_flags(dir: &Path, host: &str, names: Names) -> Vec<String> {
    let d = dir.display();
    let name = match names {
        Names::PerHost => host,
        Names::Shared => host.split('-').next().unwrap(),
    };
    let mut flags = vec![
        "--tls-ca".into(),
        format!("{d}/ca.pem"),
        "--tls-cert".into(),
        format!("{d}/{name}.pem"),
        "--tls-key".into(),
        format!("{d}/{name}.key"),
    ];
    if names == Names::Shared {
        flags.extend(["--tls-server-name".into(), SHARED_NAME.into()]);
    }
    flags
}

fn spawn(mut cmd: Command, log: &Path) -> KillOnDrop {
    KillOnDrop(
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

struct Cluster {
    lab: Lab,
    url: String,
    // Held for their Drop, which kills them; the lab's Drop removes what is left.
    _procs: Vec<KillOnDrop>,
    _dir: tempfile::TempDir,
}

impl Cluster {
    fn start(lab: Lab, names: Names) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("tls");
        issue_certs(&lab, &certs, names);
        let etcd_ip = lab.host("etcd").ip;
        let etcd_url = format!("http://{etcd_ip}:2379");
        let mut procs = Vec::new();
        let mut etcd = lab.command("etcd", "etcd");
        etcd.arg("--data-dir")
            .arg(dir.path().join("etcd"))
            .args(["--listen-client-urls", &etcd_url])
            .args(["--advertise-client-urls", &etcd_url])
            .args(["--listen-peer-urls", "http://127.0.0.1:2380"]);
        procs.push(spawn(etcd, &dir.path().join("etcd.log")));

        for node in ["prefill-0", "prefill-1", "decode-0", "decode-1"] {
            let role = node.split('-').next().unwrap();
            let ip = lab.host(node).ip;
            let mut cmd = lab.command(node, FISSION);
            cmd.args(["node", role, "--model"])
                .arg(stories_dir())
                .args(["--node-id", node, "--num-kv-blocks", "256"])
                .args([
                    "--etcd",
                    &etcd_url,
                    "--cluster",
                    "lab",
                    "--lease-ttl-s",
                    "3",
                ])
                .args(["--kv-transport", "quic"])
                // Namespaces share the kernel (and /dev/shm): each stands for a host of its
                // own, so the nodes must not pick shared memory between them.
                .env("FISSION_HOST_ID", node)
                .arg(format!("--grpc-addr={ip}:{GRPC_PORT}"))
                .arg(format!("--metrics-addr={ip}:{METRICS_PORT}"))
                .arg(format!("--advertise-host={ip}"))
                .args(tls_flags(&certs, node, names));
            if role == "decode" {
                cmd.arg(format!("--kv-addr={ip}:{KV_PORT}"))
                    // Slow enough steps for a link to go down mid-stream.
                    .env("FISSION_DEBUG_STEP_DELAY_MS", "15");
            }
            procs.push(spawn(cmd, &dir.path().join(format!("{node}.log"))));
        }

        let gw_ip = lab.host("gateway").ip;
        let mut gateway = lab.command("gateway", FISSION);
        gateway
            .args(["gateway", "--model-dir"])
            .arg(stories_dir())
            .arg(format!("--addr={gw_ip}:{HTTP_PORT}"))
            .args(["--etcd", &etcd_url, "--cluster", "lab"])
            // Spread the requests so that every host serves some.
            .args(["--routing", "round-robin"])
            .arg(format!("--max-stall-ms={}", STALL.as_millis()))
            .args(tls_flags(&certs, "gateway", names))
            .env_remove("FISSION_API_KEY");
        procs.push(spawn(gateway, &dir.path().join("gateway.log")));

        // From here this thread, and the clients it starts, are on the client host.
        lab.enter("client").unwrap();
        let url = format!("http://{gw_ip}:{HTTP_PORT}");
        let c = Cluster {
            lab,
            url,
            _procs: procs,
            _dir: dir,
        };
        wait_until(
            "4 nodes ready at the gateway",
            Duration::from_secs(90),
            || c.ready_nodes().len() == 4,
        );
        c
    }

    fn ready_nodes(&self) -> Vec<String> {
        http_get(&format!("{}/info", self.url))
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
            .and_then(|v| {
                v["backend"]["nodes"].as_array().map(|a| {
                    a.iter()
                        .filter(|n| n["ready"] == true)
                        .filter_map(|n| n["node_id"].as_str().map(str::to_string))
                        .collect()
                })
            })
            .unwrap_or_default()
    }

    fn metrics(&self, node: &str) -> String {
        format!("http://{}:{METRICS_PORT}/metrics", self.lab.host(node).ip)
    }

    fn gateway_metric(&self, name: &str) -> f64 {
        testkit::fission::metric_sum(&format!("{}/metrics", self.url), name)
    }

    fn assert_kv_released(&self) {
        for node in ["prefill-0", "prefill-1", "decode-0", "decode-1"] {
            let gauges: &[&str] = if node.starts_with("decode") {
                &[
                    "fission_decode_kv_blocks_used",
                    "fission_decode_kv_blocks_reserved",
                    "fission_decode_reservations_outstanding",
                ]
            } else {
                &["fission_prefill_kv_blocks_used"]
            };
            let m = self.metrics(node);
            for g in gauges {
                wait_until(
                    &format!("{node} {g} back to 0"),
                    Duration::from_secs(20),
                    || metric(&m, g) == 0.0,
                );
            }
        }
    }
}

fn stream_body(client: usize) -> Value {
    json!({"inputs": format!("Stream {client}: the little dog ran"),
           "parameters": {"max_new_tokens": STREAM_TOKENS, "ignore_eos": true}})
}

fn all_ok(records: &[Record], what: &str) {
    let failed = records.iter().filter(|r| !r.ok()).count();
    assert_eq!(failed, 0, "{what}:\n{}", streams::summary(records));
}

/// The reference ids, twice, through every prefill and decode host (round-robin spreads them).
fn serves_the_reference_on_every_host(c: &Cluster) {
    let refs: Value = serde_json::from_str(
        &std::fs::read_to_string(stories_dir().join("reference_greedy.json")).unwrap(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let http = reqwest::Client::new();
    for round in 0..2 {
        for r in refs["references"].as_array().unwrap() {
            let resp: Value = rt.block_on(async {
                http.post(format!("{}/generate", c.url))
                    .json(&json!({"inputs": r["prompt"], "parameters": {"max_new_tokens": 32, "details": true}}))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap()
            });
            let ids: Vec<u64> = resp["details"]["tokens"]
                .as_array()
                .unwrap_or_else(|| panic!("round {round}: {resp}"))
                .iter()
                .map(|t| t["id"].as_u64().unwrap())
                .collect();
            let want: Vec<u64> = r["output_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert_eq!(ids, want[..ids.len()], "round {round}: {}", r["prompt"]);
            assert!(ids.len() >= 16, "{resp}");
        }
    }
    for node in ["prefill-0", "prefill-1"] {
        let m = http_get(&c.metrics(node)).unwrap_or_default();
        assert!(
            metric(&c.metrics(node), "fission_prefill_prompts_total") >= 1.0,
            "{node} prefilled nothing: {}",
            m.lines()
                .filter(|l| l.contains("prompts"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    for node in ["decode-0", "decode-1"] {
        let served =
            testkit::fission::metric_sum(&c.metrics(node), "fission_decode_generated_tokens_total");
        assert!(served >= 1.0, "{node} decoded nothing");
    }
    // Across hosts the KV goes over the network, never shared memory (issue 34).
    for node in ["prefill-0", "prefill-1"] {
        let pushes = |transport: &str| {
            metric(
                &c.metrics(node),
                &format!("fission_prefill_kv_pushes_total{{transport=\"{transport}\"}}"),
            )
        };
        assert!(pushes("quic") >= 1.0, "{node} pushed nothing over QUIC");
        assert_eq!(pushes("shm"), 0.0, "{node} pushed through shm across hosts");
    }
}

#[test]
fn a_pool_sharing_one_certificate_name_serves_across_hosts() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(lab) = lab_or_skip() else {
        return;
    };
    let c = Cluster::start(lab, Names::Shared);
    serves_the_reference_on_every_host(&c);
    c.assert_kv_released();
}

#[test]
fn a_cluster_across_hosts_serves_the_reference_and_survives_a_cut_link() {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(lab) = lab_or_skip() else {
        return;
    };
    // The lab goes away (its namespaces and whatever runs in them) when this thread's
    // cluster drops, also on a failed assertion.
    let c = Cluster::start(lab, Names::PerHost);
    serves_the_reference_on_every_host(&c);

    // Each stream's tokens, uninterrupted (stories260K may end a story before
    // STREAM_TOKENS: it stops on BOS as well as EOS).
    let references: Vec<Record> = (0..STREAMS)
        .map(|i| {
            let r = streams::run(&c.url, 1, 1, Duration::from_secs(60), move |_, _| {
                stream_body(i)
            });
            all_ok(&r, "reference stream");
            r[0].clone()
        })
        .collect();

    // Pull decode-0's cable while it streams.
    let url = c.url.clone();
    let load = std::thread::spawn(move || {
        streams::run(&url, STREAMS, 1, Duration::from_secs(90), |client, _| {
            stream_body(client)
        })
    });
    let m = c.metrics("decode-0");
    wait_until("decode-0 generating", Duration::from_secs(60), || {
        metric(&m, "fission_decode_running_sequences") >= 1.0
    });
    c.lab.cut("decode-0");
    let cut = Instant::now();
    wait_until(
        "decode-0 suspect at the gateway",
        STALL + Duration::from_secs(3),
        || !c.ready_nodes().iter().any(|n| n == "decode-0"),
    );
    let mut records = load.join().unwrap();
    records.sort_by_key(|r| r.client);
    all_ok(&records, "across the cut link");
    let summary = streams::summary(&records);
    for (r, want) in records.iter().zip(&references) {
        assert_eq!(
            r.token_ids, want.token_ids,
            "no token twice, none missing, none other:\n{summary}"
        );
        assert_eq!(
            r.text, want.text,
            "the moved stream reads as an uninterrupted one"
        );
        if r.started <= cut && r.end() > cut {
            assert!(
                r.max_gap <= STALL + Duration::from_secs(3),
                "a stream waited {:?} between tokens",
                r.max_gap
            );
        }
    }
    assert!(c.gateway_metric("fission_gateway_migrations_total") >= 1.0);
    println!(
        "decode-0's link cut mid-stream: {} streams completed, the last {:?} after the cut",
        records.len(),
        records.iter().map(Record::end).max().unwrap() - cut
    );

    // The cable back: decode-0 is routable again and gives back what it held.
    c.lab.restore("decode-0");
    wait_until("decode-0 ready again", Duration::from_secs(30), || {
        c.ready_nodes().iter().any(|n| n == "decode-0")
    });
    c.assert_kv_released();
    // Read once decode-0 holds nothing: the streams it had when the link went are over, so
    // only new work moves this counter.
    let decode0 = c.metrics("decode-0");
    let generated = "fission_decode_generated_tokens_total";
    let before = testkit::fission::metric_sum(&decode0, generated);
    let after = streams::run(
        &c.url,
        4,
        1,
        Duration::from_secs(60),
        |client, _| json!({"inputs": format!("After {client}"), "parameters": {"max_new_tokens": 8}}),
    );
    all_ok(&after, "after the link came back");
    // Not only the cluster: decode-0 itself serves again (round-robin gives it some of the 4).
    let served = testkit::fission::metric_sum(&decode0, generated) - before;
    assert!(
        served >= 1.0,
        "decode-0 generated no token after its link came back (before: {before})"
    );
    println!("decode-0 generated {served} tokens after its link came back");
}
