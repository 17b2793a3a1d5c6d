//! The gateway's HTTP edge on a real cluster: `fission up` with an API key (in
//! `FISSION_API_KEY`), `--public-health` and a small `--max-body-bytes`. Every route refuses a
//! missing or wrong key with a 401 in its API's shape, the key works in either header and
//! through OpenAI's Python SDK, failures are counted by reason, and oversized bodies and wrong
//! methods get JSON errors.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};
use testkit::fission::{Up, UpConfig};

const FISSION: &str = env!("CARGO_BIN_EXE_fission");
const KEY: &str = "sk-fission-e2e-2f9c1d";
const MAX_BODY_BYTES: usize = 64 << 10;

/// One cluster at a time: two at once on a 2-core CI machine would only test the scheduler.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn start() -> Up {
    let mut config = UpConfig::new(FISSION, 1, 1);
    config.api_key = Some(KEY.into());
    config.args = vec![
        "--gateway-arg=--public-health".into(),
        format!("--gateway-arg=--max-body-bytes={MAX_BODY_BYTES}"),
    ];
    Up::start(&config)
}

/// How a request presents its key.
#[derive(Clone, Copy, Debug)]
enum Key<'a> {
    None,
    Bearer(&'a str),
    Header(&'a str),
}

async fn send(
    client: &reqwest::Client,
    up: &Up,
    method: &str,
    path: &str,
    body: Option<Value>,
    key: Key<'_>,
) -> reqwest::Response {
    let mut request = client.request(method.parse().unwrap(), format!("{}{path}", up.url));
    request = match key {
        Key::None => request,
        Key::Bearer(key) => request.bearer_auth(key),
        Key::Header(key) => request.header("x-api-key", key),
    };
    if let Some(body) = body {
        request = request.json(&body);
    }
    request.send().await.unwrap()
}

/// Checks an error response: its status, a JSON content type, and the body in the shape of
/// the path's API (OpenAI's under /v1/, TGI's elsewhere) with `error_type`/`code`. Returns the
/// body.
async fn assert_error(
    response: reqwest::Response,
    status: u16,
    error_type: &str,
    code: &str,
) -> Value {
    let path = response.url().path().to_string();
    assert_eq!(response.status(), status, "{path}");
    assert_eq!(
        response.headers()["content-type"],
        "application/json",
        "{path}"
    );
    let www_authenticate = response.headers().get("www-authenticate").cloned();
    assert_eq!(
        www_authenticate.is_some(),
        status == 401,
        "{path}: WWW-Authenticate on 401s only"
    );
    let body: Value = response.json().await.unwrap();
    if path.starts_with("/v1/") {
        let error = &body["error"];
        assert_eq!(error["type"], error_type, "{path}: {body}");
        assert_eq!(error["code"], code, "{path}: {body}");
        assert!(error["param"].is_null(), "{body}");
        assert!(!error["message"].as_str().unwrap().is_empty());
    } else {
        assert_eq!(body["error_type"], error_type, "{path}: {body}");
        assert!(!body["error"].as_str().unwrap().is_empty(), "{body}");
        assert_eq!(body.as_object().unwrap().len(), 2, "{body}");
    }
    body
}

fn generate_body() -> Value {
    json!({"inputs": "Once upon a time", "parameters": {"max_new_tokens": 4}})
}

/// Every route, with a body that it would accept.
fn routes() -> Vec<(&'static str, &'static str, Option<Value>)> {
    let completion = json!({"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 4});
    let chat = json!({"model": "stories260K", "messages": [{"role": "user", "content": "Hi"}]});
    vec![
        ("POST", "/generate", Some(generate_body())),
        ("POST", "/generate_stream", Some(generate_body())),
        (
            "POST",
            "/tokenize",
            Some(json!({"inputs": "Once upon a time"})),
        ),
        ("GET", "/info", None),
        ("GET", "/metrics", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", Some(completion)),
        ("POST", "/v1/chat/completions", Some(chat)),
        ("GET", "/nowhere", None),
        ("GET", "/v1/nowhere", None),
    ]
}

/// The gateway's count of auth failures for `reason`.
async fn auth_failures(client: &reqwest::Client, up: &Up, reason: &str) -> f64 {
    let text = send(client, up, "GET", "/metrics", None, Key::Bearer(KEY))
        .await
        .text()
        .await
        .unwrap();
    let series = format!("fission_gateway_auth_failures_total{{reason=\"{reason}\"}}");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .map_or(0.0, |value| value.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_gateway_refuses_every_route_without_its_key() {
    let _serial = SERIAL.lock().await;
    let up = start();
    let client = reqwest::Client::new();

    let (mut missing, mut invalid) = (0.0, 0.0);
    for (method, path, body) in routes() {
        let response = send(&client, &up, method, path, body.clone(), Key::None).await;
        assert_error(response, 401, "authentication", "missing_api_key").await;
        missing += 1.0;
        for wrong in [
            Key::Bearer("sk-wrong"),
            Key::Header("sk-wrong"),
            Key::Bearer(&KEY[1..]),
        ] {
            let response = send(&client, &up, method, path, body.clone(), wrong).await;
            assert_error(response, 401, "authentication", "invalid_api_key").await;
            invalid += 1.0;
        }
    }
    // --public-health: load balancers probe without a key.
    let health = send(&client, &up, "GET", "/health", None, Key::None).await;
    assert_eq!(health.status(), 200);
    assert_eq!(auth_failures(&client, &up, "missing").await, missing);
    assert_eq!(auth_failures(&client, &up, "invalid").await, invalid);

    // The key in either header: every route answers (chat needs a template stories260K lacks).
    for key in [Key::Bearer(KEY), Key::Header(KEY)] {
        for (method, path, body) in routes() {
            let response = send(&client, &up, method, path, body, key).await;
            let status = response.status().as_u16();
            let expected = match path {
                "/nowhere" | "/v1/nowhere" => 404,
                // OpenAI answers validation errors with 400.
                "/v1/chat/completions" => 400,
                _ => 200,
            };
            assert_eq!(
                status,
                expected,
                "{method} {path} with {key:?}: {:?}",
                response.text().await
            );
        }
        let response = send(
            &client,
            &up,
            "POST",
            "/generate",
            Some(generate_body()),
            key,
        )
        .await;
        let generated: Value = response.json().await.unwrap();
        assert!(
            !generated["generated_text"].as_str().unwrap().is_empty(),
            "{generated}"
        );
    }
    // The right key counted nothing.
    assert_eq!(auth_failures(&client, &up, "missing").await, missing);
    assert_eq!(auth_failures(&client, &up, "invalid").await, invalid);
    let exposition = send(&client, &up, "GET", "/metrics", None, Key::Bearer(KEY))
        .await
        .text()
        .await
        .unwrap();
    assert!(!exposition.contains(KEY), "no key in the metrics");

    // A body over --max-body-bytes: 413 in the route's shape, naming the limit.
    let prompt = "once upon a time ".repeat(2 * MAX_BODY_BYTES / 17);
    for (path, body) in [
        ("/generate", json!({"inputs": &prompt})),
        (
            "/v1/completions",
            json!({"prompt": &prompt, "max_tokens": 1}),
        ),
    ] {
        let response = send(&client, &up, "POST", path, Some(body), Key::Bearer(KEY)).await;
        let body = assert_error(response, 413, "payload_too_large", "payload_too_large").await;
        assert!(
            body.to_string().contains(&MAX_BODY_BYTES.to_string()),
            "{body}"
        );
    }
    // A wrong method on a known route: 405 with Allow.
    for (method, path, allow) in [
        ("GET", "/generate", "POST"),
        ("DELETE", "/v1/models", "GET,HEAD"),
    ] {
        let response = send(&client, &up, method, path, None, Key::Bearer(KEY)).await;
        assert_eq!(response.headers()["allow"], allow, "{method} {path}");
        assert_error(response, 405, "method_not_allowed", "method_not_allowed").await;
    }
    // Without a key, the edge answers 401 before it looks at the body or the method.
    let response = send(&client, &up, "GET", "/generate", None, Key::None).await;
    assert_error(response, 401, "authentication", "missing_api_key").await;
}

/// What the SDK client does with the right key and with a wrong one.
const SDK_SCRIPT: &str = r#"
import json, sys
import openai
base_url, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
models = [m.id for m in client.models.list()]
completion = client.completions.create(
    model=models[0], prompt="Once upon a time", max_tokens=6, temperature=0)
result = {
    "models": models,
    "text": completion.choices[0].text,
    "completion_tokens": completion.usage.completion_tokens,
}
try:
    openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0).models.list()
    result["wrong_key"] = "accepted"
except openai.AuthenticationError as e:
    result["wrong_key"] = {"status": e.status_code, "code": e.code, "type": e.type}
print(json.dumps(result))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_authenticates_with_its_api_key() {
    let Some(python) = testkit::python::venv_python_with(&["openai"]) else {
        return;
    };
    let _serial = SERIAL.lock().await;
    let up = start();
    let result = testkit::python::run_json(
        &python,
        testkit::python::Script::Inline(SDK_SCRIPT),
        &[&format!("{}/v1", up.url), KEY],
    );
    assert_eq!(result["models"], json!(["stories260K"]), "{result}");
    assert!(!result["text"].as_str().unwrap().is_empty(), "{result}");
    assert!(
        result["completion_tokens"].as_u64().unwrap() > 0,
        "{result}"
    );
    // The SDK reads OpenAI's error shape: its own AuthenticationError, with our code.
    assert_eq!(
        result["wrong_key"],
        json!({"status": 401, "code": "invalid_api_key", "type": "authentication"}),
        "{result}"
    );
}
