//! A JSON body extractor whose rejections are [`GatewayError`]s, so a bad body gets the same
//! `{"error", "error_type"}` body as every other error, never axum's plain-text rejection.
//!
//! The body is parsed whatever its `Content-Type` (clients such as `curl -d` send
//! `application/x-www-form-urlencoded`): text that is not JSON is a 400, JSON of the wrong shape
//! a 422, and one over `--max-body-bytes` a 413 (though [`crate::body_limit`] refuses those
//! before a handler runs: this is the backstop).

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::{GatewayError, OpenAiError};
use crate::state::AppState;

pub(crate) struct Json<T>(pub T);

impl<T> FromRequest<AppState> for Json<T>
where
    T: DeserializeOwned,
{
    type Rejection = GatewayError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|rejection| match rejection {
                BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) => {
                    GatewayError::BodyTooLarge {
                        limit_bytes: state.config().max_body_bytes,
                        given_bytes: None,
                    }
                }
                other => GatewayError::MalformedJson {
                    message: other.body_text(),
                },
            })?;
        parse(&bytes).map(Json)
    }
}

/// [`Json`] for OpenAI's routes: a bad body is answered in OpenAI's error shape.
pub(crate) struct OpenAiJson<T>(pub T);

impl<T> FromRequest<AppState> for OpenAiJson<T>
where
    T: DeserializeOwned,
{
    type Rejection = OpenAiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let Json(value) = Json::from_request(req, state).await?;
        Ok(Self(value))
    }
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, GatewayError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let message = e.to_string();
        match e.classify() {
            serde_json::error::Category::Data => GatewayError::InvalidBody { message },
            _ => GatewayError::MalformedJson { message },
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        inputs: String,
    }

    #[test]
    fn syntax_errors_are_malformed_and_shape_errors_invalid() {
        assert!(matches!(
            parse::<Body>(b"{\"inputs\": "),
            Err(GatewayError::MalformedJson { .. })
        ));
        assert!(matches!(
            parse::<Body>(b"not json"),
            Err(GatewayError::MalformedJson { .. })
        ));
        match parse::<Body>(b"{\"input\": \"x\"}") {
            Err(GatewayError::InvalidBody { message }) => {
                assert!(message.contains("inputs"), "{message}")
            }
            other => panic!("expected InvalidBody, got {other:?}"),
        }
    }
}
