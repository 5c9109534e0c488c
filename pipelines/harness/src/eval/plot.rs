//! PNG plots of evaluation results (plotters, bitmap backend).
//!
//! Text needs a TrueType font: `STEAMRF_FONT` names one, else DejaVu Sans
//! (Debian's `fonts-dejavu-core`, installed by scripts/tools.sh) is used.
//! Without a font the evaluation still writes its tables and says the plot
//! was skipped.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use steamrf_pipelines::error::{Error, Result};

const FONT_PATHS: [&str; 2] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// Registers the font once; the error says where it looked.
fn font() -> std::result::Result<(), String> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("STEAMRF_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        let (path, bytes) = candidates
            .iter()
            .find_map(|p| std::fs::read(p).ok().map(|b| (p, b)))
            .ok_or_else(|| {
                format!(
                    "no TrueType font (looked at {}); install fonts-dejavu-core or set STEAMRF_FONT",
                    candidates
                        .iter()
                        .map(|p| p.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
        // plotters keeps registered fonts for the whole process.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{} is not a usable TrueType font", path.display()))
    })
    .clone()
}

fn plot_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: format!("plotting {}: {e}", path.display()),
    }
}

/// One named series of values.
pub(crate) struct Series {
    pub name: String,
    pub values: Vec<f64>,
}

/// A grouped bar chart: one group per label in `groups`, one bar per series
/// in each group. Returns `Ok(None)` (with the reason) when no font exists.
///
/// # Errors
/// The PNG could not be drawn or written.
pub(crate) fn bars(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[&str],
    series: &[Series],
) -> Result<std::result::Result<PathBuf, String>> {
    if let Err(why) = font() {
        return Ok(Err(why));
    }
    let err = |e: &dyn std::fmt::Display| plot_error(path, e);
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.25;
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let bottom = -top * 0.07;
    let n = groups.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .y_label_area_size(60)
        .x_label_area_size(10)
        .build_cartesian_2d(0.0..n, bottom..top)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    let width = 0.8 / series.len().max(1) as f64;
    for (si, s) in series.iter().enumerate() {
        let color = Palette99::pick(si).to_rgba();
        chart
            .draw_series(s.values.iter().enumerate().map(|(g, &v)| {
                let x0 = g as f64 + 0.1 + si as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.92, v)], color.filled())
            }))
            .map_err(|e| err(&e))?
            .label(s.name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart
        .draw_series(groups.iter().enumerate().map(|(g, label)| {
            Text::new(
                (*label).to_owned(),
                (g as f64 + 0.45, bottom * 0.35),
                ("sans-serif", 15),
            )
        }))
        .map_err(|e| err(&e))?;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(Ok(path.to_owned()))
}

/// A line chart of series over shared x values (`xs`); a series with one
/// value is drawn as a horizontal reference line.
///
/// # Errors
/// The PNG could not be drawn or written.
pub(crate) fn lines(
    path: &Path,
    title: &str,
    (x_label, y_label): (&str, &str),
    xs: &[f64],
    series: &[Series],
) -> Result<std::result::Result<PathBuf, String>> {
    if let Err(why) = font() {
        return Ok(Err(why));
    }
    let err = |e: &dyn std::fmt::Display| plot_error(path, e);
    let all = series.iter().flat_map(|s| s.values.iter().copied());
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let pad = ((hi - lo) * 0.15).max(0.01);
    let (x0, x1) = (
        xs.first().copied().unwrap_or(0.0),
        xs.last().copied().unwrap_or(1.0),
    );
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .y_label_area_size(60)
        .x_label_area_size(45)
        .build_cartesian_2d(x0..x1, (lo - pad)..(hi + pad))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| err(&e))?;
    for (si, s) in series.iter().enumerate() {
        let color = Palette99::pick(si).to_rgba();
        let points: Vec<(f64, f64)> = if s.values.len() == 1 {
            vec![(x0, s.values[0]), (x1, s.values[0])]
        } else {
            xs.iter().copied().zip(s.values.iter().copied()).collect()
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(Ok(path.to_owned()))
}

/// "plot in PATH" or "plot skipped: WHY", for the report.
pub(crate) fn said(r: &std::result::Result<PathBuf, String>) -> String {
    match r {
        Ok(p) => format!("plot in {}", p.display()),
        Err(why) => format!("plot skipped: {why}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bar_and_line_charts_are_pngs() {
        let dir = tempfile::tempdir().unwrap();
        let s = vec![
            Series {
                name: "a".into(),
                values: vec![0.1, 0.4, 0.5],
            },
            Series {
                name: "b".into(),
                values: vec![0.2, 0.3, 0.6],
            },
        ];
        let b = bars(
            &dir.path().join("b.png"),
            "bars",
            "NDCG",
            &["@1", "@5", "@10"],
            &s,
        )
        .unwrap();
        let l = lines(
            &dir.path().join("l.png"),
            "lines",
            ("α", "Recall@10"),
            &[0.1, 0.5, 0.9],
            &s,
        )
        .unwrap();
        for r in [b, l] {
            // Where no font is installed the plot is skipped with the reason.
            let Ok(p) = r else {
                assert!(r.unwrap_err().contains("font"));
                continue;
            };
            let bytes = std::fs::read(p).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
            assert!(bytes.len() > 5_000, "{} bytes", bytes.len());
        }
    }
}
