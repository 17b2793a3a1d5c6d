//! A real OTLP trace backend for tests: Arize Phoenix (`phoenix serve`, from PyPI) on free
//! ports, in its own working directory, killed when dropped.
//!
//! Phoenix takes OTLP over gRPC on `PHOENIX_GRPC_PORT` and serves its REST API on
//! `PHOENIX_PORT`; spans are read back from `GET /v1/projects/{project}/spans`. It files spans
//! under the project named by the resource attribute `openinference.project.name` (the
//! `telemetry` crate sets it to the service name), else under `default`.
//!
//! Install it with `./deploy/install-test-tools.sh` (into `.peers/phoenix-venv`, or
//! `FISSION_PHOENIX_VENV`). Tests skip with a loud message when it is absent, unless
//! `FISSION_REQUIRE_TEST_TOOLS=1` makes that a failure (CI sets it).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::wait::try_wait_until;

const INSTALL_HINT: &str =
    "install it with ./deploy/install-test-tools.sh (or point FISSION_PHOENIX_VENV at a venv with arize-phoenix)";
/// Phoenix's start-up (database migrations included) takes about 25 s on two cores.
const READY_TIMEOUT: Duration = Duration::from_secs(180);

/// One span as Phoenix's REST API returns it.
#[derive(Clone, Debug)]
pub struct PhoenixSpan {
    pub name: String,
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub span_id: String,
    pub parent_id: Option<String>,
    pub attributes: serde_json::Value,
    pub events: Vec<serde_json::Value>,
    /// The whole JSON object, for fields not lifted out above.
    pub raw: serde_json::Value,
}

/// A running `phoenix serve`. Dropping it kills the process and removes its working directory.
pub struct Phoenix {
    child: Child,
    http_addr: String,
    grpc_port: u16,
    work_dir: PathBuf,
}

/// The venv `./deploy/install-test-tools.sh` fills: `FISSION_PHOENIX_VENV`, or
/// `<workspace>/.peers/phoenix-venv`.
pub fn venv_dir() -> PathBuf {
    std::env::var_os("FISSION_PHOENIX_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../.peers/phoenix-venv"
            ))
        })
}

/// Whether a missing test tool must fail the test instead of skipping it.
pub fn tools_required() -> bool {
    std::env::var("FISSION_REQUIRE_TEST_TOOLS").is_ok_and(|v| v == "1" || v == "true")
}

impl Phoenix {
    /// Starts Phoenix and waits until its REST API answers and its gRPC port accepts. Returns
    /// `Ok(None)` after printing why when Phoenix is not installed (an error instead when
    /// [`tools_required`]).
    pub fn start() -> anyhow::Result<Option<Self>> {
        Self::start_with_grpc_port(None)
    }

    fn bin() -> PathBuf {
        venv_dir().join("bin").join("phoenix")
    }

    /// Whether Phoenix is installed. When it is not, prints why and returns `false`, or fails
    /// when [`tools_required`].
    pub fn installed_or_skip() -> anyhow::Result<bool> {
        let bin = Self::bin();
        if bin.is_file() {
            return Ok(true);
        }
        let msg = format!(
            "Arize Phoenix is not installed at {}: {INSTALL_HINT}",
            bin.display()
        );
        if tools_required() {
            bail!("{msg} (FISSION_REQUIRE_TEST_TOOLS is set)");
        }
        eprintln!("\n*** SKIPPED: {msg} ***\n");
        Ok(false)
    }

    /// [`Phoenix::start`] with OTLP/gRPC on `grpc_port` (a free one when `None`): for tests
    /// whose exporter already points at the port before the collector exists.
    pub fn start_with_grpc_port(grpc_port: Option<u16>) -> anyhow::Result<Option<Self>> {
        if !Self::installed_or_skip()? {
            return Ok(None);
        }
        let bin = Self::bin();
        let work_dir = std::env::temp_dir().join(format!(
            "fission-phoenix-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::create_dir_all(&work_dir)
            .with_context(|| format!("creating {}", work_dir.display()))?;
        let log = std::fs::File::create(work_dir.join("phoenix.log"))?;
        let http_port = ports::free_port().context("picking a port")?;
        let grpc_port = match grpc_port {
            Some(port) => port,
            None => ports::free_port().context("picking a port")?,
        };
        let child = Command::new(&bin)
            .arg("serve")
            .env("PHOENIX_WORKING_DIR", &work_dir)
            .env("PHOENIX_HOST", "127.0.0.1")
            .env("PHOENIX_PORT", http_port.to_string())
            .env("PHOENIX_GRPC_PORT", grpc_port.to_string())
            // No phoning home from a test machine.
            .env("PHOENIX_TELEMETRY_ENABLED", "false")
            .env_remove("PHOENIX_SQL_DATABASE_URL")
            .env_remove("PHOENIX_COLLECTOR_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} serve", bin.display()))?;
        let mut phoenix = Phoenix {
            child,
            http_addr: format!("127.0.0.1:{http_port}"),
            grpc_port,
            work_dir,
        };
        phoenix.wait_ready()?;
        Ok(Some(phoenix))
    }

    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let mut exited = None;
        let ready = try_wait_until("phoenix to answer", READY_TIMEOUT, || {
            exited = self.child.try_wait().ok().flatten();
            let http_ok = matches!(http_get(&self.http_addr, "/v1/projects"), Ok((200, _)));
            let grpc_ok = TcpStream::connect(("127.0.0.1", self.grpc_port)).is_ok();
            exited.is_some() || (http_ok && grpc_ok)
        });
        if let Some(status) = exited {
            bail!(
                "phoenix exited ({status}) before it was ready:\n{}",
                self.log_tail()
            );
        }
        ready.map_err(|e| anyhow::anyhow!("{e}:\n{}", self.log_tail()))?;
        Ok(())
    }

    /// The last lines of Phoenix's output, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.work_dir.join("phoenix.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The OTLP/gRPC endpoint to export to, e.g. `http://127.0.0.1:4317`.
    pub fn otlp_grpc_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// `host:port` of the REST API and UI.
    pub fn http_addr(&self) -> &str {
        &self.http_addr
    }

    /// Every span of `project` (empty when the project does not exist yet).
    pub fn spans(&self, project: &str) -> anyhow::Result<Vec<PhoenixSpan>> {
        let mut spans = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path = format!("/v1/projects/{project}/spans?limit=1000");
            if let Some(c) = &cursor {
                path.push_str("&cursor=");
                for ch in c.chars() {
                    match ch {
                        'A'..='Z' | 'a'..='z' | '0'..='9' | '-' | '_' | '.' | '~' => path.push(ch),
                        _ => {
                            let mut b = [0u8; 4];
                            for byte in ch.encode_utf8(&mut b).bytes() {
                                path.push_str(&format!("%{byte:02X}"));
                            }
                        }
                    }
                }
            }
            let (status, body) = http_get(&self.http_addr, &path)?;
            match status {
                200 => {}
                404 => return Ok(spans),
                _ => bail!("GET {path}: HTTP {status}: {body}"),
            }
            let json: serde_json::Value =
                serde_json::from_str(&body).with_context(|| format!("GET {path}: {body}"))?;
            for raw in json["data"].as_array().into_iter().flatten() {
                spans.push(parse_span(raw).with_context(|| format!("span {raw}"))?);
            }
            match json["next_cursor"].as_str() {
                Some(c) if !c.is_empty() => cursor = Some(c.to_owned()),
                _ => return Ok(spans),
            }
        }
    }

    /// Polls [`spans`](Self::spans) until `done` accepts them, or fails after `timeout` with
    /// what arrived.
    pub fn wait_for_spans(
        &self,
        project: &str,
        timeout: Duration,
        done: impl Fn(&[PhoenixSpan]) -> bool,
    ) -> anyhow::Result<Vec<PhoenixSpan>> {
        let mut spans = Vec::new();
        let mut error = None;
        let arrived = try_wait_until("the spans to arrive", timeout, || {
            match self.spans(project) {
                Ok(s) => spans = s,
                Err(e) => error = Some(e),
            }
            error.is_some() || done(&spans)
        });
        if let Some(e) = error {
            return Err(e);
        }
        if arrived.is_err() {
            let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
            bail!(
                "project {project}: spans still incomplete after {} s: {names:?}\nphoenix log:\n{}",
                timeout.as_secs(),
                self.log_tail()
            );
        }
        Ok(spans)
    }
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

fn parse_span(raw: &serde_json::Value) -> anyhow::Result<PhoenixSpan> {
    let text = |v: &serde_json::Value, what: &str| -> anyhow::Result<String> {
        v.as_str()
            .map(str::to_owned)
            .with_context(|| format!("no {what}"))
    };
    Ok(PhoenixSpan {
        name: text(&raw["name"], "name")?,
        trace_id: text(&raw["context"]["trace_id"], "context.trace_id")?,
        span_id: text(&raw["context"]["span_id"], "context.span_id")?,
        parent_id: raw["parent_id"].as_str().map(str::to_owned),
        attributes: raw["attributes"].clone(),
        events: raw["events"].as_array().cloned().unwrap_or_default(),
        raw: raw.clone(),
    })
}

/// A minimal HTTP/1.0 GET (no chunked bodies), enough for Phoenix's REST API.
fn http_get(addr: &str, path: &str) -> anyhow::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: application/json\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status line")?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}
