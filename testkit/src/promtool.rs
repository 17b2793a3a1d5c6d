//! `promtool check metrics` (Debian's `prometheus` package) over an exposition text: syntax
//! and Prometheus' naming lint.

use std::io::Write;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

/// Checks `text`; `Ok(None)` (after printing why) when promtool is not installed and
/// [`crate::phoenix::tools_required`] is not set. Any finding is an error naming it.
pub fn check(text: &str) -> anyhow::Result<Option<String>> {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let msg = "promtool is not installed: install it with ./deploy/install-test-tools.sh (Debian package `prometheus`)";
            if crate::phoenix::tools_required() {
                bail!("{msg} (FISSION_REQUIRE_TEST_TOOLS is set)");
            }
            eprintln!("\n*** SKIPPED: {msg} ***\n");
            return Ok(None);
        }
        Err(e) => return Err(e).context("starting promtool"),
    };
    child
        .stdin
        .take()
        .context("promtool stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || !report.trim().is_empty() {
        bail!(
            "promtool check metrics ({}):\n{report}\n--- exposition ---\n{text}",
            out.status
        );
    }
    Ok(Some(report))
}
