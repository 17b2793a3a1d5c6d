//! The nodes' trust boundary across real processes: `fission up` (1 prefill, 1 decode, QUIC)
//! gives every process a certificate for its role, and each node method answers only the
//! roles the policy names. A client with no certificate or a self-signed one is refused in the
//! TLS handshake; a CA-signed certificate of the wrong role is refused per call; the
//! gateway's own calls (a whole generation) succeed; the admin certificate drains a node. The
//! decode node's KV port completes the QUIC handshake for a prefill certificate only.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use identity::{generate_dev_ca, GrpcSecurity, PeerRole, TlsFiles, TlsIdentity};
use kvtransfer::{
    KvConnection, KvDtype, KvLayout, KvTransferError, KvTransport, LayerHeader, QuicConfig,
    QuicTransport, TransferId, Verdict,
};
use proto::v1::decode_client::DecodeClient;
use proto::v1::node_client::NodeClient;
use proto::v1::prefill_client::PrefillClient;
use proto::v1::{
    CacheEventsRequest, DoneRequest, DrainRequest, GenerateUp, InfoRequest, PrefillRequest,
    RenewRequest,
};
use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Code;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");

type Outcome = (&'static str, Result<(), tonic::Status>);

/// Every method a node of `role` serves, called with `channel`; the status of each. Drain
/// only with `drain`: a Drain that is let through drains the node.
async fn call_every_method(channel: Channel, role: &str, drain: bool) -> Vec<Outcome> {
    let mut node = NodeClient::new(channel.clone());
    let mut out: Vec<Outcome> = vec![
        ("Node/Info", node.info(InfoRequest {}).await.map(drop)),
        (
            "Node/CacheEvents",
            node.cache_events(CacheEventsRequest {}).await.map(drop),
        ),
    ];
    if role == "decode" {
        let mut decode = DecodeClient::new(channel.clone());
        let up = tokio_stream::iter(Vec::<GenerateUp>::new());
        out.push(("Decode/Generate", decode.generate(up).await.map(drop)));
        out.push((
            "Decode/Done",
            decode.done(DoneRequest::default()).await.map(drop),
        ));
        out.push((
            "Decode/Renew",
            decode.renew(RenewRequest::default()).await.map(drop),
        ));
    } else {
        let mut prefill = PrefillClient::new(channel.clone());
        out.push((
            "Prefill/Prefill",
            prefill.prefill(PrefillRequest::default()).await.map(drop),
        ));
    }
    if drain {
        out.push(("Node/Drain", node.drain(DrainRequest {}).await.map(drop)));
    }
    out
}

/// Who may call what (`node_common::access::POLICY`), restated: the test fails if either
/// drifts.
fn allowed(method: &str, role: PeerRole) -> bool {
    use PeerRole::*;
    match method {
        "Node/Info" | "Node/Drain" => matches!(role, Gateway | Admin),
        "Node/CacheEvents" | "Decode/Generate" | "Prefill/Prefill" => role == Gateway,
        "Decode/Done" | "Decode/Renew" => role == Prefill,
        _ => false,
    }
}

fn files(dir: &Path, name: &str) -> TlsFiles {
    TlsFiles {
        ca_cert: dir.join("ca.pem"),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}.key")),
    }
}

/// The value after `flag` in a printed command line.
fn flag_value(command: &str, flag: &str) -> PathBuf {
    let words: Vec<&str> = command.split_whitespace().collect();
    let i = words
        .iter()
        .position(|w| *w == flag)
        .unwrap_or_else(|| panic!("{flag} in {command}"));
    PathBuf::from(words[i + 1])
}

async fn connect(security: &GrpcSecurity, addr: &str) -> Result<Channel, String> {
    security
        .endpoint(addr)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

/// A channel that trusts the cluster CA but presents no certificate.
async fn no_certificate(ca: &Path, addr: &str) -> Result<Channel, String> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read_to_string(ca).unwrap()));
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))
}

/// A refused handshake fails either the connect or (TLS 1.3: the client may finish first)
/// every call; never with PermissionDenied, which would mean the server accepted the peer.
async fn assert_refused_in_handshake(channel: Result<Channel, String>, role: &str, who: &str) {
    let Ok(channel) = channel else { return };
    for (method, result) in call_every_method(channel, role, true).await {
        let status = result.expect_err(&format!("{who} called {role} {method}"));
        assert_ne!(
            status.code(),
            Code::PermissionDenied,
            "{who}: {role} {method}: the handshake passed: {status}"
        );
        assert_ne!(status.code(), Code::Ok);
    }
}

/// One layer of an unregistered transfer, pushed to `endpoint` as `identity`.
async fn push_one_layer(identity: &TlsIdentity, endpoint: &str) -> Result<(), KvTransferError> {
    let transport = QuicTransport::new(identity, QuicConfig::default())?;
    let header = LayerHeader {
        xfer_id: TransferId(0x0bad_cafe),
        epoch: 1,
        layer: 0,
        layout: KvLayout {
            dtype: KvDtype::F32,
            num_layers: 2,
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
            windows: Default::default(),
        },
        block_ids: vec![0u32].into(),
        traceparent: None,
    };
    let payload = vec![0u8; header.expected_payload_bytes()? as usize];
    let conn = transport.connect(endpoint).await?;
    conn.send_layer(header, tonic::codegen::Bytes::from(payload))
        .await
        .map(drop)
}

#[test]
fn every_node_method_refuses_peers_outside_the_cluster_and_roles_outside_its_policy() {
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.args.push("--max-local-prefill-tokens=0".into());
    let up = Up::start(&config);
    let rt = tokio::runtime::Runtime::new().unwrap();

    // The gateway's calls work: a whole generation through prefill and decode.
    let body: Value = rt.block_on(async {
        reqwest::Client::new()
            .post(format!("{}/generate", up.url))
            .json(&json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    });
    assert!(
        body["generated_text"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{body}"
    );

    // The certificates `fission up` wrote: node roles for joining nodes, admin for operators,
    // and (beside admin's) the gateway's.
    let join_dir = flag_value(&up.join, "--tls-ca")
        .parent()
        .unwrap()
        .to_path_buf();
    let tls_dir = flag_value(&up.operate, "--tls-ca")
        .parent()
        .unwrap()
        .to_path_buf();
    let ca = join_dir.join("ca.pem");
    let identity = |dir: &Path, name: &str| TlsIdentity::from_files(&files(dir, name)).unwrap();
    let signed = [
        (PeerRole::Decode, identity(&join_dir, "decode")),
        (PeerRole::Prefill, identity(&join_dir, "prefill")),
        (PeerRole::Admin, identity(&tls_dir, "admin")),
        (PeerRole::Gateway, identity(&tls_dir, "gateway")),
    ];
    // A gateway certificate from another CA, presented by a client that trusts the real one.
    let stranger_ca = generate_dev_ca().unwrap();
    let stranger_cert = stranger_ca.issue(PeerRole::Gateway, "stranger").unwrap();
    let self_signed = TlsIdentity::from_pem(
        &std::fs::read_to_string(&ca).unwrap(),
        &stranger_cert.cert_pem,
        &stranger_cert.key_pem,
    )
    .unwrap();

    rt.block_on(async {
        for (node, role) in [("decode-0", "decode"), ("prefill-0", "prefill")] {
            let addr = &up.grpc.iter().find(|(n, _)| n == node).unwrap().1;
            // Plaintext, no certificate, a gateway certificate from another CA.
            let plain = GrpcSecurity::Insecure;
            assert_refused_in_handshake(connect(&plain, addr).await, role, "plaintext").await;
            assert_refused_in_handshake(no_certificate(&ca, addr).await, role, "no certificate")
                .await;
            let foreign = GrpcSecurity::Mtls {
                identity: self_signed.clone(),
                server_name: None,
            };
            assert_refused_in_handshake(
                connect(&foreign, addr).await,
                role,
                "another CA's gateway",
            )
            .await;

            // CA-signed certificates: each method answers exactly the roles the policy names.
            for (peer, identity) in &signed {
                let security = GrpcSecurity::Mtls {
                    identity: identity.clone(),
                    server_name: None,
                };
                let channel = connect(&security, addr)
                    .await
                    .expect("a CA-signed peer connects");
                // Drain only where it must be refused; the admin drain is checked below.
                let drain = !allowed("Node/Drain", *peer);
                for (method, result) in call_every_method(channel, role, drain).await {
                    let denied = matches!(&result, Err(s) if s.code() == Code::PermissionDenied);
                    assert_eq!(
                        denied,
                        !allowed(method, *peer),
                        "{peer} calling {role} {method}: {result:?}"
                    );
                }
            }
            let denied = testkit::fission::metric_sum(
                up.metrics_url(node),
                "fission_node_grpc_denied_total",
            );
            assert!(denied > 0.0, "{node} counts its refusals");
        }
    });
    assert_eq!(
        up.gateway_nodes().len(),
        2,
        "no refused Drain drained a node"
    );

    // The decode node's KV port completes the handshake for a prefill certificate only.
    rt.block_on(async {
        let addr = &up.grpc.iter().find(|(n, _)| n == "decode-0").unwrap().1;
        let gateway = GrpcSecurity::Mtls {
            identity: signed[3].1.clone(),
            server_name: None,
        };
        let channel = connect(&gateway, addr).await.unwrap();
        let kv_endpoint = NodeClient::new(channel)
            .info(InfoRequest {})
            .await
            .unwrap()
            .into_inner()
            .kv_endpoint;
        let refused_frames = || {
            testkit::fission::metric_sum(up.metrics_url("decode-0"), "fission_decode_errors_total")
        };
        let before = refused_frames();
        for (peer, identity) in &signed {
            let result = push_one_layer(identity, &kv_endpoint).await;
            match peer {
                // Through the handshake: refused for naming no reservation, nothing else.
                PeerRole::Prefill => assert!(
                    matches!(
                        result,
                        Err(KvTransferError::Rejected {
                            verdict: Verdict::UnknownTransfer,
                            ..
                        })
                    ),
                    "{peer}: {result:?}"
                ),
                // Refused by the server's certificate check: the connection closes (TLS 1.3
                // lets the client finish first, so the first write or read may be what fails).
                _ => assert!(
                    matches!(
                        result,
                        Err(KvTransferError::Connection { .. } | KvTransferError::Stream { .. })
                    ),
                    "{peer} on the KV port: {result:?}"
                ),
            }
        }
        // The decode node read one frame, the prefill node's: the others sent none it took.
        assert_eq!(
            refused_frames() - before,
            1.0,
            "KV frames the decode node refused"
        );
    });

    // The operator's admin certificate drains a node through `fission nodes drain`.
    let drained = std::process::Command::new(FISSION)
        .args(["nodes", "drain", "prefill-0", "--etcd", &up.etcd])
        .args(up.admin_credentials())
        .output()
        .unwrap();
    assert!(
        drained.status.success(),
        "{}",
        String::from_utf8_lossy(&drained.stderr)
    );
    testkit::wait_until("prefill-0 to leave", Duration::from_secs(30), || {
        !up.gateway_nodes().iter().any(|n| n == "prefill-0")
    });
    // Without a certificate the same command is refused before it dials anything.
    let refused = std::process::Command::new(FISSION)
        .args(["nodes", "drain", "decode-0", "--etcd", &up.etcd])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--insecure"), "{stderr}");
}
