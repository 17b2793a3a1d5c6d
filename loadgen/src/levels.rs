//! The levels a [`LoadPlan`] asks for, one at a time: its single level, or the sweep's rates
//! as the search picks them. A real run and the simulator walk the same plan through this, so
//! one configuration means the same levels, in the same order and with the same seeds, to both;
//! and both end in the same files.

use crate::config::{LoadConfig, LoadPlan, LoadShape};
use crate::error::LoadError;
use crate::report::{LevelReport, RunReport};
use crate::sweep::{SweepResult, SweepSearch};

/// The seed of level `index` of a run seeded `run_seed`. Each level draws its own prompts:
/// with one seed for all, a later level would find the earlier one's prompts in the server's
/// prefix cache.
pub fn level_seed(run_seed: u64, index: u64) -> u64 {
    run_seed.wrapping_add(index.wrapping_mul(0x1000_0000_0000_0001))
}

/// Ask [`Self::next_level`], run that level, [`Self::record`] it; [`Self::finish`] once the
/// plan has no level left.
pub struct PlanWalk {
    single: Option<LoadShape>,
    sweep: Option<(SweepSearch, f64)>,
    /// The rate the sweep asked for the level being run: what the search records.
    asked_rps: Option<f64>,
    levels: Vec<LevelReport>,
}

impl PlanWalk {
    pub fn new(plan: &LoadPlan) -> Self {
        let (single, sweep) = match plan {
            LoadPlan::Single(shape) => (Some(*shape), None),
            LoadPlan::Sweep {
                rates,
                burstiness,
                bisect_steps,
            } => (
                None,
                Some((SweepSearch::new(rates, *bisect_steps), *burstiness)),
            ),
        };
        PlanWalk {
            single,
            sweep,
            asked_rps: None,
            levels: Vec::new(),
        }
    }

    /// The next level's shape and index (for [`level_seed`]); `None` when the plan is done.
    pub fn next_level(&mut self) -> Option<(LoadShape, u64)> {
        let index = self.levels.len() as u64;
        if let Some(shape) = self.single.take() {
            return Some((shape, index));
        }
        let (search, burstiness) = self.sweep.as_ref()?;
        let rate_rps = search.next_rate()?;
        self.asked_rps = Some(rate_rps);
        let shape = LoadShape::Open {
            rate_rps,
            burstiness: *burstiness,
        };
        Some((shape, index))
    }

    pub fn record(&mut self, level: LevelReport) {
        if let (Some((search, _)), Some(rate_rps)) = (self.sweep.as_mut(), self.asked_rps.take()) {
            search.record(rate_rps, level.summary.slo_attainment);
        }
        self.levels.push(level);
    }

    /// The levels, a sweep's by rate, and the sweep's result.
    pub fn finish(mut self) -> (Vec<LevelReport>, Option<SweepResult>) {
        let sweep = self.sweep.map(|(search, _)| search.result());
        if sweep.is_some() {
            self.levels
                .sort_by(|a, b| a.summary.rate_rps().total_cmp(&b.summary.rate_rps()));
        }
        (self.levels, sweep)
    }
}

/// Writes the JSON and the plots `config` asks for.
pub fn write_outputs(report: &RunReport, config: &LoadConfig) -> Result<(), LoadError> {
    if let Some(path) = &config.json_path {
        report.write_json(path)?;
    }
    if let Some(dir) = &config.plot_dir {
        crate::plot::write_plots(report, dir)?;
    }
    Ok(())
}
