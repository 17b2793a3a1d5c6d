//! Delta pushes through a real cluster (issue 34): `fission up` with 1 prefill and 1 decode
//! node serves a three-turn chat whose every turn repeats the conversation so far. The decode
//! node keeps each turn in its prefix cache and links it into the next turn's reservation, so
//! the prefill node pushes only the blocks after it:
//! - the greedy ids of every turn equal those of a cluster that pushes in full
//!   (`FISSION_KV_DELTA=false`);
//! - the KV bytes of turns 2 and 3, read from both nodes' counters, are those of the blocks the
//!   decode node lacks, which the test works out from the token ids alone;
//! - a decode node whose copy of the conversation was evicted (other prompts filled its cache)
//!   links nothing, and the turn is pushed in full with the same ids;
//! - every KV gauge returns to 0.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

// The in-process engine, for its tokenizer alone.
#[allow(dead_code)]
#[path = "support/in_process.rs"]
mod in_process;

use in_process::InProcess;
use serde_json::{json, Value};
use testkit::cluster_builder::ClusterBuilder;
use testkit::fission::{stories_dir, Up};
use testkit::references::reference_prompts;
use testkit::wait_until_async;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const BS: usize = 16;
const NEW_TOKENS: usize = 24;

/// The text of `/generate` with `details`, and its generated ids.
async fn generate(client: &::reqwest::Client, url: &str, prompt: &str) -> (String, Vec<u32>) {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": true}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids = resp["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("details in {resp}"))
        .iter()
        .map(|t| t["id"].as_u64().unwrap() as u32)
        .collect();
    (resp["generated_text"].as_str().unwrap().to_string(), ids)
}

/// What one turn did, from the client and the nodes' counters.
#[derive(Debug)]
struct Turn {
    /// The prompt sent, and the conversation after this turn (the prompt and the answer).
    sent: String,
    conversation: String,
    ids: Vec<u32>,
    /// KV bytes the decode node received and the prefill node pushed for this turn.
    received: f64,
    pushed: f64,
    /// Prompt blocks the decode node linked from its prefix cache.
    linked: f64,
}

struct Chat<'a> {
    cluster: &'a Up,
    client: ::reqwest::Client,
}

impl Chat<'_> {
    fn counters(&self) -> [f64; 3] {
        [
            self.cluster
                .metric("decode-0", "fission_decode_kv_received_bytes_total"),
            self.cluster
                .metric("prefill-0", "fission_prefill_kv_transfer_bytes_total"),
            self.cluster
                .metric("decode-0", "fission_decode_kv_linked_blocks_total"),
        ]
    }

    async fn turn(&self, prompt: String) -> Turn {
        let before = self.counters();
        let (text, ids) = generate(&self.client, &self.cluster.url, &prompt).await;
        assert!(!ids.is_empty(), "{prompt:?}");
        // The decode node imported every layer before its first token; the prefill node
        // counts its push once Done is answered, which may come a moment after.
        let received = self.counters()[0] - before[0];
        wait_until_async(
            "the prefill node counts the bytes the decode node received",
            Duration::from_secs(10),
            || {
                let pushed = self.counters()[1] - before[1];
                async move { pushed == received }
            },
        )
        .await;
        let after = self.counters();
        Turn {
            conversation: format!("{prompt}{text}"),
            sent: prompt,
            ids,
            received,
            pushed: after[1] - before[1],
            linked: after[2] - before[2],
        }
    }

    /// Three turns: each prompt is the conversation so far and the next user turn.
    async fn three_turns(&self, users: &[String]) -> Vec<Turn> {
        let mut turns: Vec<Turn> = Vec::new();
        for user in &users[..3] {
            let history = turns
                .last()
                .map_or(String::new(), |t| t.conversation.clone());
            turns.push(self.turn(format!("{history} {user}")).await);
        }
        turns
    }

    async fn wait_for_empty_caches(&self) {
        self.cluster.wait_kv_released(Duration::from_secs(5)).await;
    }
}

/// Whole blocks two token sequences share from the start.
fn common_blocks(a: &[u32], b: &[u32]) -> usize {
    a.chunks(BS)
        .zip(b.chunks(BS))
        .take_while(|(x, y)| x.len() == BS && x == y)
        .count()
}

fn config(delta: bool, blocks: usize) -> ClusterBuilder {
    ClusterBuilder::new(FISSION)
        .num_kv_blocks(blocks)
        .node_arg(format!("--block-size={BS}"))
        .env("FISSION_KV_DELTA", &delta.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_turns_push_only_the_blocks_the_decode_node_lacks() {
    // Only its tokenizer: the ids the gateway's prompts become.
    let model = InProcess::load(&stories_dir(), None);
    let users = reference_prompts();

    let full_cluster = config(false, 512).start();
    let full_chat = Chat {
        cluster: &full_cluster,
        client: ::reqwest::Client::new(),
    };
    let full = full_chat.three_turns(&users).await;
    full_chat.wait_for_empty_caches().await;
    drop(full_cluster);

    let cluster = config(true, 512).start();
    let chat = Chat {
        cluster: &cluster,
        client: ::reqwest::Client::new(),
    };
    let delta = chat.three_turns(&users).await;

    // Bytes of one block over every layer, from the first turn (pushed whole either way).
    let first_len = model.tokenize(&delta[0].sent).len();
    let per_block = delta[0].received / first_len.div_ceil(BS) as f64;
    assert_eq!(delta[0].received, full[0].received);
    assert_eq!(delta[0].linked, 0.0);
    let mut previous: Vec<u32> = Vec::new();
    for (turn, (d, f)) in delta.iter().zip(&full).enumerate() {
        assert_eq!(
            d.ids,
            f.ids,
            "turn {}: delta and full pushes agree",
            turn + 1
        );
        assert_eq!(d.pushed, d.received, "turn {}", turn + 1);
        assert_eq!(f.linked, 0.0, "the full-push cluster links nothing");
        let prompt = model.tokenize(&d.sent);
        let blocks = prompt.len().div_ceil(BS);
        assert_eq!(f.received, blocks as f64 * per_block, "turn {}", turn + 1);
        // The decode node holds the previous turn's prompt and every answer token but the
        // last (sampled, never fed), in whole blocks; the push keeps the prompt's last block.
        let held = common_blocks(&previous, &prompt).min((prompt.len() - 1) / BS);
        assert_eq!(d.linked, held as f64, "turn {}", turn + 1);
        assert_eq!(
            d.received,
            (blocks - held) as f64 * per_block,
            "turn {}: only the blocks the decode node lacks",
            turn + 1
        );
        if turn > 0 {
            assert!(held > 0, "turn {} found the conversation cached", turn + 1);
        }
        previous = prompt;
        let answer = &d.ids[..d.ids.len() - 1];
        previous.extend_from_slice(answer);
    }
    let later: f64 = delta[1..].iter().map(|t| t.received).sum();
    let later_full: f64 = full[1..].iter().map(|t| t.received).sum();
    eprintln!(
        "turns 2-3: {later} bytes pushed with delta, {later_full} in full ({:.3}x)",
        later / later_full
    );
    chat.wait_for_empty_caches().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_conversation_is_pushed_in_full() {
    // Only its tokenizer: the ids the gateway's prompts become.
    let model = InProcess::load(&stories_dir(), None);
    let users = reference_prompts();
    // 48 blocks of 16 tokens: a few other prompts evict the first turn.
    let cluster = config(true, 48).start();
    let chat = Chat {
        cluster: &cluster,
        client: ::reqwest::Client::new(),
    };
    let first = chat.turn(format!(" {}", users[0])).await;
    let second_prompt = format!("{} {}", first.conversation, users[1]);
    // Other conversations, long enough together to take every block the first one left.
    for k in 0..4 {
        // Each opens differently, so that no two share a block.
        let opening = ["Tom"; 4][..=k].join(" ");
        let body = [users[k % users.len()].as_str(); 20].join(" ");
        chat.turn(format!(" {opening} {body}")).await;
    }
    let evicted = chat.turn(second_prompt.clone()).await;
    assert_eq!(
        evicted.linked, 0.0,
        "the decode node no longer holds turn 1"
    );
    let prompt_len = model.tokenize(&second_prompt).len();
    let first_len = model.tokenize(&first.sent).len();
    let per_block = first.received / first_len.div_ceil(BS) as f64;
    assert_eq!(evicted.received, prompt_len.div_ceil(BS) as f64 * per_block);
    chat.wait_for_empty_caches().await;
    drop(cluster);

    // The same turn on a cluster that never evicted it: the same ids, linked this time.
    let cluster = config(true, 512).start();
    let chat = Chat {
        cluster: &cluster,
        client: ::reqwest::Client::new(),
    };
    let first_again = chat.turn(format!(" {}", users[0])).await;
    assert_eq!(first_again.ids, first.ids);
    let linked = chat.turn(second_prompt).await;
    assert!(linked.linked > 0.0);
    assert_eq!(
        linked.ids, evicted.ids,
        "evicted or linked, the same tokens"
    );
    chat.wait_for_empty_caches().await;
}
