//! API keys: who may call the gateway. With none configured the API is open, as it always was.
//! With keys, every route wants one (`Authorization: Bearer KEY`, what OpenAI's SDKs send, or
//! `x-api-key: KEY`), unknown routes included, except `/health` and `/metrics` when
//! [`AuthConfig`] makes them public. A refusal is a 401 in the shape of the path's API
//! ([`crate::error::ApiShape`]) and is counted by reason in [`AUTH_FAILURES_TOTAL`].
//!
//! Keys come from the command line and from a key file that SIGHUP re-reads
//! ([`spawn_reload_on_sighup`]). Only their SHA-256 digests are kept: a presented key is
//! hashed and compared with every digest in constant time, so the time taken does not say
//! which key it matched, how close it came, or how long the keys are. Keys are never logged,
//! and their `Debug` forms hide them.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, RwLock};

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};
use tokio_util::sync::CancellationToken;

use crate::error::{ApiShape, GatewayError};
use crate::metrics::AUTH_FAILURES_TOTAL;

/// The header that carries a key when `Authorization` does not.
pub const API_KEY_HEADER: &str = "x-api-key";

/// One API key as configured. Printable ASCII without spaces, so it travels in a header as
/// is; its `Debug` form hides it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// The key itself, for a client that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = GatewayError;

    /// Refuses an empty key and one with spaces or control characters. The message never
    /// repeats the key.
    fn from_str(key: &str) -> Result<Self, Self::Err> {
        if key.is_empty() {
            return Err(GatewayError::Config {
                message: "an API key must not be empty".into(),
            });
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(GatewayError::Config {
                message: format!(
                    "an API key must be printable ASCII without spaces, given one of {} bytes \
                     that is not",
                    key.len()
                ),
            });
        }
        Ok(Self(key.to_string()))
    }
}

/// The keys of a key file: one a line, surrounding whitespace trimmed; blank lines and lines
/// starting with `#` are ignored. An error names the line, not its text.
pub fn parse_key_file(text: &str) -> Result<Vec<ApiKey>, String> {
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.trim()))
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(|(number, line)| line.parse().map_err(|e| format!("line {number}: {e}")))
        .collect()
}

/// The keys in force, as SHA-256 digests.
struct Digests(Vec<[u8; 32]>);

impl Digests {
    fn new<'a>(keys: impl IntoIterator<Item = &'a ApiKey>) -> Self {
        Self(keys.into_iter().map(|k| digest(k.0.as_bytes())).collect())
    }

    /// Whether `presented` is one of the keys. Every digest is compared, whichever matches.
    fn contains(&self, presented: &[u8]) -> Choice {
        let presented = digest(presented);
        self.0
            .iter()
            .fold(Choice::from(0), |found, key| found | key.ct_eq(&presented))
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// Why a request was refused: the `reason` label of [`AUTH_FAILURES_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    /// No key in either header.
    Missing,
    /// A key, but not one of ours.
    Invalid,
}

impl AuthFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Invalid => "invalid",
        }
    }

    fn into_error(self) -> GatewayError {
        match self {
            Self::Missing => GatewayError::MissingApiKey,
            Self::Invalid => GatewayError::InvalidApiKey,
        }
    }
}

/// The keys a request may present: the command line's, and the key file's as last read. A
/// cheap `Clone` handle; [`KeyStore::reload`] swaps the file's keys under every clone.
#[derive(Clone)]
pub struct KeyStore {
    inner: Arc<Keys>,
}

struct Keys {
    inline: Vec<ApiKey>,
    file: Option<PathBuf>,
    current: RwLock<Arc<Digests>>,
}

impl KeyStore {
    /// No keys: every request passes.
    pub fn open() -> Self {
        Self::with(Vec::new(), None, Vec::new())
    }

    /// `inline` keys and those of `file`, read now. Keys are required when either is given;
    /// a key file that cannot be read, or holds no key, is an error.
    pub fn load(inline: Vec<ApiKey>, file: Option<PathBuf>) -> Result<Self, GatewayError> {
        let from_file = file.as_deref().map(read_key_file).transpose()?;
        Ok(Self::with(inline, file, from_file.unwrap_or_default()))
    }

    fn with(inline: Vec<ApiKey>, file: Option<PathBuf>, from_file: Vec<ApiKey>) -> Self {
        let current = Digests::new(inline.iter().chain(&from_file));
        Self {
            inner: Arc::new(Keys {
                inline,
                file,
                current: RwLock::new(Arc::new(current)),
            }),
        }
    }

    /// Whether requests need a key. A key file keeps them needing one whatever it holds.
    pub fn is_required(&self) -> bool {
        !self.inner.inline.is_empty() || self.inner.file.is_some()
    }

    pub fn key_file(&self) -> Option<&Path> {
        self.inner.file.as_deref()
    }

    /// How many keys are in force now.
    pub fn len(&self) -> usize {
        self.current().0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Re-reads the key file and puts its keys (with the command line's) in force; returns
    /// how many are. When the file cannot be read or holds no valid key, the keys in force
    /// stay as they were: a half-written or emptied file neither locks every client out nor
    /// opens the API.
    pub fn reload(&self) -> Result<usize, GatewayError> {
        let Some(path) = self.inner.file.as_deref() else {
            return Ok(self.len());
        };
        let from_file = read_key_file(path)?;
        let digests = Digests::new(self.inner.inline.iter().chain(&from_file));
        let count = digests.0.len();
        *self
            .inner
            .current
            .write()
            .expect("no panic holds the key lock") = Arc::new(digests);
        Ok(count)
    }

    /// Checks the keys a request presents in `headers`.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AuthFailure> {
        let current = self.current();
        let mut presented = false;
        let mut found = Choice::from(0);
        for key in presented_keys(headers) {
            presented = true;
            found |= current.contains(key);
        }
        match (presented, bool::from(found)) {
            (_, true) => Ok(()),
            (false, false) => Err(AuthFailure::Missing),
            (true, false) => Err(AuthFailure::Invalid),
        }
    }

    fn current(&self) -> Arc<Digests> {
        Arc::clone(
            &self
                .inner
                .current
                .read()
                .expect("no panic holds the key lock"),
        )
    }
}

impl fmt::Debug for KeyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyStore")
            .field("keys", &self.len())
            .field("file", &self.inner.file)
            .finish()
    }
}

fn read_key_file(path: &Path) -> Result<Vec<ApiKey>, GatewayError> {
    let load = |message: String| GatewayError::Load {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| load(e.to_string()))?;
    let keys = parse_key_file(&text).map_err(load)?;
    if keys.is_empty() {
        return Err(load("the API key file holds no key".into()));
    }
    Ok(keys)
}

/// The keys in `Authorization: Bearer KEY` and `x-api-key: KEY` headers. Another
/// `Authorization` scheme presents no key.
fn presented_keys(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    let bearer = headers
        .get_all(header::AUTHORIZATION)
        .into_iter()
        .filter_map(|value| {
            let (scheme, token) = value.to_str().ok()?.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim().as_bytes())
        });
    let api_key = headers
        .get_all(API_KEY_HEADER)
        .into_iter()
        .map(|value| value.as_bytes().trim_ascii());
    bearer.chain(api_key)
}

/// Who may call the API. The default is open.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    pub keys: KeyStore,
    /// `/health` answers without a key (for load balancers' probes).
    pub public_health: bool,
    /// `/metrics` answers without a key (for a Prometheus without credentials).
    pub public_metrics: bool,
}

impl Default for AuthConfig {
    fn default() -> Self {
        Self {
            keys: KeyStore::open(),
            public_health: false,
            public_metrics: false,
        }
    }
}

impl AuthConfig {
    fn is_public(&self, path: &str) -> bool {
        (self.public_health && path == "/health") || (self.public_metrics && path == "/metrics")
    }
}

/// The middleware: a request without a valid key gets a 401 before anything else reads it.
/// It holds the [`AuthConfig`] alone (its key store is shared, so a reload reaches it), not
/// the app's state: who may call is decided before anything of the app is touched.
pub(crate) async fn require_api_key(
    State(auth): State<AuthConfig>,
    request: Request,
    next: Next,
) -> Response {
    if !auth.keys.is_required() || auth.is_public(request.uri().path()) {
        return next.run(request).await;
    }
    match auth.keys.check(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(failure) => {
            ::metrics::counter!(AUTH_FAILURES_TOTAL, "reason" => failure.as_str()).increment(1);
            failure
                .into_error()
                .into_shaped_response(ApiShape::of(request.uri().path()))
        }
    }
}

/// Re-reads the key file on every SIGHUP until `shutdown`; a reload that fails keeps the keys
/// in force and logs a warning. The handler is in place when this returns, so a SIGHUP from
/// then on no longer ends the process.
pub fn spawn_reload_on_sighup(
    keys: KeyStore,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, GatewayError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangups = signal(SignalKind::hangup()).map_err(|e| GatewayError::Config {
        message: format!("installing the SIGHUP handler: {e}"),
    })?;
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                received = hangups.recv() => if received.is_none() { return },
            }
            let store = keys.clone();
            match tokio::task::spawn_blocking(move || store.reload()).await {
                Ok(Ok(count)) => tracing::info!(keys = count, "api keys reloaded"),
                Ok(Err(error)) => {
                    tracing::warn!(%error, keys = keys.len(), "api key reload failed; keeping the keys in force")
                }
                Err(error) => tracing::warn!(%error, "api key reload task failed"),
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::StatusCode;
    use axum::Router;
    use http_body_util::BodyExt;
    use metrics_exporter_prometheus::PrometheusBuilder;
    use tower::ServiceExt;

    use super::*;
    use crate::config::GatewayConfig;
    use crate::fake::{FakeBackend, FakeScript};

    const STORIES_TOKENIZER: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/models/stories260K/tokenizer.json"
    );

    fn key(k: &str) -> ApiKey {
        k.parse().unwrap()
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn key_files_skip_blanks_and_comments_and_name_bad_lines() {
        let keys = parse_key_file("# ops\n\n  alpha  \nbeta\n# old: gamma\n").unwrap();
        assert_eq!(keys, vec![key("alpha"), key("beta")]);
        let error = parse_key_file("alpha\nbad key\n").unwrap_err();
        assert!(error.contains("line 2"), "{error}");
        assert!(
            !error.contains("bad key"),
            "the key is not repeated: {error}"
        );
        assert!("".parse::<ApiKey>().is_err());
        assert!("tab\there".parse::<ApiKey>().is_err());
    }

    #[test]
    fn only_a_configured_key_passes_either_header() {
        let store = KeyStore::load(vec![key("sk-one"), key("sk-two")], None).unwrap();
        assert!(store.is_required());
        let check = |pairs: &[(&str, &str)]| store.check(&headers(pairs));
        assert_eq!(check(&[("authorization", "Bearer sk-one")]), Ok(()));
        assert_eq!(check(&[("authorization", "bearer  sk-two ")]), Ok(()));
        assert_eq!(check(&[("x-api-key", "sk-two")]), Ok(()));
        assert_eq!(check(&[]), Err(AuthFailure::Missing));
        assert_eq!(
            check(&[("authorization", "Basic c2stb25lOg==")]),
            Err(AuthFailure::Missing)
        );
        assert_eq!(
            check(&[("authorization", "Bearer ")]),
            Err(AuthFailure::Missing)
        );
        for wrong in ["sk-on", "sk-one2", "SK-ONE", "sk-one sk-two"] {
            assert_eq!(
                check(&[("authorization", &format!("Bearer {wrong}"))]),
                Err(AuthFailure::Invalid),
                "{wrong:?}"
            );
        }
        // A wrong key beside a right one does not spoil it.
        assert_eq!(
            check(&[("authorization", "Bearer nope"), ("x-api-key", "sk-one")]),
            Ok(())
        );
        let open = KeyStore::open();
        assert!(!open.is_required());
        assert_eq!(open.check(&headers(&[])), Err(AuthFailure::Missing));
    }

    #[test]
    fn debug_forms_hide_the_keys() {
        let store = KeyStore::load(vec![key("sk-secret")], None).unwrap();
        let config = AuthConfig {
            keys: store,
            ..AuthConfig::default()
        };
        let printed = format!("{config:?} {:?}", key("sk-secret"));
        assert!(!printed.contains("sk-secret"), "{printed}");
    }

    #[test]
    fn reload_swaps_the_file_keys_and_a_failed_one_keeps_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "old-key\n").unwrap();
        let store = KeyStore::load(vec![key("inline-key")], Some(path.clone())).unwrap();
        let clone = store.clone();
        let passes = |k: &str| clone.check(&headers(&[("x-api-key", k)])).is_ok();
        assert!(passes("old-key") && passes("inline-key"));

        std::fs::write(&path, "# rotated\nnew-key\n").unwrap();
        assert_eq!(store.reload().unwrap(), 2);
        assert!(passes("new-key") && passes("inline-key"));
        assert!(!passes("old-key"));

        // Emptied, malformed or gone: the keys in force stay.
        for broken in ["# nothing left\n", "new key with spaces\n"] {
            std::fs::write(&path, broken).unwrap();
            assert!(store.reload().is_err(), "{broken:?}");
            assert!(passes("new-key"), "after {broken:?}");
        }
        std::fs::remove_file(&path).unwrap();
        let error = store.reload().unwrap_err().to_string();
        assert!(error.contains("keys"), "names the file: {error}");
        assert!(passes("new-key") && store.is_required());

        // At start-up the same file is an error, not an open API.
        assert!(KeyStore::load(Vec::new(), Some(path)).is_err());
    }

    fn app(auth: AuthConfig) -> Router {
        let fake = Arc::new(FakeBackend::new(FakeScript::default()));
        let mut config = GatewayConfig::new("stories260K", STORIES_TOKENIZER);
        config.auth = auth;
        let handle = PrometheusBuilder::new().build_recorder().handle();
        crate::app(crate::AppState::new(config, fake, handle).unwrap())
    }

    fn keyed(public_health: bool) -> AuthConfig {
        AuthConfig {
            keys: KeyStore::load(vec![key("sk-test")], None).unwrap(),
            public_health,
            public_metrics: false,
        }
    }

    async fn call(
        app: &Router,
        method: &str,
        uri: &str,
        key: Option<(&str, &str)>,
    ) -> (StatusCode, HeaderMap, serde_json::Value) {
        let mut request = axum::http::Request::builder().method(method).uri(uri);
        if let Some((name, value)) = key {
            request = request.header(name, value);
        }
        let body = if method == "POST" {
            Body::from(r#"{"inputs": "Hi", "prompt": "Hi", "parameters": {"max_new_tokens": 2}}"#)
        } else {
            Body::empty()
        };
        let response = app
            .clone()
            .oneshot(request.body(body).unwrap())
            .await
            .unwrap();
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
        (parts.status, parts.headers, json)
    }

    const ROUTES: [(&str, &str); 9] = [
        ("POST", "/generate"),
        ("POST", "/generate_stream"),
        ("POST", "/tokenize"),
        ("GET", "/info"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/nowhere"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
    ];

    #[tokio::test]
    async fn every_route_wants_a_key_in_its_apis_shape() {
        let app = app(keyed(false));
        for (method, uri) in ROUTES {
            for (key, code) in [
                (None, "missing_api_key"),
                (
                    Some(("authorization", "Bearer sk-wrong")),
                    "invalid_api_key",
                ),
            ] {
                let (status, headers, body) = call(&app, method, uri, key).await;
                assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {uri}");
                assert_eq!(headers[header::WWW_AUTHENTICATE], "Bearer");
                assert_eq!(headers[header::CONTENT_TYPE], "application/json");
                if uri.starts_with("/v1/") {
                    assert_eq!(body["error"]["type"], "authentication", "{body}");
                    assert_eq!(body["error"]["code"], code, "{body}");
                    assert!(body["error"]["param"].is_null());
                } else {
                    assert_eq!(body["error_type"], "authentication", "{uri}: {body}");
                    assert!(body["error"].is_string(), "{body}");
                }
            }
            for key in [
                ("authorization", "Bearer sk-test"),
                ("x-api-key", "sk-test"),
            ] {
                let (status, _, body) = call(&app, method, uri, Some(key)).await;
                let expected = if uri == "/nowhere" {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::OK
                };
                assert_eq!(status, expected, "{method} {uri} {key:?}: {body}");
            }
        }
    }

    #[tokio::test]
    async fn public_health_exempts_health_only_and_no_keys_is_open() {
        let app = app(keyed(true));
        assert_eq!(call(&app, "GET", "/health", None).await.0, StatusCode::OK);
        assert_eq!(
            call(&app, "GET", "/metrics", None).await.0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            call(&app, "GET", "/info", None).await.0,
            StatusCode::UNAUTHORIZED
        );
        let open = self::app(AuthConfig::default());
        for (method, uri) in ROUTES.into_iter().filter(|(_, uri)| *uri != "/nowhere") {
            assert_eq!(
                call(&open, method, uri, None).await.0,
                StatusCode::OK,
                "{uri}"
            );
        }
    }
}
