//! A JSON body extractor whose rejections are [`GatewayError`]s, so a bad body gets the same
//! `{"error", "error_type"}` body as every other error, never axum's plain-text rejection.
//!
//! The body is parsed whatever its `Content-Type` (clients such as `curl -d` send
//! `application/x-www-form-urlencoded`): text that is not JSON is a 400, JSON of the wrong shape
//! a 422.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use crate::error::GatewayError;

pub(crate) struct Json<T>(pub T);

impl<S, T> FromRequest<S> for Json<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = GatewayError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            GatewayError::MalformedJson {
                message: rejection.body_text(),
            }
        })?;
        parse(&bytes).map(Json)
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
