//! `steamrf eval …`: the papers' evaluation protocols on their data, through
//! steamrf's own operators. Each command prints a report ending with one
//! `RESULT key=value …` line and writes a markdown table to `--out`.

mod datasets;
mod locomo;
mod passages;
mod plot;
pub mod pyjson;
mod recommenders;
mod rfmem;
mod simulate;
mod steam;
mod task;

use std::path::{Path, PathBuf};

pub use locomo::{LocomoEval, locomo};
pub use rfmem::{RfMemEval, rfmem};
use steamrf_pipelines::error::{Error, Result};
pub use task::{Geometry, Scoring, SteamEval};

/// Runs the evaluation (`e.task`: ranking, simulation or diversity).
///
/// # Errors
/// Missing data or embedding failures.
pub async fn steam(e: SteamEval) -> Result<Vec<String>> {
    if e.fit_only && e.task != "ranking" {
        return Err(Error::Config {
            problems: vec![format!(
                "--fit-only: only the ranking task has a fused ranker to fit (got --task {})",
                e.task
            )],
        });
    }
    match e.task.as_str() {
        "ranking" => steam::ranking(e).await,
        "simulation" => simulate::simulation(e).await,
        "diversity" => simulate::diversity(e).await,
        other => Err(datasets::bad(format!(
            "unknown task {other:?} (ranking, simulation, diversity)"
        ))),
    }
}

/// A progress bar on stderr for a long loop (drawn only on a terminal).
pub(crate) fn progress(len: usize, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(len as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg:24} [{bar:40}] {pos}/{len} {elapsed} (eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(what.to_owned());
    bar
}

/// Writes a result table to `dir/name` (creating `dir`) and returns its path.
///
/// # Errors
/// I/O failures.
pub(crate) fn write_table(dir: &Path, name: &str, table: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        context: format!("creating {}", dir.display()),
        source,
    })?;
    let file = dir.join(name);
    std::fs::write(&file, table).map_err(|source| Error::Io {
        context: format!("writing {}", file.display()),
        source,
    })?;
    Ok(file)
}

/// `f` of each element of `work`, each on its own thread, in order: the
/// seeds of a task are independent, and building a seed's STEAM states is
/// single-threaded. The first error (or a panic, as an error) is returned.
pub(crate) fn on_threads<T: Sync, R: Send>(
    work: &[T],
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = work.iter().map(|w| scope.spawn(move || f(w))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Internal {
                        message: "an evaluation thread panicked".to_owned(),
                    })
                })
            })
            .collect()
    })
}

/// Resamples of a percentile bootstrap.
pub(crate) const BOOTSTRAP_RESAMPLES: usize = 1000;

/// The mean of `xs` and its 95% confidence interval: a percentile bootstrap
/// over the units (users) with [`BOOTSTRAP_RESAMPLES`] resamples drawn with
/// `seed`. Pass per-unit differences of two methods for the paired interval
/// of their difference (the same resample applies to both).
pub(crate) fn bootstrap_ci(xs: &[f64], seed: u64) -> (f64, f64, f64) {
    use rand::{Rng, SeedableRng};
    let n = xs.len();
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n as f64;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut means: Vec<f64> = (0..BOOTSTRAP_RESAMPLES)
        .map(|_| (0..n).map(|_| xs[rng.random_range(0..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let at = |q: f64| means[((q * (BOOTSTRAP_RESAMPLES - 1) as f64).round()) as usize];
    (mean, at(0.025), at(0.975))
}

#[cfg(test)]
mod tests {
    #[test]
    fn work_on_threads_comes_back_in_order_and_errors_are_returned() {
        let squares = super::on_threads(&[1u64, 2, 3, 4], |&x| Ok(x * x)).unwrap();
        assert_eq!(squares, [1, 4, 9, 16]);
        let failed = super::on_threads(&[1u64, 2], |&x| {
            if x == 2 {
                Err(super::Error::Internal {
                    message: "two".to_owned(),
                })
            } else {
                Ok(x)
            }
        });
        assert!(failed.is_err());
        let panicked = super::on_threads(&[1u64], |_| -> super::Result<u64> { panic!("boom") });
        assert!(panicked.unwrap_err().to_string().contains("panicked"));
    }

    #[test]
    fn bootstrap_intervals_cover_the_mean_and_shrink_with_more_units() {
        let small: Vec<f64> = (0..20).map(|i| f64::from(i % 2)).collect();
        let large: Vec<f64> = (0..2000).map(|i| f64::from(i % 2)).collect();
        let (m, lo, hi) = super::bootstrap_ci(&small, 1);
        assert!((m - 0.5).abs() < 1e-12 && lo < m && m < hi, "{lo} {m} {hi}");
        let (m2, lo2, hi2) = super::bootstrap_ci(&large, 1);
        assert!(lo2 < m2 && m2 < hi2 && hi2 - lo2 < (hi - lo) / 5.0);
        // About ±1.96 standard errors: 0.5 / sqrt(2000) * 1.96 = 0.022.
        assert!((hi2 - lo2 - 0.044).abs() < 0.01, "{lo2} {hi2}");
        let (m, lo, hi) = super::bootstrap_ci(&[0.25; 7], 1);
        assert!((m - 0.25).abs() < 1e-12 && (lo - 0.25).abs() < 1e-12 && (hi - 0.25).abs() < 1e-12);
    }
}
