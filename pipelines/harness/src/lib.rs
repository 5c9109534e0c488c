//! steamrf's measurements, kept out of the production crate: the evaluation
//! harness ([`eval`]: the STEAM paper's ranking, simulation and diversity
//! protocols, RF-Mem's PersonaBench protocol, LoCoMo through the served
//! path) and the benchmarks ([`bench`]:
//! ingest against kcat, embed, similarity, communities, retrieve, serve,
//! soak). Both drive `steamrf-pipelines` and the I/O-free operators exactly
//! as production does; the `steamrf` binary exposes them as `steamrf eval …`
//! and `steamrf bench …`.

#![deny(missing_docs)]

pub mod bench;
pub mod eval;

/// A loopback port free right now, for a service a benchmark or an
/// evaluation starts.
pub(crate) fn free_port() -> steamrf_pipelines::error::Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| steamrf_pipelines::error::Error::Io {
            context: "finding a free port".into(),
            source,
        })
}
