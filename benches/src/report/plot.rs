//! Draws a [`Figure`] as SVG and PNG with `plotters`.
//!
//! Both backends lay text out with a TrueType font (the PNG one also
//! draws it): the first of [`FONT_PATHS`] that exists (Debian's
//! `fonts-dejavu-core`, installed by `tools/install-peers.sh`).

use std::error::Error;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::figure::{Figure, Role};

/// Plot size in pixels (SVG user units).
pub const SIZE: (u32, u32) = (900, 560);

/// Width of the legend column right of the plot.
const LEGEND_WIDTH: u32 = 230;

/// A tick label: whole numbers without decimals, others with three
/// significant digits.
fn tick(v: f64) -> String {
    if v == 0.0 {
        "0".to_string()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        let text = crate::report::markdown::number(Some(v));
        if text.contains('.') {
            text.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            text
        }
    }
}

/// The font the plots are laid out and drawn with: one only, so that any
/// machine draws the same plots from the same report.
pub const FONT_PATHS: &[&str] = &["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"];

/// Writes `figure` to `dir/ID.svg` and `dir/ID.png`.
pub fn write(figure: &Figure, dir: &Path) -> Result<(), Box<dyn Error>> {
    register_font()?;
    let svg = dir.join(format!("{}.svg", figure.id));
    draw(figure, SVGBackend::new(&svg, SIZE).into_drawing_area())
        .map_err(|e| format!("{}: {e}", svg.display()))?;
    let png = dir.join(format!("{}.png", figure.id));
    draw(figure, BitMapBackend::new(&png, SIZE).into_drawing_area())
        .map_err(|e| format!("{}: {e}", png.display()))?;
    Ok(())
}

/// Registers the PNG font once; an error names the paths tried.
fn register_font() -> Result<(), Box<dyn Error>> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let (path, bytes) = FONT_PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok().map(|b| (p, b)))
            .ok_or_else(|| {
                format!(
                    "no TrueType font for the PNG plots (tried {}); \
                     install fonts-dejavu-core (tools/install-peers.sh)",
                    FONT_PATHS.join(", ")
                )
            })?;
        // The font lives as long as the program: plotters keeps a
        // `'static` reference to it.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{path} is not a font plotters can read"))
    })
    .clone()
    .map_err(Into::into)
}

/// The range covering every point on one axis, padded a little (and by a
/// factor on a log axis); positive values only on a log axis.
fn bounds(values: impl Iterator<Item = f64>, log: bool) -> Range<f64> {
    let (mut lo, mut hi) = values
        .filter(|v| v.is_finite() && (!log || *v > 0.0))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if !lo.is_finite() {
        (lo, hi) = if log { (1.0, 10.0) } else { (0.0, 1.0) };
    }
    if log {
        lo / 1.25..hi * 1.25
    } else {
        let pad = ((hi - lo) * 0.05).max(hi.abs() * 0.05).max(1e-9);
        let lo = if lo >= 0.0 {
            (lo - pad).max(0.0)
        } else {
            lo - pad
        };
        lo..hi + pad
    }
}

fn draw<DB: DrawingBackend>(
    figure: &Figure,
    area: DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), Box<dyn Error>>
where
    DB::ErrorType: 'static,
{
    let all = || figure.series.iter().flat_map(|s| s.points.iter());
    let x = bounds(all().map(|p| p.0), figure.x.log);
    let y = bounds(all().map(|p| p.1), figure.y.log);
    match (figure.x.log, figure.y.log) {
        (false, false) => chart(figure, &area, x, y),
        (true, false) => chart(figure, &area, x.log_scale(), y),
        (false, true) => chart(figure, &area, x, y.log_scale()),
        (true, true) => chart(figure, &area, x.log_scale(), y.log_scale()),
    }?;
    area.present()?;
    Ok(())
}

/// The colour of the `index`th series of `role` (the peers and limits
/// take turns through their own palettes).
fn colour(role: Role, index: usize) -> RGBColor {
    const OURS: [RGBColor; 4] = [
        RGBColor(31, 90, 180),
        RGBColor(0, 150, 200),
        RGBColor(90, 60, 170),
        RGBColor(0, 110, 110),
    ];
    const PEERS: [RGBColor; 4] = [
        RGBColor(230, 120, 0),
        RGBColor(40, 150, 40),
        RGBColor(180, 40, 140),
        RGBColor(150, 110, 40),
    ];
    const LIMITS: [RGBColor; 3] = [
        RGBColor(90, 90, 90),
        RGBColor(150, 150, 150),
        RGBColor(60, 60, 60),
    ];
    const PAPERS: [RGBColor; 3] = [
        RGBColor(200, 30, 30),
        RGBColor(130, 20, 60),
        RGBColor(230, 90, 60),
    ];
    match role {
        Role::Ours => OURS[index % OURS.len()],
        Role::Peer => PEERS[index % PEERS.len()],
        Role::Limit => LIMITS[index % LIMITS.len()],
        Role::Paper => PAPERS[index % PAPERS.len()],
    }
}

fn chart<DB, X, Y>(
    figure: &Figure,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    x: X,
    y: Y,
) -> Result<(), Box<dyn Error>>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    area.fill(&WHITE)?;
    let (title, subtitle) = (
        figure.title.as_str(),
        format!("reproduces: {}", figure.reproduces),
    );
    let (top, body) = area.split_vertically(48);
    top.draw(&Text::new(title, (12, 6), ("sans-serif", 20).into_font()))?;
    top.draw(&Text::new(
        subtitle.as_str(),
        (12, 28),
        ("sans-serif", 14).into_font().color(&RGBColor(90, 90, 90)),
    ))?;
    let (plot_area, legend_area) = body.split_horizontally(SIZE.0 - LEGEND_WIDTH);
    let mut chart = ChartBuilder::on(&plot_area)
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc(figure.x.label.as_str())
        .y_desc(figure.y.label.as_str())
        .x_label_formatter(&|v| tick(*v))
        .y_label_formatter(&|v| tick(*v))
        .label_style(("sans-serif", 13))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    let mut counts = [0usize; 4];
    let mut legend_y = 16;
    for series in &figure.series {
        let points: Vec<(f64, f64)> = series
            .points
            .iter()
            .copied()
            .filter(|(a, b)| {
                a.is_finite()
                    && b.is_finite()
                    && (!figure.x.log || *a > 0.0)
                    && (!figure.y.log || *b > 0.0)
            })
            .collect();
        if points.is_empty() {
            continue;
        }
        let slot = series.role as usize;
        let colour = colour(series.role, counts[slot]);
        counts[slot] += 1;
        let style = ShapeStyle::from(colour).stroke_width(match series.role {
            Role::Ours => 3,
            _ => 2,
        });
        match series.role {
            Role::Limit | Role::Paper => {
                chart.draw_series(DashedLineSeries::new(points.iter().copied(), 6, 4, style))?;
            }
            Role::Ours | Role::Peer => {
                chart.draw_series(LineSeries::new(points.iter().copied(), style))?;
            }
        }
        let marker = ShapeStyle::from(colour).filled();
        if series.role == Role::Paper {
            chart.draw_series(points.iter().map(|&p| TriangleMarker::new(p, 7, marker)))?;
        } else {
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, marker)))?;
        }
        legend_area.draw(&PathElement::new(
            vec![(4, legend_y), (26, legend_y)],
            style,
        ))?;
        legend_area.draw(&Text::new(
            series.name.as_str(),
            (32, legend_y - 7),
            ("sans-serif", 13).into_font(),
        ))?;
        legend_y += 20;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::figure::{Axis, Series};

    #[test]
    fn every_role_on_log_axes_is_drawn_to_svg_and_png() {
        let figure = Figure {
            id: "roles".into(),
            title: "latency by size".into(),
            reproduces: "a test".into(),
            x: Axis::log("bytes"),
            y: Axis::log("us"),
            series: vec![
                Series::new("pindown", Role::Ours, vec![(8.0, 1.5), (4096.0, 3.0)]),
                Series::new("Open MPI", Role::Peer, vec![(8.0, 0.5), (4096.0, 2.0)]),
                Series::new("memcpy", Role::Limit, vec![(8.0, 0.01), (4096.0, 0.2)]),
                Series::new("paper", Role::Paper, vec![(8.0, 7.0)]),
                Series::new("empty", Role::Peer, vec![]),
            ],
        };
        let dir = tempfile::tempdir().unwrap();
        write(&figure, dir.path()).unwrap();
        let svg = std::fs::read_to_string(dir.path().join("roles.svg")).unwrap();
        for name in ["pindown", "Open MPI", "memcpy", "paper", "latency by size"] {
            assert!(svg.contains(name), "{name} missing from the SVG");
        }
        assert!(
            !svg.contains(">empty<"),
            "an empty series has no legend entry"
        );
        let png = std::fs::read(dir.path().join("roles.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            png.len() > 4096,
            "the PNG has content ({} bytes)",
            png.len()
        );
    }

    #[test]
    fn bounds_cover_the_points_and_keep_log_axes_positive() {
        let r = bounds([0.0, 2.0, 10.0].into_iter(), true);
        assert!(r.start > 0.0 && r.start < 2.0 && r.end > 10.0);
        let r = bounds([3.0, 5.0].into_iter(), false);
        assert!(r.start < 3.0 && r.start >= 0.0 && r.end > 5.0);
        let r = bounds(std::iter::empty(), false);
        assert!(r.start == 0.0 && r.end >= 1.0, "{r:?}");
    }
}
