//! Runs one load level: sends requests on the level's schedule (open loop) or as fast as
//! `concurrency` clients allow (closed loop), within the level's bounds, and collects every
//! request's record.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::arrival::Arrivals;
use crate::client::Client;
use crate::config::{Bounds, LoadShape};
use crate::error::LoadError;
use crate::progress::LevelProgress;
use crate::record::RequestRecord;
use crate::workload::{WorkloadConfig, WorkloadSampler};

/// What one level measured.
#[derive(Debug, Clone)]
pub struct LevelRun {
    pub shape: LoadShape,
    pub records: Vec<RequestRecord>,
    pub send_window_s: f64,
    pub wall_s: f64,
}

pub async fn run_level(
    client: &Client,
    workload: &WorkloadConfig,
    shape: LoadShape,
    bounds: &Bounds,
    seed: u64,
    progress: &LevelProgress,
) -> Result<LevelRun, LoadError> {
    bounds.validate()?;
    let sampler = workload.sampler(seed)?;
    let (records, send_window_s, wall_s) = match shape {
        LoadShape::Open {
            rate_rps,
            burstiness,
        } => {
            let schedule = Arrivals::new(rate_rps, burstiness, seed)?
                .schedule(bounds.duration, bounds.max_requests);
            open_loop(client, sampler, &schedule, bounds, progress).await
        }
        LoadShape::Closed { concurrency } => {
            if concurrency == 0 || concurrency > bounds.max_requests {
                return Err(LoadError::invalid(
                    "concurrency",
                    "must be between 1 and max_requests",
                    concurrency,
                ));
            }
            closed_loop(client, sampler, concurrency, bounds, progress).await
        }
    };
    Ok(LevelRun {
        shape,
        records,
        send_window_s,
        wall_s,
    })
}

async fn open_loop(
    client: &Client,
    mut sampler: WorkloadSampler,
    schedule: &[Duration],
    bounds: &Bounds,
    progress: &LevelProgress,
) -> (Vec<RequestRecord>, f64, f64) {
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for at in schedule {
        // The prompt is built before the wait, so building it does not delay the send.
        let spec = sampler.next_request();
        tokio::time::sleep_until((start + *at).into()).await;
        let (client, counter) = (client.clone(), progress.counter());
        counter.sent();
        tasks.spawn(async move {
            let r = client.send(&spec, start).await;
            counter.done(&r);
            r
        });
    }
    // The window is the level's duration unless `max_requests` cut the schedule short.
    let send_window_s = if schedule.len() >= bounds.max_requests {
        schedule.last().map_or(0.0, Duration::as_secs_f64)
    } else {
        bounds.duration.as_secs_f64()
    };
    progress.draining();
    let records = join_all(tasks).await;
    (records, send_window_s, wall_s(start, send_window_s))
}

/// The level's length for throughput: until its last answer, but never shorter than its
/// send window (a level whose answers all came before the window closed still lasted it).
fn wall_s(start: Instant, send_window_s: f64) -> f64 {
    start.elapsed().as_secs_f64().max(send_window_s)
}

async fn closed_loop(
    client: &Client,
    sampler: WorkloadSampler,
    concurrency: usize,
    bounds: &Bounds,
    progress: &LevelProgress,
) -> (Vec<RequestRecord>, f64, f64) {
    let start = Instant::now();
    let deadline = start + bounds.duration;
    let sampler = Arc::new(Mutex::new(sampler));
    let issued = Arc::new(AtomicUsize::new(0));
    let last_send = Arc::new(Mutex::new(Duration::ZERO));
    let mut workers = JoinSet::new();
    for _ in 0..concurrency {
        let (client, counter) = (client.clone(), progress.counter());
        let (sampler, issued, last_send) = (sampler.clone(), issued.clone(), last_send.clone());
        let max_requests = bounds.max_requests;
        workers.spawn(async move {
            let mut records = Vec::new();
            // Bounded by the deadline and by the shared request count.
            while Instant::now() < deadline && issued.fetch_add(1, Ordering::Relaxed) < max_requests
            {
                let spec = match sampler.lock() {
                    Ok(mut s) => s.next_request(),
                    Err(poisoned) => poisoned.into_inner().next_request(),
                };
                if let Ok(mut t) = last_send.lock() {
                    *t = (*t).max(start.elapsed());
                }
                counter.sent();
                let r = client.send(&spec, start).await;
                counter.done(&r);
                records.push(r);
            }
            records
        });
    }
    let per_worker = join_all(workers).await;
    progress.draining();
    let records: Vec<RequestRecord> = per_worker.into_iter().flatten().collect();
    let last = last_send.lock().map(|t| *t).unwrap_or(bounds.duration);
    let send_window_s = if records.len() >= bounds.max_requests {
        last.as_secs_f64()
    } else {
        bounds.duration.as_secs_f64()
    };
    (records, send_window_s, wall_s(start, send_window_s))
}

/// Every task's result; a task that panicked re-raises its panic here (it is a bug, not a
/// measurement).
async fn join_all<T: 'static>(mut tasks: JoinSet<T>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    while let Some(res) = tasks.join_next().await {
        match res {
            Ok(v) => out.push(v),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => {}
        }
    }
    out
}
