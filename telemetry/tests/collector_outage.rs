//! A collector that is down when a service starts, and comes up later, gets the service's
//! spans without a restart: a flush into the outage reports its failure in bounded time, and
//! the scheduled export reaches the collector once it is up (after at most one outage pause).
//!
//! Needs Phoenix: `./deploy/install-test-tools.sh`. Without it the test prints why and passes,
//! unless `FISSION_REQUIRE_TEST_TOOLS=1`.

// A test crate: helpers outside `#[test]` functions may unwrap too.
#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use telemetry::TelemetrySettings;
use testkit::phoenix::Phoenix;

#[test]
fn export_resumes_when_the_collector_comes_up() -> anyhow::Result<()> {
    if !Phoenix::installed_or_skip()? {
        return Ok(());
    }
    // A port with no listener yet: the collector is down.
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let service = format!("fission-outage-test-{}", std::process::id());
    let (dispatch, mut guard) = telemetry::build(&TelemetrySettings {
        service_name: service.clone(),
        otlp_endpoint: Some(format!("http://127.0.0.1:{port}")),
        default_filter: "warn".into(),
    })?;

    // Flushed into the outage: the flush is attempted, reports the failure, and returns in
    // bounded time.
    tracing::dispatcher::with_default(&dispatch, || {
        drop(tracing::info_span!("during_outage"));
    });
    let started = Instant::now();
    assert!(
        guard.force_flush().is_err(),
        "a flush into a dead collector must say it failed"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a flush into a dead collector took {:?}",
        started.elapsed()
    );

    let Some(phoenix) = Phoenix::start_with_grpc_port(Some(port))? else {
        return Ok(());
    };
    let up = Instant::now();
    // Keep making spans until one arrives: the ones inside the pause are dropped by design.
    let mut sent = 0;
    let arrived = testkit::wait::try_wait_until(
        "a span to reach the recovered collector",
        Duration::from_secs(60),
        || {
            tracing::dispatcher::with_default(&dispatch, || {
                drop(tracing::info_span!("after_recovery", attempt = sent));
            });
            sent += 1;
            // No flush: the batch processor's own schedule must get through once the outage
            // pause is over.
            let spans = phoenix.spans(&service).unwrap_or_default();
            spans.iter().any(|s| s.name == "after_recovery")
        },
    );
    assert!(
        arrived.is_ok(),
        "no span reached the collector within 60 s of its start ({sent} sent):\n{}",
        phoenix.log_tail()
    );
    eprintln!(
        "export resumed {:?} after the collector came up ({sent} spans sent)",
        up.elapsed()
    );
    guard.shutdown()?;
    Ok(())
}
