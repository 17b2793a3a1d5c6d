//! `fission up --etcd URL` on an etcd that requires TLS with client certificates and has
//! user/password authentication on: every process it starts gets the etcd flags (the password
//! in its environment, never on a command line), nodes register and the gateway routes to
//! them; the printed operator command works with the password set, and a wrong password is
//! refused naming the user.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use cluster::{EtcdClientCert, EtcdCredentials, EtcdPassword, EtcdServerTls, LocalEtcd};
use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole, TlsFiles};
use testkit::fission::{wait_exit, KillOnDrop, Up, UpConfig};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const USER: &str = "fission";
const PASSWORD: &str = "e2e-etcd-secret-7f3a";

fn issue(dir: &Path, ca: &Ca, role: PeerRole, name: &str) -> TlsFiles {
    write_pem_files(dir, ca, &ca.issue(role, name).unwrap()).unwrap()
}

/// The command lines that hold `secret`, but for `fission up`'s own.
fn argv_holding(secret: &str) -> Vec<String> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let argv = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let words: Vec<String> = argv
                .split(|b| *b == 0)
                .map(|w| String::from_utf8_lossy(w).into_owned())
                .collect();
            let up = words.first().is_some_and(|w| w == FISSION)
                && words.get(1).is_some_and(|w| w == "up");
            let argv = words.join(" ");
            (!up && argv.contains(secret)).then_some(argv)
        })
        .collect()
}

/// An etcd with TLS, client-certificate auth and the user `fission`, under `dir`, and a client
/// certificate its clients may share.
fn secure_etcd(dir: &Path) -> (LocalEtcd, TlsFiles) {
    let tls_dir = dir.join("etcd-tls");
    std::fs::create_dir_all(&tls_dir).unwrap();
    let ca = generate_dev_ca().unwrap();
    let server = issue(&tls_dir, &ca, PeerRole::Etcd, "etcd");
    let etcd = LocalEtcd::start_tls(
        dir,
        EtcdServerTls {
            ca_cert: server.ca_cert,
            cert: server.cert,
            key: server.key,
        },
    )
    .expect("etcd starts with TLS");
    let client = issue(&tls_dir, &ca, PeerRole::Admin, "fission-up");
    let mut admin = etcd.config("fission");
    admin.security.tls.as_mut().unwrap().client_cert = Some(EtcdClientCert {
        cert: client.cert.clone(),
        key: client.key.clone(),
    });
    let user = EtcdCredentials {
        user: USER.into(),
        password: EtcdPassword::new(PASSWORD),
    };
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(cluster::enable_etcd_auth(
            &admin,
            &EtcdPassword::new("root-password"),
            &user,
        ))
        .unwrap();
    (etcd, client)
}

/// `--etcd-ca`, `--etcd-cert` and `--etcd-key` for `client`, and `--etcd-user`.
fn etcd_flags(client: &TlsFiles) -> Vec<String> {
    [
        ("--etcd-ca", &client.ca_cert),
        ("--etcd-cert", &client.cert),
        ("--etcd-key", &client.key),
    ]
    .into_iter()
    .flat_map(|(flag, path)| [flag.to_string(), path.display().to_string()])
    .chain(["--etcd-user".to_string(), USER.to_string()])
    .collect()
}

#[test]
fn fission_up_runs_on_an_etcd_with_tls_and_a_password() {
    let dir = tempfile::tempdir().unwrap();
    let (etcd, client) = secure_etcd(dir.path());
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.etcd = Some(etcd.endpoint());
    for (flag, path) in [
        ("--etcd-ca", &client.ca_cert),
        ("--etcd-cert", &client.cert),
        ("--etcd-key", &client.key),
    ] {
        config.args.push(flag.into());
        config.args.push(path.display().to_string());
    }
    // By value on `fission up`'s own command line, the one place the test puts it.
    config
        .args
        .extend(["--etcd-user", USER, "--etcd-password", PASSWORD].map(String::from));
    config.log = Some(dir.path().join("up.log"));
    // Returns once the gateway has discovered both nodes in etcd and finds them ready.
    let up = Up::start(&config);

    let leaks = argv_holding(PASSWORD);
    assert!(
        leaks.is_empty(),
        "the password is on a command line: {leaks:?}"
    );
    for printed in [&up.join, &up.operate] {
        assert!(!printed.contains(PASSWORD), "printed: {printed}");
        assert!(printed.contains("--etcd-user fission"), "{printed}");
    }
    let log = std::fs::read_to_string(dir.path().join("up.log")).unwrap();
    assert!(!log.contains(PASSWORD), "the password is in the log");

    // The operator's flags exactly as printed (`list` reads etcd only, and accepts the node
    // certificate flags so one line works for both subcommands), with the password in the
    // environment.
    let printed = up.admin_credentials();
    let etcd_flags: Vec<&[String]> = printed
        .chunks(2)
        .filter(|pair| pair[0].starts_with("--etcd-"))
        .collect();
    assert_eq!(etcd_flags.len(), 4, "{printed:?}");
    let list = |password: &str| {
        Command::new(FISSION)
            .args(["nodes", "list", "--json", "--etcd", &up.etcd])
            .args(&printed)
            .env("FISSION_ETCD_PASSWORD", password)
            .output()
            .unwrap()
    };
    let listed = list(PASSWORD);
    assert!(listed.status.success(), "{listed:?}");
    let nodes: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(nodes["nodes"].as_array().map(Vec::len), Some(2), "{nodes}");

    let refused = list("not-the-password");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("authentication failed for etcd user fission"),
        "{stderr}"
    );
}

#[test]
fn a_node_with_a_wrong_etcd_password_exits_naming_the_user() {
    let dir = tempfile::tempdir().unwrap();
    let (etcd, client) = secure_etcd(dir.path());
    let log = dir.path().join("node.log");
    let mut node = KillOnDrop(
        Command::new(FISSION)
            .args(["node", "start", "--role", "decode", "--model"])
            .arg(testkit::fission::stories_dir())
            .args(["--etcd", &etcd.endpoint(), "--node-id", "decode-wrong"])
            .args([
                "--num-kv-blocks",
                "64",
                "--kv-transport",
                "tcp",
                "--insecure",
            ])
            .args(etcd_flags(&client))
            .env("FISSION_ETCD_PASSWORD", "not-the-password")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let status = wait_exit(&mut node.0, Duration::from_secs(120));
    assert!(!status.success(), "{status}");
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(
        log.contains("authentication failed for etcd user fission"),
        "{log}"
    );
    assert!(!log.contains("not-the-password"), "{log}");
    // Refused before the weights load, not after.
    assert!(!log.contains("kv cache allocated"), "{log}");
}
