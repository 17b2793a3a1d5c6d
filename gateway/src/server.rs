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
use axum::http::{Method, Uri};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tracing::{field, Instrument};

use crate::error::{ApiShape, GatewayError};
use crate::service_routes::{health, info, metrics, models, tokenize};
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
            state.config().auth.clone(),
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

/// The API's OpenAPI document ([`crate::openapi`]).
async fn openapi_json(State(state): State<AppState>) -> axum::Json<serde_json::Value> {
    axum::Json(crate::openapi::document(&state))
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
    use axum::http::{header, Request, StatusCode};
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
