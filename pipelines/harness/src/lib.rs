//! steamrf's measurements, kept out of the production crate: the evaluation
//! harness ([`eval`]: the STEAM paper's ranking, simulation and diversity
//! protocols, RF-Mem's PersonaBench protocol) and the benchmarks ([`bench`]:
//! ingest against kcat, embed, similarity, communities, retrieve, serve,
//! soak). Both drive `steamrf-pipelines` and the I/O-free operators exactly
//! as production does; the `steamrf` binary exposes them as `steamrf eval …`
//! and `steamrf bench …`.

#![deny(missing_docs)]

pub mod bench;
pub mod eval;
