//! Registration and discovery against a real etcd that requires TLS with client certificates
//! and has user/password authentication enabled, and the ways in which it refuses a client.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use cluster::{
    enable_etcd_auth, list_nodes, ClusterError, DiscoveryConfig, EtcdClientCert, EtcdConfig,
    EtcdCredentials, EtcdDiscovery, EtcdPassword, EtcdServerTls, LocalEtcd, Registration,
    RegistrationConfig, Role,
};
use common::{record, wait_members};
use identity::{generate_dev_ca, write_pem_files, Ca, PeerRole, TlsFiles};

const WAIT: Duration = Duration::from_secs(10);
const CLUSTER: &str = "test";
const USER: &str = "fission";
const PASSWORD: &str = "correct horse battery staple";

/// An etcd with TLS and client-certificate auth from its own dev CA, in a temp dir.
struct SecureEtcd {
    etcd: LocalEtcd,
    ca: Ca,
    tls_dir: PathBuf,
    _dir: tempfile::TempDir,
}

impl SecureEtcd {
    fn start() -> anyhow::Result<SecureEtcd> {
        let dir = tempfile::tempdir()?;
        let tls_dir = dir.path().join("tls");
        std::fs::create_dir_all(&tls_dir)?;
        let ca = generate_dev_ca()?;
        let server = write_pem_files(&tls_dir, &ca, &ca.issue(PeerRole::Etcd, "etcd")?)?;
        let etcd = LocalEtcd::start_tls(
            dir.path(),
            EtcdServerTls {
                ca_cert: server.ca_cert,
                cert: server.cert,
                key: server.key,
            },
        )
        .context("etcd starts with TLS")?;
        Ok(SecureEtcd {
            etcd,
            ca,
            tls_dir,
            _dir: dir,
        })
    }

    fn issue(&self, role: PeerRole, name: &str) -> TlsFiles {
        write_pem_files(&self.tls_dir, &self.ca, &self.ca.issue(role, name).unwrap()).unwrap()
    }

    /// How `name` of `role` reaches etcd: its certificate, and `user`/`password` if given.
    fn config(&self, role: PeerRole, name: &str, user: Option<(&str, &str)>) -> EtcdConfig {
        let files = self.issue(role, name);
        let mut config = self.etcd.config(CLUSTER);
        let tls = config
            .security
            .tls
            .as_mut()
            .expect("a TLS etcd's config has TLS");
        tls.client_cert = Some(EtcdClientCert {
            cert: files.cert,
            key: files.key,
        });
        config.security.credentials = user.map(|(user, password)| EtcdCredentials {
            user: user.into(),
            password: EtcdPassword::new(password),
        });
        config
    }

    /// Root, and the user `fission` that may use the cluster's keys; then `auth enable`.
    async fn enable_auth(&self) -> anyhow::Result<()> {
        let admin = self.config(PeerRole::Admin, "admin", None);
        let user = EtcdCredentials {
            user: USER.into(),
            password: EtcdPassword::new(PASSWORD),
        };
        enable_etcd_auth(&admin, &EtcdPassword::new("root-password"), &user).await?;
        Ok(())
    }
}

fn reg_config(etcd: EtcdConfig) -> RegistrationConfig {
    let mut config = RegistrationConfig::new(etcd);
    config.load_publish_interval_ms = 100;
    // These tests time registration after etcd starts, not the backoff's cap.
    config.retry_max_ms = 1_000;
    config
}

async fn discovery(etcd: EtcdConfig) -> Result<EtcdDiscovery, ClusterError> {
    EtcdDiscovery::start(DiscoveryConfig::new(etcd)).await
}

#[tokio::test]
async fn nodes_register_and_are_discovered_over_tls_as_an_etcd_user() -> anyhow::Result<()> {
    let etcd = SecureEtcd::start()?;
    etcd.enable_auth().await?;
    let login = Some((USER, PASSWORD));

    let disco = discovery(etcd.config(PeerRole::Gateway, "gateway", login)).await?;
    let mut members = disco.members();
    let decode = record("decode-0", Role::Decode, "fp");
    let prefill = record("prefill-0", Role::Prefill, "fp");
    let d = Registration::start(
        reg_config(etcd.config(PeerRole::Decode, "decode-0", login)),
        decode.clone(),
    )
    .await?;
    let p = Registration::start(
        reg_config(etcd.config(PeerRole::Prefill, "prefill-0", login)),
        prefill.clone(),
    )
    .await?;
    let both = wait_members(&mut members, WAIT, |m| m.len() == 2).await?;
    assert!(both.contains(&decode) && both.contains(&prefill));

    // The operator's view reads the same keys.
    let admin = etcd.config(PeerRole::Admin, "admin", login);
    let listed: Vec<String> = list_nodes(&admin)
        .await?
        .into_iter()
        .map(|s| s.record.node_id)
        .collect();
    assert_eq!(listed, ["prefill-0", "decode-0"], "by role, then node id");

    // Changes keep flowing: a revoke removes the node at once.
    p.revoke().await?;
    let left = wait_members(&mut members, WAIT, |m| m.len() == 1).await?;
    assert_eq!(left[0].node_id, "decode-0");
    d.revoke().await?;
    Ok(())
}

#[tokio::test]
async fn a_wrong_password_or_user_fails_at_start_up_with_the_user_named() -> anyhow::Result<()> {
    let etcd = SecureEtcd::start()?;
    etcd.enable_auth().await?;
    let wrong = etcd.config(
        PeerRole::Decode,
        "decode-0",
        Some((USER, "not-the-password")),
    );

    let registration =
        Registration::start(reg_config(wrong.clone()), record("d1", Role::Decode, "fp"))
            .await
            .err()
            .context("a registration with a wrong password must not start")?;
    let gateway = discovery(wrong.clone())
        .await
        .err()
        .context("nor a discovery")?;
    let operator = list_nodes(&wrong).await.err().context("nor a listing")?;
    for err in [registration, gateway, operator] {
        assert!(matches!(err, ClusterError::EtcdAuth { .. }), "{err:?}");
        let message = err.to_string();
        assert!(
            message.contains("authentication failed for etcd user fission"),
            "{message}"
        );
        assert!(!message.contains("not-the-password"), "{message}");
    }

    let stranger = etcd.config(PeerRole::Decode, "decode-0", Some(("mallory", PASSWORD)));
    let err = discovery(stranger).await.err().context("an unknown user")?;
    assert!(
        err.to_string()
            .contains("authentication failed for etcd user mallory"),
        "{err}"
    );
    Ok(())
}

#[tokio::test]
async fn a_client_without_a_certificate_from_the_ca_is_refused() -> anyhow::Result<()> {
    let etcd = SecureEtcd::start()?;
    let login = Some((USER, PASSWORD));
    etcd.enable_auth().await?;
    // The same call with a certificate from the CA works: what fails below is the certificate.
    list_nodes(&etcd.config(PeerRole::Admin, "admin", login)).await?;

    let mut no_cert = etcd.config(PeerRole::Admin, "admin", None);
    no_cert.security.tls.as_mut().unwrap().client_cert = None;

    let other_ca = generate_dev_ca()?;
    let other_dir = etcd.tls_dir.join("other");
    std::fs::create_dir_all(&other_dir)?;
    let forged = write_pem_files(
        &other_dir,
        &other_ca,
        &other_ca.issue(PeerRole::Admin, "admin")?,
    )?;
    let mut foreign_cert = etcd.config(PeerRole::Admin, "admin", None);
    foreign_cert.security.tls.as_mut().unwrap().client_cert = Some(EtcdClientCert {
        cert: forged.cert,
        key: forged.key,
    });

    // The client may see etcd's TLS alert or only the connection it closed (a broken pipe),
    // so the reason is taken from etcd's side: it logs each connection it rejects.
    let rejected = || {
        std::fs::read_to_string(etcd.etcd.log_path())
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("rejected connection") && l.contains("certificate"))
            .count()
    };
    for (what, config) in [
        ("no certificate", no_cert),
        ("another CA's certificate", foreign_cert),
    ] {
        let before = rejected();
        let err = list_nodes(&config)
            .await
            .err()
            .with_context(|| format!("{what} is let in"))?;
        assert!(matches!(err, ClusterError::Etcd { .. }), "{what}: {err:?}");
        testkit::wait_until_async(&format!("etcd to reject {what}"), WAIT, || async {
            rejected() > before
        })
        .await;
    }

    // Nor does plaintext reach it.
    let mut plaintext = etcd.config(PeerRole::Admin, "admin", login);
    plaintext.endpoints = vec![etcd.etcd.endpoint().replace("https://", "http://")];
    plaintext.security = Default::default();
    plaintext.security.credentials = Some(EtcdCredentials {
        user: USER.into(),
        password: EtcdPassword::new(PASSWORD),
    });
    list_nodes(&plaintext)
        .await
        .err()
        .context("plaintext is let in")?;
    Ok(())
}

#[tokio::test]
async fn the_user_reaches_only_its_cluster_prefix() -> anyhow::Result<()> {
    let etcd = SecureEtcd::start()?;
    etcd.enable_auth().await?;
    let mut elsewhere = etcd.config(PeerRole::Admin, "admin", Some((USER, PASSWORD)));
    elsewhere.cluster = "another".into();
    let err = list_nodes(&elsewhere)
        .await
        .err()
        .context("another cluster's keys are readable")?;
    assert!(err.to_string().contains("permission denied"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_node_started_while_etcd_is_down_authenticates_when_it_is_back() -> anyhow::Result<()> {
    let mut etcd = SecureEtcd::start()?;
    etcd.enable_auth().await?;
    let login = Some((USER, PASSWORD));
    let node = etcd.config(PeerRole::Decode, "decode-0", login);
    etcd.etcd.stop();

    // As without credentials, start-up does not wait for etcd.
    let reg = Registration::start(reg_config(node), record("d1", Role::Decode, "fp")).await?;
    let mut lease = reg.lease_watch();
    assert!(lease.borrow().is_none());

    etcd.etcd.restart()?;
    tokio::time::timeout(WAIT, lease.wait_for(|l| l.is_some()))
        .await
        .context("registered once etcd is back")??;
    let listed = list_nodes(&etcd.config(PeerRole::Admin, "admin", login)).await?;
    assert_eq!(listed.len(), 1);
    Ok(())
}
