//! Sampling parameters and their validation.

use crate::error::{EngineError, Result};

/// The most alternatives a request may ask for per token, as in the OpenAI API.
pub const MAX_TOP_N_LOGPROBS: usize = 20;

/// Temperatures below this are treated as 0 (greedy), as vLLM does: dividing by a temperature this
/// small overflows `f32` for ordinary logits, and the distribution is a point mass anyway.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// How the next token is chosen from the logits. Check with [`SamplingParams::validate`] before use.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; in `(0, 1]`,
    /// 1 turns it off.
    pub top_p: f32,
    /// Penalises every distinct token of the prompt and the output so far, as in Hugging Face
    /// transformers (CTRL): a positive logit is divided by it, a negative one multiplied. 1 turns
    /// it off; must be > 0.
    pub repetition_penalty: f32,
    /// Seeds the draws of this request. The engine assigns a random seed when the request gives none.
    pub seed: u64,
    /// How many of the most likely alternatives to report per token, at most
    /// [`MAX_TOP_N_LOGPROBS`]; 0 for none.
    pub top_n_logprobs: usize,
}

impl SamplingParams {
    /// Argmax decoding with every filter off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
            top_n_logprobs: 0,
        }
    }

    /// Whether the token is the argmax, so no random draw is made.
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE_EPS || self.top_k == 1
    }

    /// Checks every field against its limits. Errors name the field, the limit and the given value.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid(
                "temperature",
                "must be a finite number >= 0",
                self.temperature,
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", "must be in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(invalid(
                "repetition_penalty",
                "must be a finite number > 0",
                self.repetition_penalty,
            ));
        }
        if self.top_n_logprobs > MAX_TOP_N_LOGPROBS {
            return Err(invalid(
                "top_n_logprobs",
                format!("must be at most {MAX_TOP_N_LOGPROBS}"),
                self.top_n_logprobs,
            ));
        }
        Ok(())
    }
}

fn invalid(field: &'static str, reason: impl Into<String>, given: impl ToString) -> EngineError {
    EngineError::InvalidParameter {
        field,
        reason: reason.into(),
        given: given.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(params: &SamplingParams) -> (&'static str, String) {
        match params.validate() {
            Err(EngineError::InvalidParameter { field, given, .. }) => (field, given),
            other => panic!("expected InvalidParameter, got {other:?}"),
        }
    }

    #[test]
    fn greedy_is_valid_and_greedy() {
        let params = SamplingParams::greedy();
        params.validate().unwrap();
        assert!(params.is_greedy());
    }

    #[test]
    fn typical_sampling_is_valid() {
        let params = SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.95,
            repetition_penalty: 1.1,
            seed: 1,
            top_n_logprobs: 20,
        };
        params.validate().unwrap();
        assert!(!params.is_greedy());
    }

    #[test]
    fn top_k_one_is_greedy() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..SamplingParams::greedy()
        };
        assert!(params.is_greedy());
    }

    #[test]
    fn each_bad_field_is_named_with_its_value() {
        let base = SamplingParams::greedy();
        let cases = [
            (
                SamplingParams {
                    temperature: -0.5,
                    ..base.clone()
                },
                "temperature",
                "-0.5",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..base.clone()
                },
                "temperature",
                "inf",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..base.clone()
                },
                "temperature",
                "NaN",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..base.clone()
                },
                "top_p",
                "0",
            ),
            (
                SamplingParams {
                    top_p: 1.5,
                    ..base.clone()
                },
                "top_p",
                "1.5",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..base.clone()
                },
                "repetition_penalty",
                "0",
            ),
            (
                SamplingParams {
                    top_n_logprobs: 21,
                    ..base.clone()
                },
                "top_n_logprobs",
                "21",
            ),
        ];
        for (params, field, given) in cases {
            assert_eq!(field_of(&params), (field, given.to_string()));
        }
    }

    #[test]
    fn message_names_the_limit() {
        let params = SamplingParams {
            top_n_logprobs: 50,
            ..SamplingParams::greedy()
        };
        let message = params.validate().unwrap_err().to_string();
        assert_eq!(
            message,
            "invalid parameter top_n_logprobs: must be at most 20 (given 50)"
        );
    }

    #[test]
    fn serde_round_trip() {
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.2,
            seed: 1234,
            top_n_logprobs: 3,
        };
        let json = serde_json::to_string(&params).unwrap();
        assert_eq!(
            serde_json::from_str::<SamplingParams>(&json).unwrap(),
            params
        );
    }
}
