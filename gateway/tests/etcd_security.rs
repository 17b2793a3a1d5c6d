//! `fission-gateway` as a real process against an etcd that requires TLS with client
//! certificates and has user/password authentication on: it discovers a node registered
//! there, and with a wrong password it exits at start-up saying which user etcd refused.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cluster::{
    EtcdClientCert, EtcdConfig, EtcdCredentials, EtcdPassword, EtcdServerTls, LocalEtcd,
    NodeRecord, Registration, RegistrationConfig, Role,
};
use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole, TlsFiles};
use kv_types::KvLayout;
use testkit::fission::{free_port, wait_exit, KillOnDrop};
use testkit::wait_until_async;

const GATEWAY: &str = env!("CARGO_BIN_EXE_fission-gateway");
const MODEL_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/models/stories260K"
);
const CLUSTER: &str = "fission";
const USER: &str = "fission";
const PASSWORD: &str = "gateway-etcd-secret";
const WAIT: Duration = Duration::from_secs(60);

/// An etcd with TLS, client-certificate auth and password auth, and the CA that runs it.
struct SecureEtcd {
    etcd: LocalEtcd,
    ca: Ca,
    dir: tempfile::TempDir,
}

impl SecureEtcd {
    /// Starts etcd and enables authentication with the user `fission`, which may use the
    /// cluster's keys.
    async fn start() -> SecureEtcd {
        let dir = tempfile::tempdir().unwrap();
        let ca = generate_dev_ca().unwrap();
        let server = issue(dir.path(), &ca, PeerRole::Etcd, "etcd");
        let tls = EtcdServerTls {
            ca_cert: server.ca_cert,
            cert: server.cert,
            key: server.key,
        };
        let etcd = SecureEtcd {
            etcd: LocalEtcd::start_tls(dir.path(), tls).unwrap(),
            ca,
            dir,
        };
        let mut admin = etcd.etcd_config(PeerRole::Admin, "admin");
        admin.security.credentials = None;
        let user = EtcdCredentials {
            user: USER.into(),
            password: EtcdPassword::new(PASSWORD),
        };
        cluster::enable_etcd_auth(&admin, &EtcdPassword::new("root-password"), &user)
            .await
            .unwrap();
        etcd
    }

    fn issue(&self, role: PeerRole, name: &str) -> TlsFiles {
        issue(self.dir.path(), &self.ca, role, name)
    }

    /// A gateway with the etcd flags for its certificate and the password in `password_file`.
    fn gateway(&self, addr: &str, password_file: &Path, log: &Path) -> KillOnDrop {
        let files = self.issue(PeerRole::Gateway, "gateway");
        KillOnDrop(
            Command::new(GATEWAY)
                .args(["--addr", addr, "--model-dir", MODEL_DIR, "--insecure"])
                .args(["--etcd", &self.etcd.endpoint(), "--cluster", CLUSTER])
                .arg("--etcd-ca")
                .arg(&files.ca_cert)
                .arg("--etcd-cert")
                .arg(&files.cert)
                .arg("--etcd-key")
                .arg(&files.key)
                .args(["--etcd-user", USER])
                .arg("--etcd-password-file")
                .arg(password_file)
                .env("RUST_LOG", "debug")
                .env_remove("FISSION_ETCD_PASSWORD")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(log).unwrap())
                .spawn()
                .unwrap(),
        )
    }

    /// How `name` of `role` reaches etcd through the cluster crate, as the user `fission`.
    fn etcd_config(&self, role: PeerRole, name: &str) -> EtcdConfig {
        let files = self.issue(role, name);
        let mut config = self.etcd.config(CLUSTER);
        config.security.tls.as_mut().unwrap().client_cert = Some(EtcdClientCert {
            cert: files.cert,
            key: files.key,
        });
        config.security.credentials = Some(EtcdCredentials {
            user: USER.into(),
            password: EtcdPassword::new(PASSWORD),
        });
        config
    }
}

/// A certificate for `name` of `role`, written under `dir/tls`.
fn issue(dir: &Path, ca: &Ca, role: PeerRole, name: &str) -> TlsFiles {
    let dir = dir.join("tls");
    std::fs::create_dir_all(&dir).unwrap();
    write_pem_files(&dir, ca, &ca.issue(role, name).unwrap()).unwrap()
}

fn node_record(node_id: &str) -> NodeRecord {
    NodeRecord {
        node_id: node_id.into(),
        role: Role::Decode,
        version: "0.1.0".into(),
        grpc_endpoint: format!("127.0.0.1:{}", free_port()),
        kv_endpoint: String::new(),
        model_id: "stories260K".into(),
        model_fingerprint: cluster::model_fingerprint(Path::new(MODEL_DIR)).unwrap_or_default(),
        kv_layout: KvLayout::SMOLLM2_135M_F32,
        total_kv_blocks: 64,
        kv_transport: "tcp".into(),
        host_id: String::new(),
        architecture: String::new(),
        weight_dtype: String::new(),
        draining: false,
    }
}

async fn gateway_nodes(client: &reqwest::Client, addr: &str) -> Vec<String> {
    let Ok(response) = client.get(format!("http://{addr}/info")).send().await else {
        return Vec::new();
    };
    let info: serde_json::Value = response.json().await.unwrap_or_default();
    info["backend"]["nodes"]
        .as_array()
        .map(|nodes| {
            nodes
                .iter()
                .filter_map(|n| n["node_id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn the_gateway_discovers_nodes_through_a_tls_etcd_as_an_etcd_user() {
    let etcd = SecureEtcd::start().await;
    let password_file = etcd.dir.path().join("etcd-password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let log = etcd.dir.path().join("gateway.log");
    let addr = format!("127.0.0.1:{}", free_port());
    let _gateway = etcd.gateway(&addr, &password_file, &log);

    let mut config = RegistrationConfig::new(etcd.etcd_config(PeerRole::Decode, "decode-0"));
    config.lease_ttl_s = 5;
    let node = Registration::start(config, node_record("decode-0"))
        .await
        .unwrap();
    let client = reqwest::Client::new();
    wait_until_async("the gateway lists decode-0", WAIT, || {
        let client = client.clone();
        let addr = addr.clone();
        async move { gateway_nodes(&client, &addr).await == ["decode-0"] }
    })
    .await;

    node.revoke().await.unwrap();
    wait_until_async("the gateway drops decode-0", WAIT, || {
        let client = client.clone();
        let addr = addr.clone();
        async move { gateway_nodes(&client, &addr).await.is_empty() }
    })
    .await;
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        !log.contains(PASSWORD),
        "the password is in the log:\n{log}"
    );
}

#[tokio::test]
async fn a_wrong_etcd_password_stops_the_gateway_at_start_up_naming_the_user() {
    let etcd = SecureEtcd::start().await;
    let password_file = etcd.dir.path().join("etcd-password");
    std::fs::write(&password_file, "not-the-password\n").unwrap();
    let log = etcd.dir.path().join("gateway.log");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut gateway = etcd.gateway(&addr, &password_file, &log);

    let status = wait_exit(&mut gateway.0, WAIT);
    assert!(!status.success(), "{status}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("authentication failed for etcd user fission"),
        "{log}"
    );
    assert!(!log.contains("not-the-password"), "{log}");
}
