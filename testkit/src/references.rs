//! The reference outputs the cluster tests compare against: stories260K's greedy references
//! (`reference_greedy.json`, made by transformers), the variants of
//! `engine/tests/reference/arch_refs.json`, and `/generate`'s ids to compare them with.

use serde_json::{json, Value};

use crate::fission::stories_dir;

/// One stories260K prompt and transformers' greedy ids after it.
#[derive(Clone, Debug)]
pub struct Reference {
    pub prompt: String,
    pub output_ids: Vec<u64>,
}

impl Reference {
    /// The first `n` reference ids.
    pub fn expected(&self, n: usize) -> Vec<u64> {
        self.output_ids[..n].to_vec()
    }
}

/// stories260K's references.
pub fn references() -> Vec<Reference> {
    let path = stories_dir().join("reference_greedy.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("reference_greedy.json is JSON");
    v["references"]
        .as_array()
        .expect("a references array")
        .iter()
        .map(|r| Reference {
            prompt: r["prompt"].as_str().expect("a prompt").to_string(),
            output_ids: r["output_ids"]
                .as_array()
                .expect("output ids")
                .iter()
                .map(|x| x.as_u64().expect("an id"))
                .collect(),
        })
        .collect()
}

/// The reference prompts alone.
pub fn reference_prompts() -> Vec<String> {
    references().into_iter().map(|r| r.prompt).collect()
}

/// The variant `name` of `engine/tests/reference/arch_refs.json`: its `spec` (a
/// `random_model::ModelSpec`), `fingerprint` and `references`.
pub fn arch_variant(name: &str) -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/reference/arch_refs.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let refs: Value = serde_json::from_str(&text).expect("arch_refs.json is JSON");
    refs["variants"]
        .as_array()
        .expect("a variants array")
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("arch_refs.json has no variant {name:?}"))
        .clone()
}

/// `/generate` with `details` at the gateway `url`: the generated ids (the gateway stops at
/// end of text, so there may be fewer than `max_new_tokens`).
pub async fn generate_ids(
    client: &reqwest::Client,
    url: &str,
    prompt: &str,
    max_new_tokens: usize,
) -> Vec<u64> {
    let resp: Value = client
        .post(format!("{url}/generate"))
        .json(&json!({
            "inputs": prompt,
            "parameters": {"max_new_tokens": max_new_tokens, "details": true},
        }))
        .send()
        .await
        .expect("the gateway answers")
        .json()
        .await
        .expect("a JSON body");
    resp["details"]["tokens"]
        .as_array()
        .unwrap_or_else(|| panic!("no details in {resp}"))
        .iter()
        .map(|t| t["id"].as_u64().expect("an id"))
        .collect()
}

/// Sends `requests` concurrent `/generate`s, the `i`th with reference `i % len` and
/// `max_new_tokens(i)` new tokens, and asserts each gets the reference ids.
pub async fn assert_concurrent_references(
    url: &str,
    requests: usize,
    max_new_tokens: impl Fn(usize) -> usize,
) {
    let client = reqwest::Client::new();
    let refs = references();
    let jobs: Vec<_> = (0..requests)
        .map(|i| {
            let r = refs[i % refs.len()].clone();
            let n = max_new_tokens(i);
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let got = generate_ids(&client, &url, &r.prompt, n).await;
                (got, r.expected(n), r.prompt)
            })
        })
        .collect();
    for j in jobs {
        let (got, want, prompt) = j.await.expect("a request task panicked");
        assert_eq!(got, want, "prompt {prompt:?}");
    }
}
