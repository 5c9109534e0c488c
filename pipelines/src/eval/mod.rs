//! `steamrf eval …`: the papers' evaluation protocols on their data, through
//! steamrf's own operators. Each command prints a report ending with one
//! `RESULT key=value …` line and writes a markdown table to `--out`.

mod plot;
pub mod pyjson;
mod rfmem;
mod simulate;
mod steam;

pub use rfmem::{RfMemEval, rfmem};
pub use steam::{SteamEval, steam};

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

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
