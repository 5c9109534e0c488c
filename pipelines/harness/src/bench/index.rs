//! `steamrf bench index`: what one key-index update costs as `interactions`
//! grows, for the writer's tiered update (`sink::ensure_btree`) beside
//! LanceDB's default update (the newest segment merged with the new rows),
//! on two tables holding the same rows, in the same run.

use std::time::Instant;

use arrow_array::RecordBatch;
use lancedb::Table;
use lancedb::table::OptimizeAction;
use steamrf_pipelines::config::{Config, LanceDbConfig};
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::sink::{self, LanceSink};
use steamrf_schemas::{Provenance, TableBuilders, TableName, decode};

use super::{add, internal};

/// Options of `steamrf bench index`.
#[derive(Debug, Clone)]
pub struct IndexBench {
    /// Rows in the table before the first measured update.
    pub rows: u64,
    /// Rows appended before each update (`lancedb.reindex_rows`).
    pub update_rows: u64,
    /// Updates measured.
    pub updates: usize,
    /// Stored clicks replayed after each update (spread over the whole
    /// table, so every segment is asked): the lookup an exact write makes.
    pub replay_rows: u64,
}

const BATCH: u64 = 100_000;

/// Clicks `ids` as an `interactions` batch (the ingest bench's events).
fn clicks(ids: impl IntoIterator<Item = u64>) -> Result<RecordBatch> {
    let mut builders = TableBuilders::default();
    for i in ids {
        let (_, payload) = super::bench_event(i);
        let event = decode(payload.as_bytes()).map_err(internal)?;
        let provenance = Provenance {
            partition: 0,
            offset: i as i64,
            ingested_at_ms: 0,
        };
        builders.append(&event, provenance);
    }
    builders
        .finish()?
        .interactions
        .ok_or_else(|| internal("no interactions built"))
}

async fn append(tables: &[&Table], range: std::ops::Range<u64>) -> Result<()> {
    let mut start = range.start;
    while start < range.end {
        let end = (start + BATCH).min(range.end);
        let batch = tokio::task::spawn_blocking(move || clicks(start..end))
            .await
            .map_err(internal)??;
        for t in tables {
            add(t, batch.clone())
                .await
                .map_err(Error::lance("appending clicks"))?;
        }
        start = end;
    }
    Ok(())
}

/// A sink that never updates an index itself (the bench does) and looks
/// every write's keys up (no fresh-key ledger).
async fn open(dir: &std::path::Path) -> Result<LanceSink> {
    let defaults = Config::load(None)?.lancedb;
    let cfg = LanceDbConfig {
        uri: dir.to_string_lossy().into_owned(),
        reindex_rows: 0,
        fresh_keys: 0,
        ..defaults
    };
    LanceSink::open(&cfg, Metrics::new(&[])).await
}

/// Runs the benchmark; returns its summary lines, the last one `RESULT`.
///
/// # Errors
/// LanceDB failures.
pub async fn index(b: IndexBench) -> Result<Vec<String>> {
    if b.update_rows == 0 || b.updates == 0 {
        return Err(internal("--update-rows and --updates must be > 0"));
    }
    let dirs: Vec<tempfile::TempDir> = (0..2)
        .map(|_| tempfile::tempdir())
        .collect::<std::io::Result<_>>()
        .map_err(|source| Error::Io {
            context: "temp dir".into(),
            source,
        })?;
    let (default_sink, tiered_sink) = (open(dirs[0].path()).await?, open(dirs[1].path()).await?);
    let t = TableName::Interactions;
    let (default, tiered) = (default_sink.table(t), tiered_sink.table(t));
    let columns = sink::indexed_columns(t);
    let mut out = Vec::new();
    let started = Instant::now();
    append(&[default, tiered], 0..b.rows).await?;
    for table in [default, tiered] {
        sink::ensure_btree(table, columns).await?;
    }
    out.push(format!(
        "{} clicks written to two tables and indexed ({columns:?}) in {:.0} s",
        b.rows,
        started.elapsed().as_secs_f64()
    ));
    let (mut default_s, mut tiered_s) = (Vec::new(), Vec::new());
    let (mut default_lookup, mut tiered_lookup) = (Vec::new(), Vec::new());
    let mut end = b.rows;
    for u in 0..b.updates {
        append(&[default, tiered], end..end + b.update_rows).await?;
        end += b.update_rows;
        // Alternate which goes first, so neither always meets a warm cache.
        for which in if u % 2 == 0 { [0, 1] } else { [1, 0] } {
            let t0 = Instant::now();
            if which == 0 {
                default
                    .optimize(OptimizeAction::Index(Default::default()))
                    .await
                    .map_err(Error::lance("LanceDB's default index update"))?;
                default_s.push(t0.elapsed().as_secs_f64());
            } else {
                sink::ensure_btree(tiered, columns).await?;
                tiered_s.push(t0.elapsed().as_secs_f64());
            }
        }
        let n = b.replay_rows.min(end).max(1);
        let replay = tokio::task::spawn_blocking(move || clicks((0..n).map(|k| k * (end / n))))
            .await
            .map_err(internal)??;
        for (sink, times) in [
            (&default_sink, &mut default_lookup),
            (&tiered_sink, &mut tiered_lookup),
        ] {
            let t0 = Instant::now();
            let r = sink.write(t, &replay).await?;
            times.push(t0.elapsed().as_secs_f64());
            if r.inserted != 0 {
                return Err(internal(format!(
                    "a replay of stored clicks inserted {} rows",
                    r.inserted
                )));
            }
        }
        out.push(format!(
            "update {} at {end} rows: LanceDB default {:.2} s, tiered {:.2} s ({} segments); replaying {n} stored clicks: {:.2} s, {:.2} s",
            u + 1,
            default_s[u],
            tiered_s[u],
            sink::index_segments(tiered, "event_id").await?,
            default_lookup[u],
            tiered_lookup[u]
        ));
    }
    for (table, name) in [(default, "default"), (tiered, "tiered")] {
        let n = table
            .count_rows(Some("event_id = 'bench-000000000007'".into()))
            .await
            .map_err(Error::lance("looking a key up"))?;
        if n != 1 {
            return Err(internal(format!("{name}: key found {n} times")));
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    out.push(format!(
        "RESULT rows={} update_rows={} updates={} default_update_s={:.3} tiered_update_s={:.3} ratio={:.3} segments={} default_lookup_s={:.3} tiered_lookup_s={:.3} lookup_ratio={:.3}",
        end,
        b.update_rows,
        b.updates,
        mean(&default_s),
        mean(&tiered_s),
        mean(&tiered_s) / mean(&default_s),
        sink::index_segments(tiered, "event_id").await?,
        mean(&default_lookup),
        mean(&tiered_lookup),
        mean(&tiered_lookup) / mean(&default_lookup)
    ));
    Ok(out)
}
