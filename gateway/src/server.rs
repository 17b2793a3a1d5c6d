//! The HTTP routes. [`app`] builds the router from an [`AppState`] and nothing else, so tests
//! drive it with `oneshot` and [`crate::run`] serves it.
//!
//! Generation: TGI's `POST /generate` and `/generate_stream` ([`crate::tgi`]), OpenAI's `POST
//! /v1/completions` and `/v1/chat/completions` ([`crate::openai`]). Around them: `GET /info`,
//! `GET /health`, `POST /tokenize`, `GET /metrics` and `GET /v1/models`.
//!
//! At the edge, before any of them: API keys ([`crate::auth`]), then the body size limit
//! ([`crate::body_limit`]). Unknown routes get a JSON 404 and a wrong method a JSON 405 with
//! `Allow`, in the shape of the path's API.

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::{Deserialize, Serialize};
use tracing::{field, Instrument};

use crate::error::{ApiShape, GatewayError};
use crate::json::Json;
use crate::state::AppState;
use crate::tgi;
use crate::{auth, body_limit, openai};

/// The gateway's router.
pub fn app(state: AppState) -> Router {
    // Only the API is traced: a scrape of /metrics or a /health probe every few seconds would
    // each start a root trace and bury the requests in Jaeger.
    let api = Router::new()
        .route("/", post(tgi::compat_generate))
        .route("/generate", post(tgi::generate))
        .route("/generate_stream", post(tgi::generate_stream))
        .route("/v1/completions", post(openai::completions::completions))
        .route("/v1/chat/completions", post(openai::chat::chat_completions))
        .route("/tokenize", post(tokenize))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            http_request_span,
        ));
    Router::new()
        .route("/v1/models", get(models))
        .route("/openapi.json", get(openapi_json))
        .route("/info", get(info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(not_found)
        // After every route: it is set on the routes registered so far. axum adds `Allow`.
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            body_limit::limit_body,
        ))
        .layer(DefaultBodyLimit::max(state.config().max_body_bytes))
        // Outermost: a request without a key is refused before anything reads its body.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_api_key,
        ))
        .with_state(state)
}

/// Every API request runs in an `http_request` span; the `generate` span of a generation is
/// its child and outlives it while the stream is written. `request_id` and the prompt's sizes
/// are recorded once validation made them ([`AppState::generate`]).
///
/// An error answer records its `error_type`; a server error (5xx) also marks the span
/// failed (`otel.status_code = "ERROR"`). Client errors (a 422, a 429) leave the status unset,
/// as OpenTelemetry's HTTP conventions ask of server spans: the request was refused, the
/// service did not fail, and `error_type` still finds them. Errors after a stream started are
/// recorded on `generate`.
async fn http_request_span(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let span = tracing::info_span!(
        "http_request",
        method = %request.method(),
        path = request.uri().path(),
        model = %state.config().model_id,
        request_id = field::Empty,
        prompt_tokens = field::Empty,
        max_new_tokens = field::Empty,
        status = field::Empty,
        error_type = field::Empty,
        otel.status_code = field::Empty,
    );
    // The client's `traceparent` makes this span part of its trace; without one it is a root.
    telemetry::set_parent(&span, telemetry::extract_http(request.headers()));
    let response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.record("status", i64::from(status.as_u16()));
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    if status.is_server_error() {
        span.record("otel.status_code", "ERROR");
    }
    // Set by `GatewayError::into_response`; an error that is not ours (a framework rejection)
    // has none.
    let error_type = response
        .extensions()
        .get::<proto::ErrorCode>()
        .map_or("unknown", |code| code.error_type());
    span.record("error_type", error_type);
    response
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct Info {
    model_id: String,
    max_input_tokens: usize,
    max_total_tokens: usize,
    max_concurrent_requests: usize,
    max_stop_sequences: usize,
    max_top_n_tokens: usize,
    chat_template: bool,
    /// Set when the model's chat template is a stand-in (a model never trained on chats), and
    /// why.
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template_stand_in: Option<String>,
    router: &'static str,
    version: &'static str,
    /// The admission queue: its limits and what waits in it now.
    queue: serde_json::Value,
    backend: serde_json::Value,
}

#[utoipa::path(get, path = "/info", tag = "Service", responses((status = 200, body = Info)))]
async fn info(State(state): State<AppState>) -> axum::Json<Info> {
    let config = state.config();
    let limits = state.limits();
    axum::Json(Info {
        model_id: config.model_id.clone(),
        max_input_tokens: limits.max_input_tokens,
        max_total_tokens: limits.max_total_tokens,
        max_concurrent_requests: config.max_concurrent_requests,
        max_stop_sequences: config.max_stop_sequences,
        max_top_n_tokens: config.max_top_n_tokens,
        chat_template: state.validator().has_chat_template(),
        chat_template_stand_in: state
            .validator()
            .chat_template_stand_in()
            .map(str::to_string),
        router: "fission-gateway",
        version: env!("CARGO_PKG_VERSION"),
        queue: state.queue().describe(),
        backend: state.backend().describe(),
    })
}

#[utoipa::path(get, path = "/health", tag = "Service", responses(
    (status = 200, description = "The backend is ready"),
    (status = 503, description = "No decode node is ready", body = crate::error::ErrorBody),
))]
async fn health(State(state): State<AppState>) -> Response {
    if state.backend().is_ready() {
        axum::Json(serde_json::json!({ "status": "ok" })).into_response()
    } else {
        // Not-ready is a state that start-up and load balancers poll for, not a failed request:
        // answered in the error shape, but neither logged nor counted as an error.
        let code = proto::ErrorCode::Unavailable;
        let status = axum::http::StatusCode::from_u16(code.http_status())
            .expect("the error table holds valid HTTP statuses");
        let body = serde_json::json!({
            "error": "backend unavailable: the backend is not ready",
            "error_type": code.error_type(),
        });
        (status, axum::Json(body)).into_response()
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
struct TokenizeRequest {
    inputs: String,
}

/// TGI's token, with `start`/`stop` as character offsets into the input.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct SimpleToken {
    id: u32,
    text: String,
    start: usize,
    stop: usize,
}

#[utoipa::path(post, path = "/tokenize", tag = "TGI", request_body = TokenizeRequest, responses(
    (status = 200, body = Vec<SimpleToken>),
    (status = 400, description = "Malformed JSON", body = crate::error::ErrorBody),
    (status = 413, description = "Body over --max-body-bytes", body = crate::error::ErrorBody),
    (status = 422, description = "Over the input token limit", body = crate::error::ErrorBody),
))]
async fn tokenize(
    State(state): State<AppState>,
    Json(request): Json<TokenizeRequest>,
) -> Result<axum::Json<Vec<SimpleToken>>, GatewayError> {
    let validator = std::sync::Arc::clone(state.validator());
    let limits = state.limits();
    let tokens = tokio::task::spawn_blocking(move || {
        let encoding = validator.tokenize_input(&request.inputs, limits)?;
        let tokens = encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &(start, stop))| SimpleToken {
                id,
                text: request
                    .inputs
                    .chars()
                    .skip(start)
                    .take(stop.saturating_sub(start))
                    .collect(),
                start,
                stop,
            })
            .collect::<Vec<_>>();
        Ok::<_, GatewayError>(tokens)
    })
    .await
    .map_err(|e| GatewayError::Internal {
        message: format!("tokenize task: {e}"),
    })??;
    Ok(axum::Json(tokens))
}

#[utoipa::path(get, path = "/metrics", tag = "Service", responses(
    (status = 200, description = "Prometheus text exposition", content_type = "text/plain"),
))]
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics().render(),
    )
        .into_response()
}

/// The served model under its id and each alias (`--served-model-name`), with the context
/// the cluster really holds.
#[utoipa::path(get, path = "/v1/models", tag = "OpenAI", responses((status = 200, description = "The served model and its aliases")))]
async fn models(State(state): State<AppState>) -> axum::Json<serde_json::Value> {
    let max_model_len = state.limits().max_total_tokens;
    let data: Vec<serde_json::Value> = state
        .config()
        .model_names()
        .into_iter()
        .map(|name| {
            serde_json::json!({
                "id": name,
                "object": "model",
                "created": state.started_at_unix(),
                "owned_by": "fission",
                "root": state.config().model_id,
                "max_model_len": max_model_len,
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "object": "list", "data": data }))
}

/// The API's OpenAPI document ([`crate::openapi`]).
async fn openapi_json() -> axum::Json<utoipa::openapi::OpenApi> {
    axum::Json(crate::openapi::document())
}

async fn not_found(method: Method, uri: Uri) -> Response {
    GatewayError::NotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_shaped_response(ApiShape::of(uri.path()))
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    GatewayError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
    .into_shaped_response(ApiShape::of(uri.path()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Request, StatusCode};
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

    fn test_app() -> (Router, Arc<FakeBackend>) {
        let fake = Arc::new(FakeBackend::new(FakeScript::default()));
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let config = GatewayConfig::new("stories260K", STORIES_TOKENIZER);
        let state = AppState::new(config, fake.clone(), handle).unwrap();
        (app(state), fake)
    }

    async fn call(app: Router, request: Request<Body>) -> (StatusCode, serde_json::Value) {
        let response = app.oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    fn post(uri: &str, body: &str) -> Request<Body> {
        Request::post(uri)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap()
    }

    #[tokio::test]
    async fn generate_answers_through_oneshot() {
        let (app, _) = test_app();
        let request = post(
            "/generate",
            r#"{"inputs": "Hi", "parameters": {"max_new_tokens": 2}}"#,
        );
        let (status, body) = call(app, request).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, serde_json::json!({"generated_text": " Once upon"}));
    }

    #[tokio::test]
    async fn health_is_503_json_when_the_backend_is_not_ready() {
        let (app, fake) = test_app();
        fake.set_ready(false);
        let request = Request::get("/health").body(Body::empty()).unwrap();
        let (status, body) = call(app, request).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body["error_type"], "unavailable");
    }

    #[tokio::test]
    async fn malformed_json_and_unknown_routes_are_json_errors() {
        let (app, _) = test_app();
        let (status, body) = call(app.clone(), post("/generate", "{oops")).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(body["error_type"], "bad_request");
        let (status, body) = call(app.clone(), post("/generate", r#"{"inputs": 3}"#)).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(body["error_type"], "validation");
        let request = Request::get("/v2/nothing").body(Body::empty()).unwrap();
        let (status, body) = call(app.clone(), request).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(body["error"].as_str().unwrap().contains("/v2/nothing"));
        let request = Request::get("/v1/nothing").body(Body::empty()).unwrap();
        let (status, body) = call(app, request).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(body["error"]["code"], "not_found", "{body}");
    }

    #[tokio::test]
    async fn a_wrong_method_is_a_json_405_with_allow() {
        let (app, _) = test_app();
        for (method, uri, allow) in [
            ("GET", "/generate", "POST"),
            ("DELETE", "/info", "GET,HEAD"),
            ("PUT", "/v1/chat/completions", "POST"),
        ] {
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .body(Body::empty())
                .unwrap();
            let response = app.clone().oneshot(request).await.unwrap();
            assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED, "{uri}");
            assert_eq!(response.headers()[header::ALLOW], allow, "{uri}");
            assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
            let bytes = response.into_body().collect().await.unwrap().to_bytes();
            let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let message = if uri.starts_with("/v1/") {
                assert_eq!(body["error"]["type"], "method_not_allowed", "{body}");
                body["error"]["message"].as_str().unwrap().to_string()
            } else {
                assert_eq!(body["error_type"], "method_not_allowed", "{body}");
                body["error"].as_str().unwrap().to_string()
            };
            assert!(
                message.contains(method) && message.contains(uri),
                "{message}"
            );
        }
    }
}
