//! The library's entry point: a whole run as the command line asks for it. Warm-up, one level
//! or a rate sweep, then the report, the JSON and the plots.

use std::time::Instant;

use crate::client::Client;
use crate::config::{LoadConfig, LoadShape};
use crate::driver::{run_level, LevelRun};
use crate::error::LoadError;
use crate::levels::{level_seed, write_outputs, PlanWalk};
use crate::progress::Progress;
use crate::report::{LevelReport, RunReport};
use crate::summary::LevelSummary;

/// Runs `config` against its target and returns the report, having written the JSON and the
/// plots when asked. Every level is bounded (see [`crate::config::Bounds`]), and a sweep has
/// at most [`crate::sweep::MAX_SWEEP_RATES`] scanned rates plus its bisection steps, so a run
/// always ends by itself.
pub async fn run(config: &LoadConfig) -> Result<RunReport, LoadError> {
    config.bounds.validate()?;
    config.workload.lengths()?;
    if config.slo.ttft_ms <= 0.0 || config.slo.tpot_ms <= 0.0 {
        return Err(LoadError::invalid(
            "slo",
            "both SLOs must be above 0 ms",
            format!("{:?}", config.slo),
        ));
    }
    let mut target = config.target.clone();
    let probe = Client::new(target.clone(), config.bounds.request_timeout)?;
    if target.api.is_openai() && target.model.is_none() {
        target.model = probe.discover_model().await;
    }
    let client = Client::new(target.clone(), config.bounds.request_timeout)?;
    warm_up(&client, config).await?;

    let progress = Progress::new(config.quiet);
    let mut walk = PlanWalk::new(&config.plan);
    while let Some((shape, index)) = walk.next_level() {
        walk.record(level(&client, config, shape, index, &progress).await?);
    }
    let (levels, sweep) = walk.finish();
    let report = RunReport {
        config: config.clone(),
        model: target.model,
        levels,
        sweep,
        simulated: None,
    };
    write_outputs(&report, config)?;
    Ok(report)
}

async fn level(
    client: &Client,
    config: &LoadConfig,
    shape: LoadShape,
    index: u64,
    progress: &Progress,
) -> Result<LevelReport, LoadError> {
    let seed = level_seed(config.seed, index);
    let bar = progress.level(&shape.label(), config.bounds.duration);
    let LevelRun {
        shape,
        mut records,
        send_window_s,
        wall_s,
    } = run_level(client, &config.workload, shape, &config.bounds, seed, &bar).await?;
    bar.finish();
    records.sort_by_key(|r| r.index);
    Ok(LevelReport {
        summary: LevelSummary::new(shape, &records, send_window_s, wall_s, &config.slo),
        requests: records,
    })
}

/// Sends the warm-up requests one at a time; the run stops if one fails, since a target that
/// cannot answer one request would only fill the report with errors.
async fn warm_up(client: &Client, config: &LoadConfig) -> Result<(), LoadError> {
    let mut sampler = config.workload.sampler(config.seed ^ 0x3a3a_3a3a)?;
    let start = Instant::now();
    for index in 0..config.warmup_requests {
        let r = client.send(&sampler.next_request(), start).await;
        if let Some(e) = r.error {
            return Err(LoadError::Warmup {
                index,
                reason: e.label(),
            });
        }
    }
    Ok(())
}
