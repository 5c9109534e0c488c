//! `steamrf eval …`: the papers' evaluation protocols on their data, through
//! steamrf's own operators. Each command prints a report ending with one
//! `RESULT key=value …` line and writes a markdown table to `--out`.

pub mod pyjson;
mod rfmem;
mod steam;

pub use rfmem::{RfMemEval, rfmem};
pub use steam::{SteamEval, steam};
