//! The routes around generation: `GET /info`, `GET /health`, `POST /tokenize`, `GET /metrics`
//! and `GET /v1/models`. Apart from [`crate::server`], which mounts them, so that the OpenAPI
//! document ([`crate::openapi`]) can name them without depending on the router that serves it.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use crate::error::GatewayError;
use crate::json::Json;
use crate::state::AppState;

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct Info {
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
    /// The architecture served (config.json's `architectures[0]`), and the weight and KV
    /// cache types, as the nodes report them; the architecture from the gateway's own
    /// config.json before any node has.
    architecture: Option<String>,
    weight_dtype: Option<String>,
    kv_cache_dtype: Option<String>,
    router: &'static str,
    version: &'static str,
    /// The admission queue: its limits and what waits in it now.
    queue: serde_json::Value,
    backend: serde_json::Value,
}

#[utoipa::path(get, path = "/info", tag = "Service", responses((status = 200, body = Info)))]
pub(crate) async fn info(State(state): State<AppState>) -> axum::Json<Info> {
    let config = state.config();
    let limits = state.limits();
    let types = served_types(&state);
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
        architecture: types.architecture,
        weight_dtype: types.weight_dtype,
        kv_cache_dtype: types.kv_cache_dtype,
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
pub(crate) async fn health(State(state): State<AppState>) -> Response {
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
pub(crate) struct TokenizeRequest {
    inputs: String,
}

/// TGI's token, with `start`/`stop` as character offsets into the input.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct SimpleToken {
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
pub(crate) async fn tokenize(
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
pub(crate) async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics().render(),
    )
        .into_response()
}

/// What `/info` and `/v1/models` say is served; each field `None` while unknown.
struct ServedTypes {
    architecture: Option<String>,
    weight_dtype: Option<String>,
    kv_cache_dtype: Option<String>,
}

fn served_types(state: &AppState) -> ServedTypes {
    let nonempty = |s: String| Some(s).filter(|s| !s.is_empty());
    match state.backend().model_types() {
        Some(t) => ServedTypes {
            architecture: nonempty(t.architecture),
            weight_dtype: nonempty(t.weight_dtype),
            kv_cache_dtype: nonempty(t.kv_cache_dtype),
        },
        None => ServedTypes {
            architecture: own_architecture(state),
            weight_dtype: None,
            kv_cache_dtype: None,
        },
    }
}

/// `architectures[0]` of the config.json beside the gateway's tokenizer, when there is one.
fn own_architecture(state: &AppState) -> Option<String> {
    let dir = state.config().tokenizer_path.parent()?;
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).ok()?).ok()?;
    config["architectures"][0].as_str().map(str::to_string)
}

/// The served model under its id and each alias (`--served-model-name`), with the context
/// the cluster really holds, its architecture and its weight and KV cache types.
#[utoipa::path(get, path = "/v1/models", tag = "OpenAI", responses((status = 200, description = "The served model and its aliases")))]
pub(crate) async fn models(State(state): State<AppState>) -> axum::Json<serde_json::Value> {
    let max_model_len = state.limits().max_total_tokens;
    let types = served_types(&state);
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
                "architecture": types.architecture,
                "weight_dtype": types.weight_dtype,
                "kv_cache_dtype": types.kv_cache_dtype,
            })
        })
        .collect();
    axum::Json(serde_json::json!({ "object": "list", "data": data }))
}
