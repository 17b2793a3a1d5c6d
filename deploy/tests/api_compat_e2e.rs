//! The APIs as third-party clients use them, on a real `fission up` cluster: TGI's own Python
//! client (`text_generation`), `huggingface_hub`'s `InferenceClient` and OpenAI's SDK, unchanged,
//! streaming and not; `n` sequences sharing the prompt's KV blocks; limits the nodes really
//! hold; and one `schemathesis` pass over the gateway's `/openapi.json` with no server error.
//!
//! The clients come from the ignored venv `./deploy/install-test-tools.sh` fills; without them
//! the tests skip loudly, unless `FISSION_REQUIRE_TEST_TOOLS` is set, where they fail.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::fission::{stories_dir, Up, UpConfig};
use testkit::python::Script;

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const ALIAS: &str = "tiny-stories";

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// stories260K with a ChatML template, so that the chat routes serve (the model ships none).
fn chat_model() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(stories_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    let config_path = dir.path().join("tokenizer_config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = json!(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + \
         message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}\
         {{ '<|im_start|>assistant\\n' }}{% endif %}"
    );
    std::fs::write(&config_path, config.to_string()).unwrap();
    dir
}

fn start(model: &Path) -> Up {
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.model = model.to_path_buf();
    config.args = vec![format!("--gateway-arg=--served-model-name={ALIAS}")];
    Up::start(&config)
}

fn python_with(modules: &[&str]) -> Option<PathBuf> {
    testkit::python::venv_python_with(modules)
}

fn run_python(python: &Path, script: &str, args: &[&str]) -> Value {
    testkit::python::run_json(python, Script::Inline(script), args)
}

/// Every call shape of TGI's client and of huggingface_hub's, streaming and not.
const TGI_CLIENTS: &str = r#"
import json, sys
from text_generation import Client
from text_generation.types import Message
from huggingface_hub import InferenceClient
url = sys.argv[1]
out = {}
tg = Client(url, timeout=60)
prompt = "Once upon a time"

r = tg.generate(prompt, max_new_tokens=12)
out["generate"] = {"text": r.generated_text, "finish": r.details.finish_reason.value,
                   "generated_tokens": r.details.generated_tokens, "tokens": len(r.details.tokens)}
# The prompt followed by its greedy continuation: the prefill node scores the continuation's
# tokens, which the decode path scored as it generated them.
p = tg.generate(prompt + r.generated_text, max_new_tokens=1, decoder_input_details=True)
out["prefill"] = {"ids": [t.id for t in p.details.prefill], "logprobs": [t.logprob for t in p.details.prefill],
                  "generated": [[t.id, t.logprob] for t in r.details.tokens]}
words = r.generated_text.split()
stop = " " + words[2]
s = tg.generate(prompt, max_new_tokens=12, stop_sequences=[stop])
out["stop"] = {"stop": stop, "text": s.generated_text, "finish": s.details.finish_reason.value}
b = tg.generate(prompt, max_new_tokens=6, best_of=2, do_sample=True)
out["best_of"] = {"text": b.generated_text,
                  "others": [x.generated_text for x in (b.details.best_of_sequences or [])]}
text, last = "", None
for resp in tg.generate_stream(prompt, max_new_tokens=12):
    if not resp.token.special:
        text += resp.token.text
    last = resp
out["generate_stream"] = {"text": text, "generated_text": last.generated_text,
                          "finish": last.details.finish_reason.value}
text, last = "", None
for resp in tg.generate_stream(prompt, max_new_tokens=12, stop_sequences=[stop]):
    text += resp.token.text
    last = resp
out["stream_stop"] = {"text": text, "generated_text": last.generated_text,
                      "finish": last.details.finish_reason.value}
c = tg.chat(messages=[Message(role="user", content="Tell me a story")], max_tokens=8, temperature=0)
out["tg_chat"] = {"content": c.choices[0].message.content, "fingerprint": c.system_fingerprint}
chunks = list(tg.chat(messages=[Message(role="user", content="Tell me a story")], max_tokens=8, temperature=0, stream=True))
out["tg_chat_stream"] = {"chunks": len(chunks),
                         "content": "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                         "fingerprint": chunks[0].system_fingerprint}

hub = InferenceClient(base_url=url)
out["hub_text"] = hub.text_generation(prompt, max_new_tokens=12)
d = hub.text_generation(prompt, max_new_tokens=12, details=True)
out["hub_details"] = {"text": d.generated_text, "finish": d.details.finish_reason,
                      "tokens": len(d.details.tokens)}
out["hub_stream"] = "".join(hub.text_generation(prompt, max_new_tokens=12, stream=True))
hp = hub.text_generation(prompt, max_new_tokens=2, details=True, decoder_input_details=True)
out["hub_prefill"] = [[t.id, t.logprob] for t in hp.details.prefill]
hc = hub.chat_completion([{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0)
out["hub_chat"] = {"content": hc.choices[0].message.content, "fingerprint": hc.system_fingerprint}
hs = list(hub.chat_completion([{"role": "user", "content": "Tell me a story"}], max_tokens=8, temperature=0, stream=True))
out["hub_chat_stream"] = "".join(ch.choices[0].delta.content or "" for ch in hs if ch.choices)
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_clients_work_unchanged() {
    let Some(python) = python_with(&["text_generation", "huggingface_hub"]) else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let model = chat_model();
    let up = start(model.path());
    let r = run_python(&python, TGI_CLIENTS, &[&up.url]);

    let greedy = r["generate"]["text"].as_str().unwrap();
    assert!(!greedy.is_empty(), "{r}");
    assert_eq!(
        r["generate"]["tokens"], r["generate"]["generated_tokens"],
        "{r}"
    );
    // TGI keeps the stop sequence in the text: greedy decoding repeats the text up to it.
    let (stop, stopped) = (
        r["stop"]["stop"].as_str().unwrap(),
        r["stop"]["text"].as_str().unwrap(),
    );
    assert_eq!(r["stop"]["finish"], "stop_sequence", "{r}");
    assert!(stopped.contains(stop), "{stopped:?} lacks {stop:?}");
    assert!(greedy.starts_with(stopped), "{greedy:?} vs {stopped:?}");
    assert_eq!(r["stream_stop"]["generated_text"], stopped, "{r}");
    assert_eq!(r["stream_stop"]["finish"], "stop_sequence", "{r}");
    assert_eq!(r["best_of"]["others"].as_array().unwrap().len(), 1, "{r}");
    assert_eq!(r["generate_stream"]["generated_text"], greedy, "{r}");
    assert_eq!(r["generate_stream"]["text"], greedy, "{r}");
    assert_eq!(r["hub_text"], greedy, "{r}");
    assert_eq!(r["hub_details"]["text"], greedy, "{r}");
    assert_eq!(r["hub_stream"], greedy, "{r}");
    let fingerprint = r["tg_chat"]["fingerprint"].as_str().unwrap();
    assert!(fingerprint.starts_with("fission-"), "{r}");
    for key in ["tg_chat_stream", "hub_chat"] {
        assert_eq!(r[key]["fingerprint"], fingerprint, "{key}: {r}");
    }
    assert_eq!(
        r["tg_chat_stream"]["content"], r["tg_chat"]["content"],
        "{r}"
    );
    assert_eq!(r["hub_chat"]["content"], r["tg_chat"]["content"], "{r}");
    assert_eq!(r["hub_chat_stream"], r["tg_chat"]["content"], "{r}");

    // decoder_input_details: the prompt's tokens, the first without a logprob, and the
    // continuation's logprobs as the decode path reported them.
    let prefill = &r["prefill"];
    let ids: Vec<u64> = serde_json::from_value(prefill["ids"].clone()).unwrap();
    let logprobs = prefill["logprobs"].as_array().unwrap();
    assert_eq!(ids.len(), logprobs.len(), "{r}");
    assert_eq!(ids[0], 1, "BOS first: {r}");
    assert!(logprobs[0].is_null(), "{r}");
    let generated: Vec<(u64, f64)> = serde_json::from_value(prefill["generated"].clone()).unwrap();
    let tail = &ids[ids.len() - generated.len()..];
    let generated_ids: Vec<u64> = generated.iter().map(|g| g.0).collect();
    assert_eq!(
        tail,
        generated_ids.as_slice(),
        "the text tokenizes back to its ids: {r}"
    );
    for (i, (_, want)) in generated.iter().enumerate() {
        let got = logprobs[ids.len() - generated.len() + i].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-3,
            "token {i}: {got} against {want}: {r}"
        );
    }
    let hub_prefill = r["hub_prefill"].as_array().unwrap();
    assert_eq!(hub_prefill.len(), 5, "BOS and four prompt tokens: {r}");
    assert!(
        hub_prefill[1..]
            .iter()
            .all(|t| t[1].as_f64().unwrap() <= 0.0),
        "{r}"
    );
}

/// OpenAI's SDK: every prompt shape, n, aliases, unknown models, ranges and limits.
const OPENAI_CLIENT: &str = r#"
import json, sys
import openai
base_url, alias, prompt_ids = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
out = {}
models = client.models.list()
out["models"] = [m.id for m in models.data]
out["max_model_len"] = [m.model_extra.get("max_model_len") for m in models.data]
served = out["models"][0]
def text(c):
    return [ch.text for ch in c.choices]
one = client.completions.create(model=served, prompt="Once upon a time", max_tokens=6, temperature=0)
out["string"] = {"texts": text(one), "fingerprint": one.system_fingerprint}
ids = client.completions.create(model=alias, prompt=prompt_ids, max_tokens=6, temperature=0)
out["ids"] = text(ids)
many = client.completions.create(model=served, prompt=["Once upon a time", "The cat"], max_tokens=6, temperature=0)
out["strings"] = {"texts": text(many), "usage": many.usage.prompt_tokens}
lists = client.completions.create(model=served, prompt=[[1, 100], [1, 200, 300]], max_tokens=4, temperature=0)
out["id_lists"] = [c.index for c in lists.choices]
n = client.completions.create(model=served, prompt="Once upon a time", max_tokens=6, n=3, seed=5)
out["n"] = {"indices": [c.index for c in n.choices], "completion_tokens": n.usage.completion_tokens}
best = client.completions.create(model=served, prompt="Once upon a time", max_tokens=6, n=1, best_of=3, seed=5)
out["best_of"] = len(best.choices)
stream = client.completions.create(model=served, prompt="Once upon a time", max_tokens=6, n=2, seed=5, stream=True)
chunks = list(stream)
out["n_stream"] = {"indices": sorted({c.choices[0].index for c in chunks if c.choices}),
                   "fingerprints": sorted({c.system_fingerprint for c in chunks})}
chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2)
out["chat"] = {"choices": len(chat.choices), "fingerprint": chat.system_fingerprint}
chat_stream = list(client.chat.completions.create(model=alias, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True))
out["chat_stream_fingerprint"] = chat_stream[0].system_fingerprint
def error(**kwargs):
    try:
        client.completions.create(**kwargs)
        return "accepted"
    except openai.APIStatusError as e:
        return {"status": e.status_code, "code": e.code, "param": e.param, "message": e.message}
out["unknown_model"] = error(model="gpt-4", prompt="Hi", max_tokens=2)
out["temperature"] = error(model=served, prompt="Hi", max_tokens=2, temperature=3)
out["top_p"] = error(model=served, prompt="Hi", max_tokens=2, top_p=0)
out["presence"] = error(model=served, prompt="Hi", max_tokens=2, presence_penalty=3)
out["logprobs"] = error(model=served, prompt="Hi", max_tokens=2, logprobs=6)
out["n_range"] = error(model=served, prompt="Hi", max_tokens=2, n=129)
out["too_long"] = error(model=served, prompt="Once upon a time", max_tokens=600)
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])
    out["chat_unknown_model"] = "accepted"
except openai.NotFoundError as e:
    out["chat_unknown_model"] = {"status": e.status_code, "code": e.code}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_gets_openai_semantics_and_honest_limits() {
    let Some(python) = python_with(&["openai"]) else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let model = chat_model();
    let up = start(model.path());
    // The nodes hold 512 tokens (stories260K's context), below the gateway's default 4096.
    let info = up.info();
    assert_eq!(info["max_total_tokens"], 512, "{info}");
    assert_eq!(info["max_input_tokens"], 511, "{info}");

    let tokens: Value = reqwest::Client::new()
        .post(format!("{}/tokenize", up.url))
        .json(&json!({"inputs": "Once upon a time"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<u64> = tokens
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_u64().unwrap())
        .collect();
    let ids = serde_json::to_string(&ids).unwrap();
    let r = run_python(
        &python,
        OPENAI_CLIENT,
        &[&format!("{}/v1", up.url), ALIAS, &ids],
    );
    assert_eq!(r["models"], json!([model_name(model.path()), ALIAS]), "{r}");
    assert_eq!(r["max_model_len"], json!([512, 512]), "{r}");
    assert!(r["string"]["fingerprint"]
        .as_str()
        .unwrap()
        .starts_with("fission-"));
    assert_eq!(r["strings"]["texts"].as_array().unwrap().len(), 2, "{r}");
    assert_eq!(r["id_lists"], json!([0, 1]), "{r}");
    // The ids of "Once upon a time" with BOS give what the string gives.
    assert_eq!(r["ids"], r["string"]["texts"], "{r}");
    assert_eq!(r["n"]["indices"], json!([0, 1, 2]), "{r}");
    assert_eq!(r["n"]["completion_tokens"], 18, "{r}");
    assert_eq!(r["best_of"], 1, "{r}");
    assert_eq!(r["n_stream"]["indices"], json!([0, 1]), "{r}");
    assert_eq!(r["n_stream"]["fingerprints"].as_array().unwrap().len(), 1);
    assert_eq!(r["chat"]["choices"], 2, "{r}");
    assert_eq!(
        r["chat_stream_fingerprint"], r["chat"]["fingerprint"],
        "{r}"
    );

    assert_eq!(r["unknown_model"]["status"], 404, "{}", r["unknown_model"]);
    assert_eq!(r["unknown_model"]["code"], "model_not_found");
    assert_eq!(r["unknown_model"]["param"], "model");
    assert_eq!(
        r["chat_unknown_model"],
        json!({"status": 404, "code": "model_not_found"})
    );
    for (key, param) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("presence", "presence_penalty"),
        ("logprobs", "logprobs"),
        ("n_range", "n"),
        ("too_long", "max_tokens"),
    ] {
        assert_eq!(r[key]["status"], 400, "{key}: {}", r[key]);
        assert_eq!(r[key]["param"], param, "{key}: {}", r[key]);
    }
    // The message names both fields and the limit.
    let message = r["too_long"]["message"].as_str().unwrap();
    assert!(
        message.contains("prompt") && message.contains("max_tokens") && message.contains("512"),
        "{message}"
    );
}

/// The model's id as the gateway reports it: the directory's name.
fn model_name(dir: &Path) -> String {
    dir.canonicalize()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// `n` sequences prefill the prompt about once: the later ones find its full blocks in the
/// prefill node's prefix cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_sequences_share_the_prompts_blocks() {
    let _serial = SERIAL.lock().await;
    let up = Up::start(&UpConfig::new(FISSION, 1, 1));
    let hits = || up.metric("prefill-0", "fission_prefill_prefix_cache_hit_blocks_total");
    let client = reqwest::Client::new();
    // A prompt no other request used, long enough for several full blocks of 16 tokens.
    let prompt = "Lily and Ben went to the park to play on the swings and the slide. \
                  They saw a big red ball near a tree and a small dog that wanted to play. "
        .repeat(2);
    let before = hits();
    let n = 4;
    let body: Value = client
        .post(format!("{}/v1/completions", up.url))
        .json(&json!({"prompt": prompt, "max_tokens": 4, "n": n, "seed": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["choices"].as_array().unwrap().len(), n, "{body}");
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let full_blocks = (prompt_tokens / 16.0).floor();
    assert!(full_blocks >= 4.0, "prompt of {prompt_tokens} tokens");
    // Each of the n - 1 later sequences reuses every full block (its last block is computed
    // again, for its first token's logits).
    let expected = (n as f64 - 1.0) * (full_blocks - 1.0);
    testkit::wait_until(
        "the prefix-cache hits to be published",
        Duration::from_secs(10),
        || hits() - before >= expected,
    );
    let shared = hits() - before;
    eprintln!(
        "n={n}: {shared} prompt blocks of {full_blocks} full ones came from the prefix cache"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error() {
    let venv = testkit::phoenix::venv_dir();
    let Some(_python) = python_with(&["schemathesis"]) else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let model = chat_model();
    let up = start(model.path());
    let report = tempfile::tempdir().unwrap();
    let out = Command::new(venv.join("bin").join("schemathesis"))
        .args(["run", &format!("{}/openapi.json", up.url)])
        .args(["--checks", "not_a_server_error"])
        .args(["--max-examples", "15"])
        .args(["--phases", "examples,coverage,fuzzing"])
        .args(["--request-timeout", "30"])
        .args(["--workers", "1"])
        .args(["--seed", "1"])
        // /metrics and /health are plain text or have no body schema worth fuzzing.
        .args(["--exclude-path", "/metrics"])
        .env("SCHEMATHESIS_HOOKS", "")
        .current_dir(report.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found failures:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "{}",
        stdout.lines().rev().take(15).collect::<Vec<_>>().join("\n")
    );
}
