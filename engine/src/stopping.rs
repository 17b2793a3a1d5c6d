//! When a sequence stops generating: a length limit, a stop token, or a stop string.
//!
//! Token checks happen here, once per generated token. Stop strings need the decoded text, so they
//! are matched by [`crate::detokenize::StopStringStream`]; this module only validates them.

use std::fmt;

use crate::error::{EngineError, Result};

/// The most stop strings a request may give.
pub const MAX_STOP_STRINGS: usize = 8;

/// Why a sequence finished, as reported to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` were generated.
    Length,
    /// A stop token (usually the tokenizer's EOS) was generated.
    Eos,
    /// A stop string appeared in the output.
    Stop,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Eos => "eos",
            Self::Stop => "stop",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request's stopping conditions. Check with [`StoppingCriteria::validate`] before use.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct StoppingCriteria {
    /// At least 1.
    pub max_new_tokens: usize,
    /// Tokens that end the sequence, usually the tokenizer's EOS ids. The stop token is part of
    /// the output ids but decodes to nothing when special tokens are skipped.
    pub stop_token_ids: Vec<u32>,
    /// At most [`MAX_STOP_STRINGS`], none empty. Matched on the decoded text; the stop string
    /// itself is not returned.
    pub stop_strings: Vec<String>,
    /// Keep generating through stop tokens, up to `max_new_tokens` (for benchmarks).
    pub ignore_eos: bool,
}

impl StoppingCriteria {
    /// Checks the limits. Errors name the field, the limit and the given value.
    pub fn validate(&self) -> Result<()> {
        if self.max_new_tokens == 0 {
            return Err(EngineError::InvalidParameter {
                field: "max_new_tokens",
                reason: "must be at least 1".into(),
                given: self.max_new_tokens.to_string(),
            });
        }
        if self.stop_strings.len() > MAX_STOP_STRINGS {
            return Err(EngineError::InvalidParameter {
                field: "stop_strings",
                reason: format!("at most {MAX_STOP_STRINGS} stop strings are allowed"),
                given: format!("{} stop strings", self.stop_strings.len()),
            });
        }
        if let Some(index) = self.stop_strings.iter().position(String::is_empty) {
            return Err(EngineError::InvalidParameter {
                field: "stop_strings",
                reason: format!("stop string {index} must not be empty"),
                given: format!("{:?}", self.stop_strings),
            });
        }
        Ok(())
    }

    /// Whether the sequence finishes with `token_id`, its `num_generated`-th generated token (so
    /// 1 for the first). A stop token wins over the length limit when both apply.
    pub fn check_token(&self, token_id: u32, num_generated: usize) -> Option<FinishReason> {
        if !self.ignore_eos && self.stop_token_ids.contains(&token_id) {
            Some(FinishReason::Eos)
        } else if num_generated >= self.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn criteria(max_new_tokens: usize) -> StoppingCriteria {
        StoppingCriteria {
            max_new_tokens,
            stop_token_ids: vec![2],
            ..StoppingCriteria::default()
        }
    }

    #[test]
    fn eos_stops_unless_ignored() {
        let mut c = criteria(10);
        assert_eq!(c.check_token(2, 1), Some(FinishReason::Eos));
        assert_eq!(c.check_token(5, 1), None);
        c.ignore_eos = true;
        assert_eq!(c.check_token(2, 1), None);
        assert_eq!(c.check_token(2, 10), Some(FinishReason::Length));
    }

    #[test]
    fn length_stops_at_the_limit() {
        let c = criteria(3);
        assert_eq!(c.check_token(7, 2), None);
        assert_eq!(c.check_token(7, 3), Some(FinishReason::Length));
        // EOS on the last allowed token reports EOS.
        assert_eq!(c.check_token(2, 3), Some(FinishReason::Eos));
    }

    #[test]
    fn finish_reason_names() {
        for (reason, name) in [
            (FinishReason::Length, "length"),
            (FinishReason::Eos, "eos"),
            (FinishReason::Stop, "stop"),
        ] {
            assert_eq!(reason.as_str(), name);
            assert_eq!(reason.to_string(), name);
            assert_eq!(
                serde_json::to_string(&reason).unwrap(),
                format!("\"{name}\"")
            );
        }
    }

    #[test]
    fn validate_limits() {
        criteria(1).validate().unwrap();
        let message = criteria(0).validate().unwrap_err().to_string();
        assert_eq!(
            message,
            "invalid parameter max_new_tokens: must be at least 1 (given 0)"
        );

        let mut many = criteria(5);
        many.stop_strings = (0..9).map(|i| i.to_string()).collect();
        assert!(matches!(
            many.validate(),
            Err(EngineError::InvalidParameter {
                field: "stop_strings",
                ..
            })
        ));
        many.stop_strings.truncate(8);
        many.validate().unwrap();

        let mut empty = criteria(5);
        empty.stop_strings = vec!["end".into(), String::new()];
        let message = empty.validate().unwrap_err().to_string();
        assert!(
            message.contains("stop string 1 must not be empty"),
            "{message}"
        );
    }
}
