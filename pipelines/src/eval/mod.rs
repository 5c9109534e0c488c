//! `steamrf eval …`: the papers' evaluation protocols on their data, through
//! steamrf's own operators. Each command prints a report ending with one
//! `RESULT key=value …` line and writes a markdown table to `--out`.

pub mod pyjson;
mod rfmem;
mod steam;

pub use rfmem::{RfMemEval, rfmem};
pub use steam::{SteamEval, steam};

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

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
