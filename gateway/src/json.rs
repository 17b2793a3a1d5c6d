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

/// Integers as JSON Schema's `integer` admits them: `92254.0` is the integer 92254 there, and
/// the OpenAPI document declares `integer`, so a client (or a fuzzer) may send either spelling.
/// serde's own integer types refuse any number written with a fraction, so every request
/// integer is read through these (`#[serde(default, deserialize_with = "int::opt")]`). A
/// fraction (`1.5`), a non-finite number or a value outside the target type is still refused.
pub(crate) mod int {
    use std::fmt;
    use std::marker::PhantomData;

    use serde::de::{self, Deserialize, Deserializer, Visitor};

    /// One integer read leniently; `T` is any of Rust's integer types.
    struct Lenient<T>(T);

    impl<'de, T: TryFrom<i128>> Deserialize<'de> for Lenient<T> {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            deserializer
                .deserialize_any(IntVisitor(PhantomData))
                .map(Lenient)
        }
    }

    struct IntVisitor<T>(PhantomData<T>);

    impl<T: TryFrom<i128>> IntVisitor<T> {
        fn fit<E: de::Error>(&self, v: i128) -> Result<T, E> {
            T::try_from(v).map_err(|_| {
                E::custom(format!(
                    "integer `{v}` out of range, expected {}",
                    std::any::type_name::<T>()
                ))
            })
        }
    }

    impl<'de, T: TryFrom<i128>> Visitor<'de> for IntVisitor<T> {
        type Value = T;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "an integer ({})", std::any::type_name::<T>())
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
            self.fit(v.into())
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
            self.fit(v.into())
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
            // 2^100 is far past every target type, and below it `as` is exact for an
            // integral f64.
            if v.is_finite() && v.fract() == 0.0 && v.abs() < 2f64.powi(100) {
                #[allow(clippy::cast_possible_truncation)]
                self.fit(v as i128)
            } else {
                Err(E::invalid_type(de::Unexpected::Float(v), &self))
            }
        }
    }

    /// An optional integer (absent and `null` are `None`).
    pub(crate) fn opt<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i128>,
    {
        Option::<Lenient<T>>::deserialize(deserializer).map(|v| v.map(|Lenient(v)| v))
    }

    /// A list of integers.
    pub(crate) fn vec<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i128>,
    {
        Vec::<Lenient<T>>::deserialize(deserializer)
            .map(|v| v.into_iter().map(|Lenient(v)| v).collect())
    }

    /// A list of lists of integers.
    pub(crate) fn vec_vec<'de, D, T>(deserializer: D) -> Result<Vec<Vec<T>>, D::Error>
    where
        D: Deserializer<'de>,
        T: TryFrom<i128>,
    {
        Vec::<Vec<Lenient<T>>>::deserialize(deserializer).map(|v| {
            v.into_iter()
                .map(|v| v.into_iter().map(|Lenient(v)| v).collect())
                .collect()
        })
    }
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

    #[derive(Debug, serde::Deserialize)]
    struct Ints {
        #[serde(default, deserialize_with = "int::opt")]
        n: Option<u32>,
        #[serde(default, deserialize_with = "int::opt")]
        k: Option<i64>,
    }

    #[test]
    fn integers_may_be_written_as_integral_floats_but_not_fractions() {
        let ints: Ints = serde_json::from_str(r#"{"n": 92254.0, "k": -3.0}"#).unwrap();
        assert_eq!((ints.n, ints.k), (Some(92254), Some(-3)));
        let ints: Ints = serde_json::from_str(r#"{"n": null}"#).unwrap();
        assert_eq!((ints.n, ints.k), (None, None));
        for bad in [
            r#"{"n": 1.5}"#,
            r#"{"n": -1}"#,
            r#"{"n": 4294967296}"#,
            r#"{"n": 4294967296.0}"#,
            r#"{"n": 1e300}"#,
            r#"{"n": "1"}"#,
        ] {
            assert!(serde_json::from_str::<Ints>(bad).is_err(), "{bad}");
        }
        let max: Ints = serde_json::from_str(r#"{"n": 4294967295.0}"#).unwrap();
        assert_eq!(max.n, Some(u32::MAX));
    }
}
