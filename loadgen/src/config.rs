//! What a run is told: the target, the load, the bounds and where the results go. `main.rs`
//! fills these from the command line; tests fill them directly.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::error::LoadError;
use crate::goodput::Slo;
use crate::sweep::SweepSpec;
use crate::workload::WorkloadConfig;

/// The streaming API the target speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `POST /v1/completions` with `stream: true` (Fission, llama-server, vLLM).
    OpenaiCompletions,
    /// `POST /v1/chat/completions` with `stream: true`.
    OpenaiChat,
    /// TGI's `POST /generate_stream`.
    Tgi,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::OpenaiCompletions => "/v1/completions",
            Api::OpenaiChat => "/v1/chat/completions",
            Api::Tgi => "/generate_stream",
        }
    }

    pub fn is_openai(self) -> bool {
        matches!(self, Api::OpenaiCompletions | Api::OpenaiChat)
    }
}

/// Where the load goes. Requests go to `base_url` + the API's path and nowhere else: the
/// client follows no redirects and uses no proxy.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub base_url: String,
    pub api: Api,
    /// The `model` field of OpenAI requests; `None` asks `GET /v1/models` once and takes the
    /// first id (servers such as vLLM refuse requests without it), or omits the field.
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer ...`; never written to the report.
    #[serde(skip)]
    pub api_key: Option<String>,
}

impl Target {
    pub fn endpoint(&self) -> String {
        format!("{}{}", self.base_url.trim_end_matches('/'), self.api.path())
    }
}

/// How requests arrive at one load level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum LoadShape {
    /// Open loop: arrivals at `rate_rps` on average, whatever the server's pace. `burstiness`
    /// is the gamma shape of the inter-arrival times (1.0 is Poisson; below 1 burstier).
    Open { rate_rps: f64, burstiness: f64 },
    /// Closed loop: `concurrency` clients, each sending its next request when its last ends.
    Closed { concurrency: usize },
}

impl LoadShape {
    pub fn label(&self) -> String {
        match self {
            LoadShape::Open { rate_rps, .. } => format!("{rate_rps:.3} req/s"),
            LoadShape::Closed { concurrency } => format!("concurrency {concurrency}"),
        }
    }
}

/// The hard limits of one load level. A level sends no request after `duration` or after
/// `max_requests`, and each request is cut at `request_timeout`, so a level ends by
/// `duration + request_timeout` at the latest.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Bounds {
    #[serde(serialize_with = "as_secs")]
    pub duration: Duration,
    pub max_requests: usize,
    #[serde(serialize_with = "as_secs")]
    pub request_timeout: Duration,
}

impl Bounds {
    pub fn validate(&self) -> Result<(), LoadError> {
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(LoadError::invalid(
                "duration",
                format!("must be above 0 and at most {} s", MAX_DURATION.as_secs()),
                format!("{:?}", self.duration),
            ));
        }
        if self.max_requests == 0 || self.max_requests > MAX_REQUESTS {
            return Err(LoadError::invalid(
                "max_requests",
                format!("must be between 1 and {MAX_REQUESTS}"),
                self.max_requests,
            ));
        }
        if self.request_timeout.is_zero() {
            return Err(LoadError::invalid("request_timeout", "must be above 0", 0));
        }
        Ok(())
    }
}

/// No level runs longer than an hour or sends more than a million requests: a typo in a flag
/// must not turn into an unbounded flood.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
pub const MAX_REQUESTS: usize = 1_000_000;

fn as_secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// One level, or a rate sweep that looks for the highest rate meeting the SLOs.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadPlan {
    Single(LoadShape),
    Sweep {
        rates: SweepSpec,
        burstiness: f64,
        /// Extra levels between the last rate that met the SLOs and the first that did not.
        bisect_steps: usize,
    },
}

#[derive(Debug, Clone, Serialize)]
pub struct LoadConfig {
    pub target: Target,
    pub plan: LoadPlan,
    pub workload: WorkloadConfig,
    pub bounds: Bounds,
    pub slo: Slo,
    /// Seeds the arrivals and the workload, so two runs send the same requests at the same times.
    pub seed: u64,
    /// Requests sent one at a time before the first level and not measured (they warm caches
    /// and code paths).
    pub warmup_requests: usize,
    pub json_path: Option<PathBuf>,
    pub plot_dir: Option<PathBuf>,
    /// No progress bar.
    pub quiet: bool,
}

/// `20s`, `500ms`, `2m`, `1h`, or a bare number of seconds (`20`, `0.5`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (try 20s, 500ms, 2m)"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        other => return Err(format!("unknown unit `{other}` in `{s}` (ms, s, m, h)")),
    };
    let secs = value * scale;
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("`{s}` is not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("20s"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("20"), Ok(Duration::from_secs(20)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("0.5s"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5d").is_err());
    }

    #[test]
    fn bounds_refuse_unbounded_levels() {
        let ok = Bounds {
            duration: Duration::from_secs(10),
            max_requests: 100,
            request_timeout: Duration::from_secs(5),
        };
        assert!(ok.validate().is_ok());
        assert!(Bounds {
            max_requests: 0,
            ..ok
        }
        .validate()
        .is_err());
        assert!(Bounds {
            duration: Duration::ZERO,
            ..ok
        }
        .validate()
        .is_err());
        assert!(Bounds {
            duration: Duration::from_secs(7200),
            ..ok
        }
        .validate()
        .is_err());
    }
}
