//! Charts as PNG files, drawn with `plotters`: [`line_chart`], [`histogram`], [`interval_chart`], and
//! [`draw_panels`] for a row of line panels (the demo's `personalization.png`).
//!
//! Text needs a TrueType font: DejaVu Sans (Debian package `fonts-dejavu-core`, installed by
//! `scripts/setup.sh`) is loaded once with `ab_glyph` from [`FONT_PATHS`]. Without it the charts are
//! drawn without any text (no title, tick labels or legend) and [`font_loaded`] is false; the reports
//! say so.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::{config_err, input_err, Error, Result};

/// One named line of a chart: (legend name, points (x, y)).
pub type NamedSeries = (String, Vec<(f64, f64)>);

/// Where the plot font is looked for, in order (DejaVu Sans on Debian, Arch and Fedora).
pub const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
];

/// The font family name the plot font is registered under (only our own text uses it).
const FAMILY: &str = "nextstate-sans";

/// Colour-blind-safe palette (Okabe–Ito), one colour per series in order.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(153, 153, 153),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Loads the plot font on first call (the first readable file of [`FONT_PATHS`] that `ab_glyph` parses);
/// true when charts can draw text.
pub fn font_loaded() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        FONT_PATHS.iter().any(|p| match std::fs::read(p) {
            // plotters keeps fonts for the life of the process and needs 'static bytes: leaked once.
            Ok(bytes) => plotters::style::register_font(FAMILY, FontStyle::Normal, Box::leak(bytes.into_boxed_slice())).is_ok(),
            Err(_) => false,
        })
    })
}

/// A tick label: integers without a fraction, other values with up to 3 decimals (trailing zeros cut).
fn tick(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("plot {}: {e}", path.display()))
}

/// Axis range covering `values` with 5% padding; `[v − 1, v + 1]` for a single value, `[0, 1]` for none.
fn padded_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 {
        return (lo - 1.0, hi + 1.0);
    }
    let pad = 0.05 * (hi - lo);
    (lo - pad, hi + pad)
}

/// Every coordinate of `series` is finite.
///
/// # Errors
/// [`Error::InvalidInput`] naming the series and the point that is not.
pub fn check_finite(series: &[NamedSeries]) -> Result<()> {
    for (name, pts) in series {
        if let Some(i) = pts.iter().position(|(x, y)| !x.is_finite() || !y.is_finite()) {
            return Err(input_err!("series {name:?}: point {i} is not finite ({:?})", pts[i]));
        }
    }
    Ok(())
}

/// One panel of a multi-panel line chart ([`draw_panels`]): its text, its series and how its axes are drawn.
pub struct Panel<'a> {
    /// Panel title.
    pub title: &'a str,
    /// x axis label (name and unit).
    pub x_label: &'a str,
    /// y axis label (name and unit).
    pub y_label: &'a str,
    /// The lines, one colour each in order.
    pub series: &'a [NamedSeries],
    /// Fixed y range (rates: 0–1); `None` = from the data.
    pub y_range: Option<(f64, f64)>,
    /// Text drawn next to each point of the first series (policy versions).
    pub point_labels: Option<&'a [String]>,
    /// Integer tick labels on x (counts).
    pub x_integer: bool,
    /// Vertical error bars `(low, high)` at each point of the first series (95 % intervals), same order.
    pub error_bars: Option<&'a [(f64, f64)]>,
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel, text: bool) -> std::result::Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let (x0, x1) = padded_range(p.series.iter().flat_map(|(_, s)| s.iter().map(|(x, _)| *x)));
    let (y0, y1) = p.y_range.unwrap_or_else(|| padded_range(p.series.iter().flat_map(|(_, s)| s.iter().map(|(_, y)| *y))));
    let mut builder = ChartBuilder::on(area);
    builder.margin(16);
    if text {
        builder.caption(p.title, (FAMILY, 22)).x_label_area_size(48).y_label_area_size(64);
    } else {
        builder.x_label_area_size(8).y_label_area_size(8);
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y0..y1).map_err(|x| e(&x))?;
    let x_fmt = |v: &f64| if p.x_integer { format!("{}", v.round() as i64) } else { tick(*v) };
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(235, 235, 235));
    if text {
        mesh.x_desc(p.x_label)
            .y_desc(p.y_label)
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 16))
            .x_label_formatter(&x_fmt)
            .y_label_formatter(&|v: &f64| tick(*v));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|x| e(&x))?;
    for (i, (name, pts)) in p.series.iter().enumerate() {
        let c = color(i);
        let style = c.stroke_width(3);
        let line = chart.draw_series(LineSeries::new(pts.iter().copied(), style)).map_err(|x| e(&x))?;
        if text {
            line.label(name.as_str()).legend(move |(x, y)| {
                EmptyElement::at((x, y)) + PathElement::new(vec![(-6, 0), (14, 0)], c.stroke_width(3)) + Circle::new((4, 0), 4, c.filled())
            });
        }
        chart.draw_series(pts.iter().map(|&pt| Circle::new(pt, 5, c.filled()))).map_err(|x| e(&x))?;
        if let (0, Some(bars)) = (i, p.error_bars) {
            chart
                .draw_series(pts.iter().zip(bars).map(|(&(x, y), &(lo, hi))| ErrorBar::new_vertical(x, lo, y, hi, c.stroke_width(2), 10)))
                .map_err(|x| e(&x))?;
        }
        if text && i == 0 {
            if let Some(labels) = p.point_labels {
                chart
                    .draw_series(pts.iter().zip(labels).map(|(&pt, l)| {
                        EmptyElement::at(pt) + Text::new(l.clone(), (10, -22), (FAMILY, 14).into_font().color(&c))
                    }))
                    .map_err(|x| e(&x))?;
            }
        }
    }
    if text && !p.series.is_empty() {
        chart
            .configure_series_labels()
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(|x| e(&x))?;
    }
    Ok(())
}

/// The panels side by side (one row, equal widths) on a white PNG of `size` pixels (width, height) at
/// `path`. `text` false draws no text at all (no font is needed then; see [`font_loaded`]). Series
/// are assumed finite ([`check_finite`]).
///
/// # Errors
/// [`Error::Internal`] naming the file when drawing or writing fails.
pub fn draw_panels(path: &Path, size: (u32, u32), panels: &[Panel], text: bool) -> Result<()> {
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|x| plot_err(path, x))?;
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (area, p) in areas.iter().zip(panels) {
        draw_panel(area, p, text).map_err(|x| plot_err(path, x))?;
    }
    root.present().map_err(|x| plot_err(path, x))
}

/// A line chart with one line (with circle markers) per series and a legend, written as a PNG of
/// 1000×600 pixels. Axis ranges cover the data with 5% padding. Text needs the plot font
/// ([`font_loaded`]); without it the chart has no text.
///
/// # Errors
/// [`Error::InvalidInput`] naming the series and point when a coordinate is not finite;
/// [`Error::Internal`] naming the file when drawing or writing fails.
pub fn line_chart(path: impl AsRef<Path>, title: &str, x_label: &str, y_label: &str, series: &[NamedSeries]) -> Result<()> {
    check_finite(series)?;
    let panel = Panel { title, x_label, y_label, series, y_range: None, point_labels: None, x_integer: false, error_bars: None };
    draw_panels(path.as_ref(), (1000, 600), &[panel], font_loaded())
}

/// One column of an [`interval_chart`]: a label, an estimate with its interval, and the values it
/// summarises (e.g. an arm's mean score over seeds with its 95 % interval and the per-seed scores).
#[derive(Debug, Clone, PartialEq)]
pub struct IntervalItem {
    /// Column label (x axis).
    pub label: String,
    /// The estimate (filled circle).
    pub estimate: f64,
    /// Interval `(low, high)` (vertical error bar); `None` draws none.
    pub interval: Option<(f64, f64)>,
    /// The individual values (small hollow circles).
    pub values: Vec<f64>,
}

/// One column per item: the estimate, its error bar and the individual values, y in `y_range`, PNG of
/// 1000×600 pixels; labels under the columns. Text needs the plot font ([`font_loaded`]).
///
/// # Errors
/// [`Error::InvalidInput`] naming the item when a value is not finite; [`Error::Internal`] naming the
/// file when drawing or writing fails.
pub fn interval_chart(path: impl AsRef<Path>, title: &str, y_label: &str, items: &[IntervalItem], y_range: (f64, f64)) -> Result<()> {
    let path = path.as_ref();
    for it in items {
        let bad = !it.estimate.is_finite() || it.values.iter().any(|v| !v.is_finite()) || it.interval.is_some_and(|(l, h)| !l.is_finite() || !h.is_finite());
        if bad {
            return Err(input_err!("interval chart item {:?}: a value is not finite", it.label));
        }
    }
    let text = font_loaded();
    let draw = || -> std::result::Result<(), String> {
        let e = |x: &dyn std::fmt::Display| x.to_string();
        let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let n = items.len().max(1) as f64;
        let mut builder = ChartBuilder::on(&root);
        builder.margin(16);
        if text {
            builder.caption(title, (FAMILY, 22)).x_label_area_size(48).y_label_area_size(64);
        }
        let mut chart = builder.build_cartesian_2d(-0.5..n - 0.5, y_range.0..y_range.1).map_err(|x| e(&x))?;
        let label = |v: &f64| {
            let k = v.round();
            if (v - k).abs() < 1e-6 && k >= 0.0 {
                items.get(k as usize).map(|i| i.label.clone()).unwrap_or_default()
            } else {
                String::new()
            }
        };
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(RGBColor(235, 235, 235)).disable_x_mesh();
        if text {
            mesh.y_desc(y_label).label_style((FAMILY, 14)).axis_desc_style((FAMILY, 16)).x_labels(items.len().max(1) * 2 + 1).x_label_formatter(&label).y_label_formatter(&|v: &f64| tick(*v));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|x| e(&x))?;
        for (i, it) in items.iter().enumerate() {
            let (x, c) = (i as f64, color(i));
            if let Some((lo, hi)) = it.interval {
                chart.draw_series(std::iter::once(ErrorBar::new_vertical(x, lo, it.estimate, hi, c.stroke_width(2), 16))).map_err(|x| e(&x))?;
            }
            chart.draw_series(it.values.iter().map(|v| Circle::new((x + 0.12, *v), 4, c.stroke_width(1)))).map_err(|x| e(&x))?;
            chart.draw_series(std::iter::once(Circle::new((x, it.estimate), 6, c.filled()))).map_err(|x| e(&x))?;
        }
        root.present().map_err(|x| e(&x))
    };
    draw().map_err(|x| plot_err(path, x))
}

/// Bin edges: `bins` equal-width bins over the range of all `values` (a single value `v` gets `[v − 0.5,
/// v + 0.5]`), and each series' count per bin (the maximum goes into the last bin).
fn bin_counts(series: &[(String, Vec<f64>)], bins: usize) -> (f64, f64, Vec<Vec<u64>>) {
    let (mut lo, mut hi) = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    } else if hi - lo < 1e-12 {
        (lo, hi) = (lo - 0.5, hi + 0.5);
    }
    let width = (hi - lo) / bins as f64;
    let counts = series
        .iter()
        .map(|(_, vals)| {
            let mut c = vec![0u64; bins];
            for v in vals {
                let b = (((v - lo) / width).floor() as usize).min(bins - 1);
                c[b] += 1;
            }
            c
        })
        .collect();
    (lo, hi, counts)
}

/// A histogram of one or more series over shared bins (`bins` equal-width bins covering all values),
/// drawn as semi-transparent bars per series with a legend; y is the count per bin. PNG of 1000×600
/// pixels. Text needs the plot font ([`font_loaded`]).
///
/// # Errors
/// [`Error::Config`] when `bins` is 0; [`Error::InvalidInput`] naming the series and index when a value
/// is not finite; [`Error::Internal`] naming the file when drawing or writing fails.
pub fn histogram(path: impl AsRef<Path>, title: &str, x_label: &str, series: &[(String, Vec<f64>)], bins: usize) -> Result<()> {
    let path = path.as_ref();
    if bins == 0 {
        return Err(config_err!("histogram {}: bins must be at least 1, got 0", path.display()));
    }
    for (name, vals) in series {
        if let Some(i) = vals.iter().position(|v| !v.is_finite()) {
            return Err(input_err!("series {name:?}: value {i} is not finite ({})", vals[i]));
        }
    }
    let (lo, hi, counts) = bin_counts(series, bins);
    let width = (hi - lo) / bins as f64;
    let ymax = counts.iter().flatten().copied().max().unwrap_or(0).max(1) as f64 * 1.1;
    let text = font_loaded();
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    let draw = || -> std::result::Result<(), String> {
        let e = |x: &dyn std::fmt::Display| x.to_string();
        root.fill(&WHITE).map_err(|x| e(&x))?;
        let mut builder = ChartBuilder::on(&root);
        builder.margin(16);
        if text {
            builder.caption(title, (FAMILY, 22)).x_label_area_size(48).y_label_area_size(64);
        } else {
            builder.x_label_area_size(8).y_label_area_size(8);
        }
        let mut chart = builder.build_cartesian_2d(lo..hi, 0f64..ymax).map_err(|x| e(&x))?;
        let mut mesh = chart.configure_mesh();
        mesh.light_line_style(RGBColor(235, 235, 235));
        if text {
            mesh.x_desc(x_label)
                .y_desc("count (values per bin)")
                .label_style((FAMILY, 14))
                .axis_desc_style((FAMILY, 16))
                .x_label_formatter(&|v: &f64| tick(*v))
                // Counts are integers: ticks between them get no label.
                .y_label_formatter(&|v: &f64| if (v - v.round()).abs() < 1e-9 { tick(*v) } else { String::new() });
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|x| e(&x))?;
        for (i, ((name, _), c)) in series.iter().zip(&counts).enumerate() {
            let col = color(i);
            let bars = c.iter().enumerate().filter(|(_, n)| **n > 0).map(move |(b, n)| {
                let x0 = lo + b as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width, *n as f64)], col.mix(0.4).filled())
            });
            let drawn = chart.draw_series(bars).map_err(|x| e(&x))?;
            if text {
                drawn.label(name.as_str()).legend(move |(x, y)| Rectangle::new([(x - 6, y - 6), (x + 6, y + 6)], col.mix(0.6).filled()));
            }
            let outlines = c.iter().enumerate().filter(|(_, n)| **n > 0).map(move |(b, n)| {
                let x0 = lo + b as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width, *n as f64)], col.stroke_width(1))
            });
            chart.draw_series(outlines).map_err(|x| e(&x))?;
        }
        if text && !series.is_empty() {
            chart
                .configure_series_labels()
                .label_font((FAMILY, 14))
                .background_style(WHITE.mix(0.85))
                .border_style(RGBColor(180, 180, 180))
                .position(SeriesLabelPosition::UpperRight)
                .draw()
                .map_err(|x| e(&x))?;
        }
        root.present().map_err(|x| e(&x))
    };
    draw().map_err(|x| plot_err(path, x))
}

#[cfg(test)]
pub(crate) mod tests;
