//! The LanceDB sink: opens or creates the tables and writes micro-batches
//! idempotently.
//!
//! - `interactions`: insert-if-absent on `(event_id, user_id)` (a replayed or
//!   duplicated event adds nothing, and one user's `event_id` never hides or
//!   stands in for another's, whatever tenant sent it); `turn_vectors` and
//!   `passages` likewise (one vector and one window per turn);
//! - `items`, `profiles`: upsert on the entity key, where a row replaces the
//!   stored one only if it is newer by `(timestamp, event_id)`, so replays and
//!   out-of-order delivery converge to the same table.
//!
//! Each `write` is one LanceDB commit: when it returns, the rows are durable.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use arrow_array::RecordBatch;
use lancedb::Table;
use lancedb::table::OptimizeAction;
use steamrf_schemas::TableName;

use crate::config::LanceDbConfig;
use crate::error::{Chain, Error, Result};
use crate::metrics::Metrics;

pub mod admin;
mod fresh;
pub mod ids;
mod index;
mod merge;
mod stored;
mod tables;

pub use self::index::{ensure_btree, index_segments, indexed_columns};
pub(crate) use self::merge::dedup;
use self::merge::{dedup_insert_absent, lacks_key, not_native, pairs_at, upsert_newer};
pub(crate) use self::stored::lookup;
pub use self::tables::{connect, ensure_primary_key, open_or_create, open_or_create_named};

/// The outcome of one table write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteStats {
    /// New rows.
    pub inserted: u64,
    /// Rows replaced by newer versions.
    pub updated: u64,
    /// Rows in the batch that changed nothing (already present, or older).
    pub skipped: u64,
    /// Table version after the write.
    pub version: u64,
}

/// One table's handles, index state and fresh-key ledger.
struct TableState {
    table: Table,
    /// A second handle, for the index updates that run beside the writes
    /// ([`LanceSink::maybe_reindex`]): they never move the writer's handle.
    indexer: Table,
    /// The index update in flight, if any (one at a time per table).
    indexing: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Rows inserted since the key index last covered the table.
    unindexed: AtomicU64,
    /// The insert-if-absent tables' fresh-key ledger ([`fresh`]); `None`
    /// until the first write loads it (and after a commit it cannot follow).
    /// The lock also keeps this instance's writes to the table in order.
    ledger: tokio::sync::Mutex<Option<fresh::Ledger>>,
}

/// Writes micro-batches into the three ingest tables.
///
/// Each table carries a BTree index on its key, so that `merge_insert` looks
/// keys up instead of scanning the whole key column: without it every batch
/// costs O(table size). New rows land in unindexed fragments, which the merge
/// scans; once `reindex_rows` have accumulated the index is brought up to date.
#[derive(Clone)]
pub struct LanceSink {
    tables: Arc<HashMap<TableName, TableState>>,
    metrics: Metrics,
    reindex_rows: u64,
    fresh_keys: usize,
    fresh_filter_bytes: usize,
}

impl LanceSink {
    /// Opens (or creates) every table.
    ///
    /// # Errors
    /// See [`open_or_create`].
    pub async fn open(cfg: &LanceDbConfig, metrics: Metrics) -> Result<Self> {
        let db = connect(cfg).await?;
        let mut tables = HashMap::new();
        for t in TableName::ALL {
            let table = open_or_create(&db, t).await?;
            let rows = table
                .count_rows(None)
                .await
                .map_err(Error::lance("counting rows"))? as u64;
            // Coverage is unknown after a restart: a non-empty table creates
            // or refreshes its index after its first write.
            let unindexed = if rows == 0 { 0 } else { cfg.reindex_rows };
            let indexer = db
                .open_table(t.as_str())
                .execute()
                .await
                .map_err(Error::lance(format!("opening {}", t.as_str())))?;
            tables.insert(
                t,
                TableState {
                    table,
                    indexer,
                    indexing: std::sync::Mutex::new(None),
                    unindexed: AtomicU64::new(unindexed),
                    ledger: tokio::sync::Mutex::new(None),
                },
            );
        }
        Ok(Self {
            tables: Arc::new(tables),
            metrics,
            reindex_rows: cfg.reindex_rows,
            fresh_keys: cfg.fresh_keys,
            fresh_filter_bytes: cfg.fresh_filter_bytes.0,
        })
    }

    /// The handle of one table.
    pub fn table(&self, t: TableName) -> &Table {
        &self.tables[&t].table
    }

    /// Creates the indexes ([`indexed_columns`]), or folds new fragments
    /// into them, once enough unindexed rows have accumulated: as a task
    /// beside the writes, on its own table handle, so neither this write's
    /// Kafka commit nor the next write waits for it (an index update sorts
    /// every key: ~0.3 s at 500k rows, which held back the commit of the
    /// batch that crossed the threshold). Correctness does not depend on
    /// it: lookups scan the fragments no index covers. One update per table
    /// at a time; a failed one is logged and retried after the next write.
    fn maybe_reindex(&self, name: TableName) {
        let state = &self.tables[&name];
        if self.reindex_rows == 0 || state.unindexed.load(Ordering::Relaxed) < self.reindex_rows {
            return;
        }
        let mut running = state
            .indexing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if running.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let covered = state.unindexed.swap(0, Ordering::Relaxed);
        let tables = self.tables.clone();
        let metrics = self.metrics.clone();
        *running = Some(tokio::spawn(async move {
            let state = &tables[&name];
            let started = Instant::now();
            let updated = async {
                state
                    .indexer
                    .checkout_latest()
                    .await
                    .map_err(Error::lance(format!("refreshing {}", name.as_str())))?;
                ensure_btree(&state.indexer, indexed_columns(name)).await
            };
            match updated.await {
                Ok(()) => {
                    metrics
                        .optimizations
                        .with_label_values(&[name.as_str()])
                        .inc();
                    tracing::debug!(table = name.as_str(), took = ?started.elapsed(), "Key index updated.");
                }
                Err(e) => {
                    // Still unindexed: the next write tries again.
                    state.unindexed.fetch_add(covered, Ordering::Relaxed);
                    tracing::warn!(table = name.as_str(), error = %Chain(&e), "Updating the key index failed; retrying after the next write.");
                    metrics.error("sink", &e);
                }
            }
        }));
    }

    /// Waits for the index updates in flight (at shutdown, and in tests).
    pub async fn settle(&self) {
        for state in self.tables.values() {
            let running = state
                .indexing
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(h) = running
                && let Err(e) = h.await
            {
                tracing::warn!(error = %Chain(&e), "An index update panicked.");
            }
        }
    }

    /// Writes one batch durably and idempotently (see the module docs).
    ///
    /// # Errors
    /// [`Error::Lance`] if the commit fails; nothing is then committed to Kafka.
    pub async fn write(&self, name: TableName, batch: &RecordBatch) -> Result<WriteStats> {
        let started = Instant::now();
        let table = self.table(name);
        let (in_rows, written) = match name {
            TableName::Interactions | TableName::TurnVectors | TableName::Passages => {
                let key = name.key();
                let rows = fresh::keys_of(batch, key).ok_or_else(|| Error::Internal {
                    message: lacks_key(name),
                })?;
                match self.write_absent(name, batch, rows).await {
                    Ok((in_rows, inserted, updated, version)) => {
                        (in_rows, Ok((inserted, updated, version)))
                    }
                    Err(e) => (0, Err(e)),
                }
            }
            TableName::Items | TableName::Profiles => {
                let batch = dedup(name, batch)?;
                let key = name.key();
                let in_rows = batch.num_rows() as u64;
                let written = match fresh::keys_of(&batch, key) {
                    Some(rows) => upsert_newer(table, key, batch, rows.iter().map(|r| r.0)).await,
                    None => Err(lancedb::Error::InvalidInput {
                        message: lacks_key(name),
                    }),
                };
                (in_rows, written)
            }
        };
        let (inserted, updated, version) = match written {
            Ok(r) => r,
            Err(e) => {
                // Lance retries plain commit conflicts itself; what reaches us
                // may be a conflict with a concurrent Overwrite (two instances
                // creating the table at once), which no retry from this read
                // version can resolve. Move the handle to the latest version
                // so the caller's retry starts from there.
                if let Err(refresh) = table.checkout_latest().await {
                    tracing::warn!(table = name.as_str(), error = %Chain(&refresh), "Could not refresh the table handle.");
                }
                return Err(Error::lance(format!("writing {}", name.as_str()))(e));
            }
        };
        let stats = WriteStats {
            inserted,
            updated,
            skipped: in_rows.saturating_sub(inserted + updated),
            version,
        };
        let label = [name.as_str()];
        self.metrics
            .rows_written
            .with_label_values(&label)
            .inc_by(stats.inserted + stats.updated);
        self.metrics
            .rows_deduplicated
            .with_label_values(&label)
            .inc_by(stats.skipped);
        self.metrics
            .write_duration
            .with_label_values(&label)
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .table_version
            .with_label_values(&label)
            .set(i64::try_from(stats.version).unwrap_or(i64::MAX));
        self.tables[&name]
            .unindexed
            .fetch_add(stats.inserted, Ordering::Relaxed);
        self.maybe_reindex(name);
        Ok(stats)
    }

    /// Writes an insert-if-absent table: a fresh batch (see [`fresh`]) as
    /// new fragments, any other through [`insert_absent`]; then brings the
    /// ledger up to the new version. `rows` are each row's key hash and
    /// timestamp ([`fresh::keys_of`]). Returns `(rows after the in-batch
    /// dedup, inserted, updated, version)`.
    ///
    /// The ledger sees every key of the batch, so a key repeated within it
    /// makes the batch not fresh: only the exact path dedups (a fresh batch
    /// skips that map, one insert per row).
    async fn write_absent(
        &self,
        name: TableName,
        batch: &RecordBatch,
        rows: Vec<(u64, i64)>,
    ) -> lancedb::Result<(u64, u64, u64, u64)> {
        let table = self.table(name);
        let key = name.key();
        let mut ledger = self.tables[&name].ledger.lock().await;
        if self.fresh_keys == 0 || rows.len() != batch.num_rows() {
            // No ledger, or null keys (no table schema allows them); the
            // ledger learns this commit's keys from it at the next write.
            return dedup_insert_absent(table, name, batch, rows).await;
        }
        let handle = table.dataset().ok_or_else(|| not_native(table))?;
        if ledger.is_none() {
            let started = Instant::now();
            let loaded = fresh::Ledger::load(
                &*handle.get().await?,
                key,
                self.fresh_keys,
                self.fresh_filter_bytes,
            )
            .await?;
            tracing::info!(table = name.as_str(), keys = loaded.len(), version = loaded.covered(), took = ?started.elapsed(), "Fresh-key ledger loaded.");
            *ledger = Some(loaded);
        }
        let l = ledger.as_mut().expect("loaded above");
        let label = [name.as_str()];
        let mut written = None;
        // From here the ledger holds the batch's keys (see `admit`).
        let fresh = match l.admit_rows(&rows) {
            fresh::Admitted::Fresh => true,
            fresh::Admitted::Known => false,
            fresh::Admitted::Suspect(rows) => {
                // A few keys the filter of forgotten keys may hold: the
                // batch is fresh unless the table has one of them (for
                // the same user). A key stored after `covered` makes the
                // fresh commit conflict, as for any fresh batch.
                let runtime = |e: Error| lancedb::Error::Runtime {
                    message: format!("looking up suspect keys in {}: {e}", name.as_str()),
                };
                let pairs = pairs_at(batch, &rows).map_err(runtime)?;
                let stored = self.stored_turns(name, &pairs).await.map_err(runtime)?;
                self.metrics.suspect_lookups.with_label_values(&label).inc();
                stored.is_empty()
            }
        };
        if fresh {
            let dataset = handle.get().await?;
            let hashes = rows.iter().map(|r| r.0);
            match fresh::commit_fresh(dataset, key, batch.clone(), hashes, l.covered()).await {
                Ok(committed) => {
                    let version = committed.version().version;
                    handle.update(committed);
                    self.metrics
                        .fresh_writes
                        .with_label_values(&[label[0], "fresh"])
                        .inc();
                    let n = rows.len() as u64;
                    written = Some((n, n, 0, version));
                }
                Err(
                    e @ (lance::Error::RetryableCommitConflict { .. }
                    | lance::Error::TooMuchWriteContention { .. }),
                ) => {
                    // Another writer inserted one of the keys, or rows it
                    // did not name, since `covered`: look them up.
                    tracing::debug!(table = name.as_str(), error = %Chain(&e), "A fresh batch conflicted; taking the exact path.");
                    self.metrics
                        .fresh_writes
                        .with_label_values(&[label[0], "conflicted"])
                        .inc();
                    table.checkout_latest().await?;
                }
                Err(e) => {
                    // A commit no retry from `covered` can pass (another
                    // instance overwrote the table when both created it):
                    // the ledger no longer describes the table, and the
                    // retry reloads it from the latest version.
                    *ledger = None;
                    return Err(e.into());
                }
            }
        }
        let (in_rows, inserted, updated, version) = match written {
            Some(w) => w,
            None => {
                self.metrics
                    .fresh_writes
                    .with_label_values(&[label[0], "exact"])
                    .inc();
                dedup_insert_absent(table, name, batch, rows).await?
            }
        };
        // The ledger took the batch's keys in `admit`; now learn what other
        // writers committed in between.
        let dataset = handle.get().await?;
        let own = (inserted > 0).then_some(version);
        match l.learn(&dataset, version, own).await {
            fresh::Learned::Current => {}
            fresh::Learned::Unknown => {
                tracing::info!(
                    table = name.as_str(),
                    version,
                    "A commit added rows without naming their keys; the fresh-key ledger reloads."
                );
                *ledger = None;
            }
        }
        Ok((in_rows, inserted, updated, version))
    }

    /// Compacts every table and prunes old versions.
    ///
    /// # Errors
    /// [`Error::Lance`] if an optimisation fails.
    pub async fn optimize(&self) -> Result<()> {
        for (name, state) in self.tables.iter() {
            state
                .table
                .optimize(OptimizeAction::All)
                .await
                .map_err(Error::lance(format!("optimizing {}", name.as_str())))?;
            self.metrics
                .optimizations
                .with_label_values(&[name.as_str()])
                .inc();
        }
        Ok(())
    }
}

/// Test fixture: `events` (JSON) decoded into batches, partition 0, offsets
/// from `first_offset` on.
#[cfg(test)]
pub(crate) fn fixture(
    events: &[impl AsRef<str>],
    first_offset: i64,
) -> steamrf_schemas::TableBatches {
    let mut b = steamrf_schemas::TableBuilders::default();
    for (i, e) in events.iter().enumerate() {
        let ev = steamrf_schemas::decode(e.as_ref().as_bytes()).unwrap();
        b.append(
            &ev,
            steamrf_schemas::Provenance {
                partition: 0,
                offset: first_offset + i as i64,
                ingested_at_ms: 0,
            },
        );
    }
    b.finish().unwrap()
}

#[cfg(test)]
mod tests;
