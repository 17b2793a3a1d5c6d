//! What one request measured. A failed request is a measurement too: it counts against the
//! SLO attainment, and its kind of failure is reported.

use serde::Serialize;

/// Why a request failed, as the report groups failures.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ErrorKind {
    /// The server answered with a non-2xx status.
    Http { status: u16 },
    /// The stream carried an error event; `error_type` is the server's (`overloaded`, ...).
    SseError { error_type: String },
    /// The request ran past the per-request timeout.
    Timeout,
    /// No connection could be made.
    Connect,
    /// The connection broke mid-request.
    Transport,
    /// The stream ended without its end marker (`[DONE]`, a `finish_reason`, TGI's
    /// `generated_text`).
    Incomplete,
    /// An event the client could not parse.
    Malformed,
}

impl ErrorKind {
    /// A short label for tables and JSON keys: `http_429`, `sse_overloaded`, `timeout`, ...
    pub fn label(&self) -> String {
        match self {
            ErrorKind::Http { status } => format!("http_{status}"),
            ErrorKind::SseError { error_type } => format!("sse_{error_type}"),
            ErrorKind::Timeout => "timeout".into(),
            ErrorKind::Connect => "connect".into(),
            ErrorKind::Transport => "transport".into(),
            ErrorKind::Incomplete => "incomplete".into(),
            ErrorKind::Malformed => "malformed".into(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub index: u64,
    /// When it was sent, from the start of its level.
    pub sent_at_s: f64,
    /// Prompt tokens asked for, and as the server counted them when it said.
    pub input_len: usize,
    pub prompt_tokens: Option<usize>,
    /// Tokens asked for (`max_tokens`) and received.
    pub output_len: usize,
    pub output_tokens: usize,
    /// Time to the first token-bearing event; `None` when none came.
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    /// Gaps between successive token-bearing events. A server that puts several tokens in
    /// one event gives fewer, longer gaps; TPOT, from the token count, is not affected.
    #[serde(skip)]
    pub itl_s: Vec<f64>,
    pub error: Option<ErrorKind>,
}

impl RequestRecord {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Time per output token after the first: `(e2e - ttft) / (tokens - 1)`; `None` with
    /// fewer than two tokens.
    pub fn tpot_s(&self) -> Option<f64> {
        let ttft = self.ttft_s?;
        (self.output_tokens > 1).then(|| (self.e2e_s - ttft) / (self.output_tokens - 1) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(tokens: usize) -> RequestRecord {
        RequestRecord {
            index: 0,
            sent_at_s: 0.0,
            input_len: 8,
            prompt_tokens: None,
            output_len: tokens,
            output_tokens: tokens,
            ttft_s: Some(0.1),
            e2e_s: 0.5,
            itl_s: Vec::new(),
            error: None,
        }
    }

    #[test]
    fn tpot_spreads_the_time_after_the_first_token() {
        let tpot = record(5).tpot_s().expect("5 tokens");
        assert!((tpot - 0.1).abs() < 1e-12);
        assert_eq!(record(1).tpot_s(), None);
    }

    #[test]
    fn labels_name_the_failure() {
        assert_eq!(ErrorKind::Http { status: 429 }.label(), "http_429");
        let sse = ErrorKind::SseError {
            error_type: "overloaded".into(),
        };
        assert_eq!(sse.label(), "sse_overloaded");
        assert_eq!(ErrorKind::Timeout.label(), "timeout");
    }
}
