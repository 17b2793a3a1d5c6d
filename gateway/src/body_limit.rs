//! Request bodies over `--max-body-bytes` get a 413 in the shape of the path's API, before a
//! handler runs. A body that declares its size (`Content-Length`) is judged by it; a chunked one
//! is read here, up to the limit (every route that takes a body buffers it whole anyway).
//!
//! Refusing a body means not reading it, and a server that closes a connection with unread
//! bytes in its socket makes the kernel reset it: the client, still writing, may see the reset
//! instead of the 413. So a refused body that is not huge is read and thrown away first, unless
//! the client waits for `100 Continue` before sending it, in which case it never comes.

use std::time::Duration;

use axum::body::{Body, BodyDataStream, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;

use crate::error::{ApiShape, GatewayError};
use crate::state::AppState;

/// Refused bodies up to this size are read and dropped before the 413 is sent.
const DRAIN_MAX_BYTES: u64 = 64 << 20;
/// The longest a refused body is read for.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The middleware: a body over the limit gets 413 without reaching a handler.
pub(crate) async fn limit_body(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let limit_bytes = state.config().max_body_bytes;
    let shape = ApiShape::of(request.uri().path());
    let too_large = |given_bytes| {
        GatewayError::BodyTooLarge {
            limit_bytes,
            given_bytes,
        }
        .into_shaped_response(shape)
    };
    match content_length(request.headers()) {
        Some(given_bytes) if given_bytes > limit_bytes as u64 => {
            let waits_for_continue = request.headers().contains_key(header::EXPECT);
            if !waits_for_continue && given_bytes <= DRAIN_MAX_BYTES {
                drain(request.into_body().into_data_stream()).await;
            }
            too_large(Some(given_bytes))
        }
        Some(_) => next.run(request).await,
        None if request.body().size_hint().exact() == Some(0) => next.run(request).await,
        None => {
            let (parts, body) = request.into_parts();
            match read_at_most(body, limit_bytes).await {
                Ok(Some(bytes)) => {
                    next.run(Request::from_parts(parts, Body::from(bytes)))
                        .await
                }
                Ok(None) => too_large(None),
                Err(error) => error.into_shaped_response(shape),
            }
        }
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The whole body, or `None` (after draining the rest) when it runs past `limit_bytes`.
async fn read_at_most(body: Body, limit_bytes: usize) -> Result<Option<Bytes>, GatewayError> {
    let mut frames = body.into_data_stream();
    let mut buffer = Vec::new();
    while let Some(frame) = frames.next().await {
        let frame = frame.map_err(|e| GatewayError::MalformedJson {
            message: format!("reading the request body: {e}"),
        })?;
        if buffer.len() + frame.len() > limit_bytes {
            drain(frames).await;
            return Ok(None);
        }
        buffer.extend_from_slice(&frame);
    }
    Ok(Some(Bytes::from(buffer)))
}

/// Reads `frames` to their end, one at a time, for at most [`DRAIN_MAX_BYTES`] and
/// [`DRAIN_TIMEOUT`].
async fn drain(mut frames: BodyDataStream) {
    let read_all = async {
        let mut read = 0u64;
        while let Some(Ok(frame)) = frames.next().await {
            read += frame.len() as u64;
            if read > DRAIN_MAX_BYTES {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, read_all).await;
}

#[cfg(test)]
mod tests {
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

    fn app(max_body_bytes: usize) -> axum::Router {
        let fake = std::sync::Arc::new(FakeBackend::new(FakeScript::default()));
        let mut config = GatewayConfig::new("stories260K", STORIES_TOKENIZER);
        config.max_body_bytes = max_body_bytes;
        let handle = PrometheusBuilder::new().build_recorder().handle();
        crate::app(AppState::new(config, fake, handle).unwrap())
    }

    fn generate_body(prompt_bytes: usize) -> String {
        format!(
            r#"{{"inputs": "{}", "parameters": {{"max_new_tokens": 1}}}}"#,
            "a ".repeat(prompt_bytes / 2)
        )
    }

    async fn send(
        app: axum::Router,
        uri: &str,
        body: String,
        declare: bool,
    ) -> (StatusCode, serde_json::Value) {
        let mut request = Request::post(uri).header("content-type", "application/json");
        if declare {
            request = request.header("content-length", body.len());
        }
        let body = if declare {
            Body::from(body)
        } else {
            // No size hint: what a chunked upload looks like to the server.
            Body::from_stream(futures::stream::iter([Ok::<_, std::io::Error>(body)]))
        };
        let response = app.oneshot(request.body(body).unwrap()).await.unwrap();
        let status = response.status();
        assert_eq!(response.headers()["content-type"], "application/json");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn bodies_over_the_limit_are_413_declared_or_chunked() {
        let limit = 512;
        for declare in [true, false] {
            let (status, body) =
                send(app(limit), "/generate", generate_body(limit + 100), declare).await;
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "declared: {declare}");
            assert_eq!(body["error_type"], "payload_too_large", "{body}");
            let message = body["error"].as_str().unwrap();
            assert!(message.contains("512"), "{message}");

            let (status, body) = send(
                app(limit),
                "/v1/completions",
                generate_body(limit + 100),
                declare,
            )
            .await;
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
            assert_eq!(body["error"]["code"], "payload_too_large", "{body}");

            let (status, _) = send(app(limit), "/generate", generate_body(100), declare).await;
            assert_eq!(status, StatusCode::OK, "declared: {declare}");
        }
    }
}
