//! A decode node killed mid-stream on a model of the test's own (`arch_cluster.rs`,
//! `window_kv_e2e.rs`): 1 prefill and 2 decode nodes of the fault suite's [`harness`]; decode-0
//! is SIGKILLed while it streams, and every stream the gateway migrates to decode-1 must carry
//! an in-process engine's greedy ids, with no token twice or missing and every block back.
//! Included with `#[path]` beside `mod harness` and `mod in_process`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use crate::harness;
use crate::in_process::InProcess;

pub const STREAMS: usize = 4;
pub const STREAM_TOKENS: usize = 200;

fn stream_body(client: usize) -> Value {
    harness::body(
        &format!("Stream {client}: the little dog ran to the park"),
        STREAM_TOKENS,
    )
}

/// One in-process engine's greedy ids for each stream's prompt.
fn in_process_ids(model_dir: &Path) -> Vec<Vec<u64>> {
    let mut reference = InProcess::load(model_dir, None);
    (0..STREAMS)
        .map(|i| {
            let text = stream_body(i)["inputs"]
                .as_str()
                .expect("a prompt")
                .to_string();
            reference.greedy_text(&text, STREAM_TOKENS)
        })
        .collect()
}

/// Runs the kill on `model_dir` (cluster files under `dir`): decode-0 dies once it has
/// generated `min_generated` tokens with a stream running. Returns the gateway's migrations.
pub fn ids_survive_a_decode_kill(dir: &Path, model_dir: &Path, min_generated: f64) -> f64 {
    // Slow steps, so the kill lands mid-stream (read by the node processes started below).
    std::env::set_var("FISSION_DEBUG_STEP_DELAY_MS", "10");
    let want = in_process_ids(model_dir);
    let mut c = harness::Cluster::one_prefill_two_decode(dir, model_dir, &[]);
    let url = c.url.clone();
    let load = std::thread::spawn(move || {
        testkit::streams::run(&url, STREAMS, 1, Duration::from_secs(60), |client, _| {
            stream_body(client)
        })
    });
    let m = c.node("decode-0").metrics.clone();
    testkit::wait_until("decode-0 generating", Duration::from_secs(30), || {
        testkit::fission::metric(&m, "fission_decode_generated_tokens_total") >= min_generated
            && testkit::fission::metric(&m, "fission_decode_running_sequences") >= 1.0
    });
    c.node("decode-0").signal(libc::SIGKILL);
    let mut records = load.join().expect("the load thread");
    records.sort_by_key(|r| r.client);
    harness::assert_all_ok(&records, "across decode-0's death");
    for (r, want) in records.iter().zip(&want) {
        assert_eq!(
            r.token_ids.len(),
            STREAM_TOKENS,
            "no token twice, none missing"
        );
        assert_eq!(
            &r.token_ids, want,
            "stream {}: the in-process engine's ids across the migration",
            r.client
        );
    }
    let migrations = c.gateway_metric("fission_gateway_migrations_total");
    assert!(migrations >= 1.0, "the gateway migrated nothing");
    c.assert_kv_released();
    migrations
}
