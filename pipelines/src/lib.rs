//! steamrf's pipelines: the Kafka source, the LanceDB sink, the STEAM write
//! path, the retrieval service, SQL over the tables and the metrics endpoint:
//! what runs in production. The evaluation harness and the benchmarks are
//! `steamrf-harness` (`pipelines/harness`); the `steamrf` binary is a thin CLI
//! over both (`pipelines/cli`).
//!
//! Entry point: [`pipeline::run`].

#![deny(missing_docs)]

pub mod alloc;
pub mod communities;
pub mod config;
pub mod embed;
pub mod error;
pub mod forget;
pub mod http;
#[cfg(test)]
mod layers;
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
