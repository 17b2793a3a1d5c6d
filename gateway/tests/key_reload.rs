//! `fission-gateway --api-key-file` as a real process: SIGHUP puts the rewritten file's keys in
//! force (the old ones refused from then on), and a reload that fails keeps them.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use testkit::fission::{free_port, signal, wait_exit, KillOnDrop};
use testkit::{wait_until, wait_until_async};

const GATEWAY: &str = env!("CARGO_BIN_EXE_fission-gateway");
const MODEL_DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../shared/models/stories260K"
);

/// Writes the key file the way an operator should: whole, then renamed over the old one.
fn write_keys(path: &Path, text: &str) {
    let staged = path.with_extension("new");
    std::fs::write(&staged, text).unwrap();
    std::fs::rename(&staged, path).unwrap();
}

/// The status of `GET /info` with `key` as a bearer token; `None` while nothing answers.
async fn info_status(client: &reqwest::Client, addr: &str, key: &str) -> Option<u16> {
    let response = client
        .get(format!("http://{addr}/info"))
        .bearer_auth(key)
        .send()
        .await
        .ok()?;
    Some(response.status().as_u16())
}

#[tokio::test]
async fn sighup_swaps_the_key_file_and_a_failed_reload_keeps_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("api-keys");
    write_keys(&keys, "# first generation\nsk-old\n");
    let log = dir.path().join("gateway.log");
    let addr = format!("127.0.0.1:{}", free_port());
    // A static cluster whose one decode node is not there: /info answers without it, and
    // without node certificates (`--insecure`) since no node is ever called.
    let nowhere = format!("127.0.0.1:{}", free_port());
    let mut gateway = KillOnDrop(
        Command::new(GATEWAY)
            .args(["--addr", &addr, "--model-dir", MODEL_DIR])
            .args(["--decode-nodes", &nowhere])
            .arg("--api-key-file")
            .arg(&keys)
            .arg("--insecure")
            .env("RUST_LOG", "info")
            .env_remove("FISSION_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let client = reqwest::Client::new();
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    // It answers only once its SIGHUP handler is in place (installed before it serves).
    wait_until_async(
        "the gateway accepts the first key",
        Duration::from_secs(60),
        || {
            let client = client.clone();
            let addr = addr.clone();
            async move { info_status(&client, &addr, "sk-old").await == Some(200) }
        },
    )
    .await;
    assert_eq!(info_status(&client, &addr, "sk-new").await, Some(401));

    write_keys(&keys, "sk-new\n");
    signal(&gateway.0, libc::SIGHUP);
    wait_until_async("the reloaded key accepted", Duration::from_secs(10), || {
        let client = client.clone();
        let addr = addr.clone();
        async move { info_status(&client, &addr, "sk-new").await == Some(200) }
    })
    .await;
    assert_eq!(info_status(&client, &addr, "sk-old").await, Some(401));
    assert!(log_text().contains("api keys reloaded"), "{}", log_text());

    // Emptied by mistake: the reload fails, the keys in force stay, the process lives on.
    write_keys(&keys, "# nothing here\n");
    signal(&gateway.0, libc::SIGHUP);
    wait_until("the failed reload logged", Duration::from_secs(10), || {
        log_text().contains("api key reload failed")
    });
    assert_eq!(info_status(&client, &addr, "sk-new").await, Some(200));
    assert_eq!(info_status(&client, &addr, "sk-old").await, Some(401));
    assert!(
        !log_text().contains("sk-new") && !log_text().contains("sk-old"),
        "no key in the log:\n{}",
        log_text()
    );

    signal(&gateway.0, libc::SIGTERM);
    let status = wait_exit(&mut gateway.0, Duration::from_secs(30));
    assert!(status.success(), "{status}:\n{}", log_text());
}
