//! steamrf's pipelines: the Kafka source, the LanceDB sink, SQL over the
//! tables, the metrics endpoint, and the benchmarks. The `steamrf` binary
//! (`main.rs`) is a thin CLI over this library.
//!
//! Entry point: [`pipeline::run`].

#![deny(missing_docs)]

pub mod alloc;
pub mod bench;
pub mod communities;
pub mod config;
pub mod embed;
pub mod error;
pub mod eval;
pub mod forget;
pub mod http;
pub mod metrics;
pub mod migrate;
pub mod pipeline;
pub mod serve;
pub mod sink;
pub mod source;
pub mod sql;
pub mod steam;

pub use config::Config;
pub use error::{Error, ErrorKind, Result};
pub use metrics::Metrics;
