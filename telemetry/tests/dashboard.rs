//! The Grafana dashboard (deploy/observability) against what Fission exports: every metric it
//! reads is one a component defines, renders through [`telemetry::prometheus_builder`] into an
//! exposition that passes `promtool check metrics` (syntax and naming lint), and every query
//! parses as PromQL (`promtool check rules`).
//!
//! The promtool checks need promtool (Debian's `prometheus` package):
//! `./deploy/install-test-tools.sh`. Without it they print why and pass, unless
//! `FISSION_REQUIRE_TEST_TOOLS=1`.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// The crates that define metrics; a dashboard name found nowhere in them is exported by no one.
const COMPONENTS: [&str; 7] = [
    "gateway",
    "prefill-node",
    "decode-node",
    "kvtransfer",
    "node-common",
    "engine",
    "cluster",
];

fn workspace() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Every query of the dashboard, as `(panel title, refId, expr)`.
fn queries() -> anyhow::Result<Vec<(String, String, String)>> {
    let path = workspace().join("deploy/observability/grafana/dashboards/fission.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let dashboard: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().context("panels")? {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push((
                panel["title"].as_str().unwrap_or_default().to_owned(),
                target["refId"].as_str().unwrap_or_default().to_owned(),
                target["expr"]
                    .as_str()
                    .context("a target's expr")?
                    .to_owned(),
            ));
        }
    }
    anyhow::ensure!(!queries.is_empty(), "no queries in {}", path.display());
    Ok(queries)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The metrics the queries read, with the kind their use implies: `_bucket` series are a
/// histogram's, `_total` a counter's, anything else a gauge.
fn dashboard_metrics() -> anyhow::Result<BTreeMap<String, Kind>> {
    let mut metrics = BTreeMap::new();
    for (_, _, expr) in queries()? {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("fission_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            let (base, kind) = match name.strip_suffix("_bucket") {
                Some(base) => (base.to_owned(), Kind::Histogram),
                None => match name
                    .strip_suffix("_count")
                    .or_else(|| name.strip_suffix("_sum"))
                {
                    Some(base) => (base.to_owned(), Kind::Histogram),
                    None if name.ends_with("_total") => (name, Kind::Counter),
                    None => (name, Kind::Gauge),
                },
            };
            metrics.insert(base, kind);
        }
    }
    Ok(metrics)
}

fn rust_sources(dir: &Path, out: &mut Vec<String>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_sources(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(std::fs::read_to_string(&path)?);
        }
    }
    Ok(())
}

#[test]
fn dashboard_metrics_are_exported_by_a_component() -> anyhow::Result<()> {
    let mut sources = Vec::new();
    for component in COMPONENTS {
        rust_sources(&workspace().join(component).join("src"), &mut sources)?;
    }
    let metrics = dashboard_metrics()?;
    let missing: Vec<&String> = metrics
        .keys()
        .filter(|name| {
            let quoted = format!("\"{name}\"");
            !sources.iter().any(|s| s.contains(&quoted))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "the dashboard reads metrics no component defines: {missing:?}"
    );
    println!("{} dashboard metrics, all defined", metrics.len());
    Ok(())
}

#[test]
fn dashboard_metric_names_pass_promtool() -> anyhow::Result<()> {
    let metrics = dashboard_metrics()?;
    let recorder = telemetry::prometheus_builder()?.build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        for (name, kind) in &metrics {
            let name = name.clone();
            match kind {
                Kind::Histogram => {
                    metrics::describe_histogram!(name.clone(), "test");
                    metrics::histogram!(name).record(0.5);
                }
                Kind::Counter => {
                    metrics::describe_counter!(name.clone(), "test");
                    metrics::counter!(name, "error_type" => "validation").increment(1);
                }
                Kind::Gauge => {
                    metrics::describe_gauge!(name.clone(), "test");
                    metrics::gauge!(name).set(3.0);
                }
            }
        }
    });
    let text = handle.render();
    for (name, kind) in &metrics {
        if *kind == Kind::Histogram {
            // Histograms, not summaries: the dashboard's quantiles read `_bucket`.
            assert!(text.contains(&format!("{name}_bucket")), "{name}:\n{text}");
        }
    }
    if let Some(report) = testkit::promtool::check(&text)? {
        eprintln!("promtool: clean {report}");
    }
    Ok(())
}

#[test]
fn dashboard_queries_pass_promtool() -> anyhow::Result<()> {
    let mut rules = String::from("groups:\n  - name: fission_dashboard\n    rules:\n");
    for (i, (title, ref_id, expr)) in queries()?.iter().enumerate() {
        // Grafana's interval variables, as Grafana would fill them in.
        let expr = expr
            .replace("$__rate_interval", "1m")
            .replace("$__interval", "15s");
        // YAML takes JSON strings as they are.
        rules.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n        labels:\n          panel: {}\n",
            serde_json::to_string(&expr)?,
            serde_json::to_string(&format!("{title} {ref_id}"))?
        ));
    }
    let path = std::env::temp_dir().join(format!("fission-dashboard-{}.yml", std::process::id()));
    std::fs::write(&path, &rules)?;
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&path)
        .output();
    let _ = std::fs::remove_file(&path);
    let out = match out {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let msg = "promtool is not installed: install it with ./deploy/install-test-tools.sh";
            if testkit::phoenix::tools_required() {
                bail!("{msg} (FISSION_REQUIRE_TEST_TOOLS is set)");
            }
            eprintln!("\n*** SKIPPED: {msg} ***\n");
            return Ok(());
        }
        Err(e) => return Err(e).context("starting promtool"),
    };
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!(
            "promtool check rules ({}):\n{report}\n--- rules ---\n{rules}",
            out.status
        );
    }
    eprintln!("promtool: {report}");
    Ok(())
}
