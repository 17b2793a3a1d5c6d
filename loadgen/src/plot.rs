//! SVG plots of a run, drawn with plotters' SVG backend alone: no fonts or system libraries
//! are needed (text is left to the SVG viewer), so the crate builds anywhere.
//!
//! - `ttft_cdf.svg`, `tpot_cdf.svg`, `e2e_cdf.svg`: latency CDFs, one line per level, with the
//!   SLO as a vertical line where there is one;
//! - `attainment_vs_rate.svg`: SLO attainment against rate, with the 90% target;
//! - `goodput_vs_rate.svg`: throughput and good requests/s against rate;
//! - `ttft_vs_rate.svg`, `tpot_vs_rate.svg`: p50 and p90 against rate, with the SLO;
//! - for `simulate plan`, [`gpu_plot`]: goodput against the GPU count.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::error::LoadError;
use crate::goodput::ATTAINMENT_TARGET;
use crate::report::{LevelReport, RunReport};
use crate::stats::{cdf, Distribution};

const SIZE: (u32, u32) = (900, 560);

/// matplotlib's tab10: distinct on white, none of them the black of the SLO lines.
const COLORS: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// Writes every plot into `dir` (created if missing) and returns their paths.
pub fn write_plots(report: &RunReport, dir: &Path) -> Result<Vec<PathBuf>, LoadError> {
    std::fs::create_dir_all(dir).map_err(|source| LoadError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let slo = report.config.slo;
    let levels = &report.levels;
    let mut by_rate: Vec<&LevelReport> = levels.iter().collect();
    by_rate.sort_by(|a, b| a.summary.rate_rps().total_cmp(&b.summary.rate_rps()));

    let mut written = Vec::new();
    let mut out = |name: &str| {
        let p = dir.join(name);
        written.push(p.clone());
        p
    };
    latency_cdf(
        &out("ttft_cdf.svg"),
        "TTFT CDF",
        levels,
        Some(slo.ttft_ms),
        |r| r.ttft_s,
    )?;
    latency_cdf(
        &out("tpot_cdf.svg"),
        "TPOT CDF",
        levels,
        Some(slo.tpot_ms),
        |r| r.tpot_s(),
    )?;
    latency_cdf(
        &out("e2e_cdf.svg"),
        "End-to-end latency CDF",
        levels,
        None,
        |r| Some(r.e2e_s),
    )?;
    let rate = |l: &&LevelReport| l.summary.rate_rps();
    let attainment: Vec<(f64, f64)> = by_rate
        .iter()
        .map(|l| (rate(l), l.summary.slo_attainment * 100.0))
        .collect();
    RatePlot {
        title: "SLO attainment against rate",
        x_desc: RATE,
        y_desc: "requests meeting both SLOs (%)",
        series: vec![("attainment", attainment)],
        reference: Some(ATTAINMENT_TARGET * 100.0),
        // Attainment starts high at low rates: the legend goes where the curve ends.
        legend_at: SeriesLabelPosition::LowerLeft,
    }
    .draw(&out("attainment_vs_rate.svg"))?;
    let series = |f: &dyn Fn(&LevelReport) -> f64| -> Vec<(f64, f64)> {
        by_rate.iter().map(|l| (rate(l), f(l))).collect()
    };
    RatePlot {
        title: "Throughput and goodput against rate",
        x_desc: RATE,
        y_desc: "requests/s",
        series: vec![
            ("offered", series(&|l: &LevelReport| l.summary.offered_rps)),
            (
                "completed",
                series(&|l: &LevelReport| l.summary.throughput_rps),
            ),
            (
                "good (within SLO)",
                series(&|l: &LevelReport| l.summary.good_rps),
            ),
        ],
        reference: None,
        legend_at: SeriesLabelPosition::UpperLeft,
    }
    .draw(&out("goodput_vs_rate.svg"))?;
    let pct = |d: fn(&LevelReport) -> &Distribution, p90: bool| -> Vec<(f64, f64)> {
        by_rate
            .iter()
            .filter_map(|l| {
                let dist = d(l);
                let v = if p90 { dist.p90 } else { dist.p50 };
                v.map(|v| (rate(l), v))
            })
            .collect()
    };
    RatePlot {
        title: "TTFT against rate",
        x_desc: RATE,
        y_desc: "TTFT (ms)",
        series: vec![("p50", pct(ttft_of, false)), ("p90", pct(ttft_of, true))],
        reference: Some(slo.ttft_ms),
        legend_at: SeriesLabelPosition::UpperLeft,
    }
    .draw(&out("ttft_vs_rate.svg"))?;
    RatePlot {
        title: "TPOT against rate",
        x_desc: RATE,
        y_desc: "TPOT (ms)",
        series: vec![("p50", pct(tpot_of, false)), ("p90", pct(tpot_of, true))],
        reference: Some(slo.tpot_ms),
        legend_at: SeriesLabelPosition::UpperLeft,
    }
    .draw(&out("tpot_vs_rate.svg"))?;
    Ok(written)
}

const RATE: &str = "request rate (req/s)";

/// Lines against the number of GPUs (the simulator's plans).
pub fn gpu_plot(
    path: &Path,
    title: &'static str,
    y_desc: &'static str,
    series: Vec<(&'static str, Vec<(f64, f64)>)>,
) -> Result<(), LoadError> {
    RatePlot {
        title,
        x_desc: "GPUs",
        y_desc,
        series,
        reference: None,
        legend_at: SeriesLabelPosition::LowerRight,
    }
    .draw(path)
}

fn ttft_of(l: &LevelReport) -> &Distribution {
    &l.summary.ttft_ms
}

fn tpot_of(l: &LevelReport) -> &Distribution {
    &l.summary.tpot_ms
}

fn plot_err(path: &Path) -> impl Fn(String) -> LoadError + '_ {
    move |message| LoadError::Plot {
        path: path.to_path_buf(),
        message,
    }
}

/// An axis top with some headroom; 1 when there is nothing to show.
fn top(max: f64) -> f64 {
    if max.is_finite() && max > 0.0 {
        max * 1.08
    } else {
        1.0
    }
}

fn latency_cdf(
    path: &Path,
    title: &str,
    levels: &[LevelReport],
    slo_ms: Option<f64>,
    metric: impl Fn(&crate::record::RequestRecord) -> Option<f64>,
) -> Result<(), LoadError> {
    let err = plot_err(path);
    let curves: Vec<(String, Vec<(f64, f64)>)> = levels
        .iter()
        .map(|l| {
            let ms: Vec<f64> = l
                .requests
                .iter()
                .filter(|r| r.ok())
                .filter_map(&metric)
                .map(|s| s * 1e3)
                .collect();
            (l.summary.label.clone(), cdf(&ms))
        })
        .collect();
    // A log axis: one overloaded level's seconds would squash the others' milliseconds.
    let values = || {
        curves
            .iter()
            .flat_map(|(_, c)| c.iter().map(|p| p.0))
            .chain(slo_ms)
            .filter(|v| *v > 0.0)
    };
    let max = values().fold(0.0, f64::max);
    let min = values().fold(f64::INFINITY, f64::min);
    let (lo, hi) = if min.is_finite() && max > min {
        (min * 0.8, max * 1.25)
    } else {
        (0.1, 1000.0)
    };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("milliseconds (log scale)")
        .y_desc("fraction of successful requests")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (label, points)) in curves.into_iter().enumerate() {
        let color = color(i);
        // A CDF is a step function: each sample lifts the curve at its value.
        let mut steps = Vec::with_capacity(points.len() * 2 + 1);
        let mut prev = 0.0;
        for (x, y) in points.into_iter().filter(|p| p.0 > 0.0) {
            steps.push((x, prev));
            steps.push((x, y));
            prev = y;
        }
        chart
            .draw_series(LineSeries::new(steps, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
    }
    if let Some(slo) = slo_ms {
        chart
            .draw_series(LineSeries::new(
                vec![(slo, 0.0), (slo, 1.0)],
                BLACK.stroke_width(1),
            ))
            .map_err(|e| err(e.to_string()))?
            .label(format!("SLO {slo} ms"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

/// Lines against the request rate, with an optional horizontal reference (an SLO, a target).
struct RatePlot {
    title: &'static str,
    x_desc: &'static str,
    y_desc: &'static str,
    series: Vec<(&'static str, Vec<(f64, f64)>)>,
    reference: Option<f64>,
    legend_at: SeriesLabelPosition,
}

impl RatePlot {
    fn draw(self, path: &Path) -> Result<(), LoadError> {
        let RatePlot {
            title,
            x_desc,
            y_desc,
            series,
            reference,
            legend_at,
        } = self;
        let err = plot_err(path);
        let points = series.iter().flat_map(|(_, s)| s.iter());
        let (x_max, y_max) = points.fold((0.0f64, 0.0f64), |(x, y), p| (x.max(p.0), y.max(p.1)));
        let y_max = y_max.max(reference.unwrap_or(0.0));
        let root = SVGBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..top(x_max), 0.0..top(y_max))
            .map_err(|e| err(e.to_string()))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        for (i, (label, s)) in series.iter().enumerate() {
            let color = color(i);
            chart
                .draw_series(LineSeries::new(s.clone(), color.stroke_width(2)))
                .map_err(|e| err(e.to_string()))?
                .label(*label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            chart
                .draw_series(PointSeries::of_element(
                    s.clone(),
                    4,
                    color.filled(),
                    &|c, size, style| EmptyElement::at(c) + Circle::new((0, 0), size, style),
                ))
                .map_err(|e| err(e.to_string()))?;
        }
        if let Some(r) = reference {
            chart
                .draw_series(LineSeries::new(
                    vec![(0.0, r), (top(x_max), r)],
                    BLACK.stroke_width(1),
                ))
                .map_err(|e| err(e.to_string()))?
                .label(format!("target {r}"))
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        }
        chart
            .configure_series_labels()
            .position(legend_at)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(e.to_string()))?;
        root.present().map_err(|e| err(e.to_string()))
    }
}
