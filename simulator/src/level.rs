//! Simulated load levels and sweeps, reported exactly as the load generator reports real
//! ones: the same arrival schedules ([`loadgen::arrival`]), the same requests
//! ([`loadgen::workload`]), the same per-level seeds, summaries, sweep search, Markdown, JSON
//! and plots. A simulation with the seed of a real run serves the requests that run sent, at
//! the times it sent them.

use std::time::Instant;

use serde::Serialize;

use crate::cluster::SimCluster;
use crate::simulate::{simulate, LevelLimits, SimOutcome, SimRequest};
use loadgen::arrival::Arrivals;
use loadgen::config::{Bounds, LoadConfig, LoadShape};
use loadgen::error::LoadError;
use loadgen::goodput::Slo;
use loadgen::levels::{level_seed, write_outputs, PlanWalk};
use loadgen::report::{LevelReport, RunReport};
use loadgen::summary::LevelSummary;
use loadgen::workload::WorkloadConfig;

/// The requests of one open-loop level, as the load generator would send them.
pub fn level_requests(
    workload: &WorkloadConfig,
    rate_rps: f64,
    burstiness: f64,
    bounds: &Bounds,
    seed: u64,
) -> Result<Vec<SimRequest>, LoadError> {
    let mut sampler = workload.sampler(seed)?;
    let schedule =
        Arrivals::new(rate_rps, burstiness, seed)?.schedule(bounds.duration, bounds.max_requests);
    Ok(schedule
        .into_iter()
        .map(|at| SimRequest {
            plan: sampler.next_plan(),
            arrival_s: at.as_secs_f64(),
        })
        .collect())
}

/// One simulated level and what it cost to simulate.
#[derive(Debug, Clone)]
pub struct SimLevel {
    pub report: LevelReport,
    pub stopped_early: bool,
    pub steps: u64,
    /// Real seconds the simulation took.
    pub elapsed_s: f64,
}

/// Simulates one open-loop level. With `stop_when_missed`, a level that cannot meet the SLO
/// stops early and its summary is only good for its attainment.
pub fn simulate_level(
    cluster: &SimCluster,
    workload: &WorkloadConfig,
    shape: LoadShape,
    bounds: &Bounds,
    slo: &Slo,
    seed: u64,
    stop_when_missed: bool,
) -> Result<SimLevel, LoadError> {
    bounds.validate()?;
    let LoadShape::Open {
        rate_rps,
        burstiness,
    } = shape
    else {
        return Err(LoadError::invalid(
            "load",
            "the simulator runs open-loop levels (--rate or --sweep)",
            shape.label(),
        ));
    };
    let started = Instant::now();
    let requests = level_requests(workload, rate_rps, burstiness, bounds, seed)?;
    let limits = LevelLimits {
        request_timeout_s: bounds.request_timeout.as_secs_f64(),
        stop_when_missed: stop_when_missed.then_some(*slo),
    };
    let SimOutcome {
        records,
        stopped_early,
        steps,
        ..
    } = simulate(cluster, &requests, limits);
    // As the load generator counts it: the send window is the level's duration unless
    // `max_requests` cut the schedule short; the wall time runs to the last answer.
    let send_window_s = if requests.len() >= bounds.max_requests {
        requests.last().map_or(0.0, |r| r.arrival_s)
    } else {
        bounds.duration.as_secs_f64()
    };
    let last_answer_s = records
        .iter()
        .map(|r| r.sent_at_s + r.e2e_s)
        .fold(0.0, f64::max);
    let wall_s = last_answer_s.max(send_window_s);
    let summary = LevelSummary::new(shape, &records, send_window_s, wall_s, slo);
    Ok(SimLevel {
        report: LevelReport {
            summary,
            requests: records,
        },
        stopped_early,
        steps,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

/// Simulation cost of a whole run, for the budget the README reports.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct SimCost {
    pub levels: usize,
    pub requests: usize,
    pub steps: u64,
    pub elapsed_s: f64,
}

/// A whole `simulate` run: one level or a sweep, as `config.plan` says, reported like a real
/// run of the same configuration (its target is ignored).
pub fn simulate_run(
    cluster: &SimCluster,
    config: &LoadConfig,
) -> Result<(RunReport, SimCost), LoadError> {
    config.bounds.validate()?;
    config.workload.lengths()?;
    let mut cost = SimCost::default();
    let mut walk = PlanWalk::new(&config.plan);
    while let Some((shape, index)) = walk.next_level() {
        let l = simulate_level(
            cluster,
            &config.workload,
            shape,
            &config.bounds,
            &config.slo,
            level_seed(config.seed, index),
            false,
        )?;
        cost.levels += 1;
        cost.requests += l.report.requests.len();
        cost.steps += l.steps;
        cost.elapsed_s += l.elapsed_s;
        walk.record(l.report);
    }
    let (levels, sweep) = walk.finish();
    let report = RunReport {
        config: config.clone(),
        model: Some(cluster.cost.model.name.clone()),
        levels,
        sweep,
        simulated: Some(cluster.label()),
    };
    write_outputs(&report, config)?;
    Ok((report, cost))
}
