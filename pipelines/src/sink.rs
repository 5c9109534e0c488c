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
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{ArrayRef, RecordBatch, UInt32Array};
use lance::index::DatasetIndexExt as _;
use lancedb::index::Index;
use lancedb::table::OptimizeAction;
use lancedb::{Connection, Table};
use steamrf_schemas::TableName;

use crate::config::LanceDbConfig;
use crate::error::{Chain, Error, Result};
use crate::metrics::Metrics;

pub mod admin;
mod fresh;
pub mod ids;

/// Opens a LanceDB connection with the configured storage options.
///
/// # Errors
/// [`Error::Lance`] if the URI cannot be opened.
pub async fn connect(cfg: &LanceDbConfig) -> Result<Connection> {
    let mut b = lancedb::connect(&cfg.uri).session(session(cfg));
    for (k, v) in &cfg.storage_options {
        b = b.storage_option(k, v);
    }
    b.execute()
        .await
        .map_err(Error::lance(format!("connecting to {}", cfg.uri)))
}

/// The process's LanceDB session: one index cache and one metadata cache of
/// the configured sizes, shared by every connection (the first connection's
/// configuration sizes them; a process has one configuration). Without it
/// each connection gets LanceDB's defaults, 6 GiB and 1 GiB.
fn session(cfg: &LanceDbConfig) -> Arc<lance::session::Session> {
    static SESSION: std::sync::OnceLock<Arc<lance::session::Session>> = std::sync::OnceLock::new();
    SESSION
        .get_or_init(|| {
            Arc::new(lance::session::Session::new(
                cfg.index_cache_size.0,
                cfg.metadata_cache_size.0,
                Arc::new(lance::io::ObjectStoreRegistry::default()),
            ))
        })
        .clone()
}

/// Opens `name`, creating it with `schema` if it does not exist; fails if it
/// exists with another schema.
///
/// # Errors
/// [`Error::Lance`] on storage errors, [`Error::Config`] on a schema mismatch.
pub async fn open_or_create(db: &Connection, name: TableName) -> Result<Table> {
    let table = open_or_create_named(db, name.as_str(), name.schema()).await?;
    // Only the insert-if-absent tables (`interactions`, `turn_vectors`, `passages`) declare their key: Lance 14
    // rejects the conditional upserts of `items` and `profiles` (newest
    // wins) on a table with a declared primary key ("Primary key column and
    // all its ancestors must not be nullable", raised for the merge's outer
    // join). Those two tables stay exposed to the race below: two instances
    // inserting the same new item or profile at once can store it twice.
    if matches!(
        name,
        TableName::Interactions | TableName::TurnVectors | TableName::Passages
    ) {
        ensure_primary_key(&table, name.key()).await?;
    }
    Ok(table)
}

/// Declares `key` the table's (unenforced) primary key, unless it already is;
/// also upgrades tables created before steamrf declared it.
///
/// Without it, LanceDB cannot see that two concurrent `merge_insert`s insert
/// the same new keys: both find them absent, each commit only adds a
/// fragment, and both rows stay (lance issue 4585). That race is a batch
/// replayed by the instance that took over a partition while the one that
/// lost it still writes it, so exactly-once depends on this declaration: with
/// it, the later commit conflicts and its retry finds the keys present.
///
/// # Errors
/// [`Error::Lance`] if the schema cannot be read or updated.
pub async fn ensure_primary_key(table: &Table, key: &str) -> Result<()> {
    // Another instance may declare it first, or create the table over ours
    // (an Overwrite, with which this commit is incompatible): refresh, look
    // again, try again.
    let mut attempt = 0;
    loop {
        if primary_key_declared(table, key).await? {
            return Ok(());
        }
        match table.set_unenforced_primary_key([key]).await {
            Ok(()) => {
                tracing::info!(
                    table = table.name(),
                    key,
                    "Declared the key column the table's primary key."
                );
                return Ok(());
            }
            Err(e) if attempt >= 4 => {
                return Err(Error::lance(format!(
                    "declaring {key} the primary key of {}",
                    table.name()
                ))(e));
            }
            Err(_) => {
                attempt += 1;
                table
                    .checkout_latest()
                    .await
                    .map_err(Error::lance(format!("refreshing {}", table.name())))?;
            }
        }
    }
}

/// Whether `key` is (part of) `table`'s declared primary key, as Lance reads
/// its schema.
async fn primary_key_declared(table: &Table, key: &str) -> Result<bool> {
    let context = || format!("reading the schema of {}", table.name());
    let schema = table.schema().await.map_err(Error::lance(context()))?;
    let schema = lance::datatypes::Schema::try_from(schema.as_ref())
        .map_err(|e| Error::lance(context())(e.into()))?;
    Ok(schema
        .unenforced_primary_key()
        .iter()
        .any(|f| f.name == key))
}

/// [`open_or_create`] for any table name and schema.
///
/// # Errors
/// As [`open_or_create`].
pub async fn open_or_create_named(
    db: &Connection,
    name: &str,
    expected: arrow_schema::SchemaRef,
) -> Result<Table> {
    let table = match db.open_table(name).execute().await {
        Ok(t) => t,
        Err(lancedb::Error::TableNotFound { .. }) => {
            match db
                .create_empty_table(name, expected.clone())
                .execute()
                .await
            {
                Ok(t) => t,
                // Another instance created it first.
                Err(lancedb::Error::TableAlreadyExists { .. }) => db
                    .open_table(name)
                    .execute()
                    .await
                    .map_err(Error::lance(format!("opening {name}")))?,
                Err(e) => return Err(Error::lance(format!("creating {name}"))(e)),
            }
        }
        Err(e) => return Err(Error::lance(format!("opening {name}"))(e)),
    };
    let actual = table
        .schema()
        .await
        .map_err(Error::lance("reading the schema"))?;
    let names = |s: &arrow_schema::Schema| {
        s.fields()
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect::<Vec<_>>()
    };
    if names(&actual) != names(&expected) {
        if let Some(problem) = admin::pending(name, &actual) {
            return Err(Error::Config {
                problems: vec![problem],
            });
        }
        return Err(Error::Config {
            problems: vec![format!(
                "table {} exists with a different schema than this build writes; migrate or point lancedb.uri elsewhere.\n    found:    {:?}\n    expected: {:?}",
                name,
                names(&actual),
                names(&expected)
            )],
        });
    }
    Ok(table)
}

/// Brings a BTree index on each of `columns` up to date: creates the
/// missing ones, and indexes new fragments in the existing ones as a new
/// segment, merged with the newest segments as [`segments_to_merge`] says.
///
/// # Errors
/// LanceDB failures.
pub async fn ensure_btree(table: &Table, columns: &[&str]) -> Result<()> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    let mut existed = false;
    for c in columns {
        if indices.iter().any(|i| i.columns == [*c]) {
            existed = true;
            continue;
        }
        table
            .create_index(&[*c], Index::BTree(Default::default()))
            .execute()
            .await
            .map_err(Error::lance(format!(
                "creating the {c} index of {}",
                table.name()
            )))?;
    }
    if !existed {
        return Ok(());
    }
    let Some(handle) = table.dataset() else {
        // Not a local or object-store table: LanceDB's default update.
        return table
            .optimize(OptimizeAction::Index(Default::default()))
            .await
            .map(drop)
            .map_err(Error::lance(format!(
                "updating the indexes of {}",
                table.name()
            )));
    };
    let dataset = handle
        .get()
        .await
        .map_err(Error::lance(format!("reading {}", table.name())))?;
    for index in indices
        .iter()
        .filter(|i| columns.iter().any(|c| i.columns == [*c]))
    {
        let (sizes, unindexed) = segment_rows(&dataset, &index.name).await?;
        let merge = segments_to_merge(&sizes, unindexed);
        table
            .optimize(OptimizeAction::Index(
                lancedb::table::OptimizeOptions::merge(merge).index_names(vec![index.name.clone()]),
            ))
            .await
            .map_err(Error::lance(format!(
                "updating the {} index of {}",
                index.name,
                table.name()
            )))?;
    }
    Ok(())
}

/// The rows of each segment of index `name` (oldest first), and the rows
/// no segment covers.
async fn segment_rows(dataset: &lance::Dataset, name: &str) -> Result<(Vec<u64>, u64)> {
    let segments = dataset
        .load_indices_by_name(name)
        .await
        .map_err(|e| Error::lance(format!("reading the {name} index"))(e.into()))?;
    let rows: HashMap<u32, u64> = dataset
        .get_fragments()
        .iter()
        .map(|f| {
            let n = f.metadata().physical_rows.unwrap_or(0);
            (f.id() as u32, n as u64)
        })
        .collect();
    let bitmaps: Vec<_> = segments
        .iter()
        .filter_map(|s| s.fragment_bitmap.as_ref())
        .collect();
    let sizes = bitmaps
        .iter()
        .map(|b| b.iter().map(|f| rows.get(&f).copied().unwrap_or(0)).sum())
        .collect();
    let unindexed = rows
        .iter()
        .filter(|(f, _)| !bitmaps.iter().any(|b| b.contains(**f)))
        .map(|(_, n)| n)
        .sum();
    Ok((sizes, unindexed))
}

/// The segments of the BTree index on `column` of `table` (0: no index).
///
/// # Errors
/// LanceDB failures, or a table that is not local or on object storage.
pub async fn index_segments(table: &Table, column: &str) -> Result<usize> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    let Some(index) = indices.iter().find(|i| i.columns == [column]) else {
        return Ok(0);
    };
    let handle = table.dataset().ok_or_else(|| Error::Internal {
        message: format!("{} is not a native table", table.name()),
    })?;
    let dataset = handle
        .get()
        .await
        .map_err(Error::lance(format!("reading {}", table.name())))?;
    let (sizes, _) = segment_rows(&dataset, &index.name).await?;
    Ok(sizes.len())
}

/// How many of an index's newest segments an update folds together with
/// the rows no segment covers yet (`sizes`: each segment's rows, oldest
/// first), so that updating a large table costs what it adds, not what it
/// holds.
///
/// LanceDB's default update merges the newest segment with the new rows,
/// and with a single segment that is every key of the table: an update
/// every `lancedb.reindex_rows` rows then sorts the whole key column, so the
/// index's cost per ingested row grows with the table. Here the new rows
/// become a segment of their own, merged with the newest segments only
/// while they are at least as large together as the next older one (a
/// binary counter's carries, as in an LSM tree's tiers): each key is merged
/// O(log(table / update)) times, and there are as many segments. A lookup
/// asks every segment.
fn segments_to_merge(sizes: &[u64], new_rows: u64) -> usize {
    let mut carried = new_rows;
    let mut merged = 0;
    for &older in sizes.iter().rev() {
        if carried < older {
            break;
        }
        carried += older;
        merged += 1;
    }
    merged
}

/// The columns of `name` with a BTree index: the key (idempotent writes),
/// and for the per-user tables also `user_id` (the retrieval service reads
/// one user's rows at a time).
pub fn indexed_columns(name: TableName) -> &'static [&'static str] {
    match name {
        TableName::Interactions | TableName::TurnVectors | TableName::Passages => {
            &["event_id", "user_id"]
        }
        TableName::Items => &["item_id"],
        TableName::Profiles => &["user_id"],
    }
}

/// The name of the index on `name`'s key column, if there is one.
#[cfg(test)]
async fn key_index(table: &Table, name: TableName) -> Result<Option<String>> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    Ok(indices
        .into_iter()
        .find(|i| i.columns == [name.key()])
        .map(|i| i.name))
}

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

/// The rows of `table` whose `key` is one of `keys` (and that match `also`),
/// `columns` only: `key IN (...)` in chunks of 1,000 literals, through the
/// key's BTree index where it has one.
///
/// # Errors
/// [`Error::Lance`] if a query fails.
pub(crate) async fn lookup(
    table: &Table,
    key: &str,
    keys: &[&str],
    columns: &[&str],
    also: Option<&str>,
) -> Result<Vec<RecordBatch>> {
    use futures::TryStreamExt;
    use lancedb::query::{ExecutableQuery, QueryBase, Select};

    let mut out = Vec::new();
    for chunk in keys.chunks(1000) {
        let list = chunk
            .iter()
            .map(|k| admin::quoted(k))
            .collect::<Vec<_>>()
            .join(",");
        let filter = match also {
            Some(a) => format!("{key} IN ({list}) AND {a}"),
            None => format!("{key} IN ({list})"),
        };
        let what = || format!("looking up {key}s in {}", table.name());
        let batches: Vec<RecordBatch> = table
            .query()
            .only_if(filter)
            .select(Select::columns(columns))
            .execute()
            .await
            .map_err(Error::lance(what()))?
            .try_collect()
            .await
            .map_err(Error::lance(what()))?;
        out.extend(batches);
    }
    Ok(out)
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

    /// The stored `(timestamp, event_id)` of each of `keys` that exists in
    /// `name` (keys absent from the table are absent from the map).
    ///
    /// The embed stage uses it to embed each item version and each dialogue
    /// turn once: rows the write would skip are not embedded.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_versions(
        &self,
        name: TableName,
        keys: &[&str],
    ) -> Result<HashMap<String, (i64, String)>> {
        let mut out = HashMap::new();
        let key = name.key();
        let mut columns = vec![key, "timestamp"];
        if key != "event_id" {
            columns.push("event_id");
        }
        for b in lookup(self.table(name), key, keys, &columns, None).await? {
            let (Some(k), Some(ts), Some(ev)) = (
                b.column_by_name(key),
                b.column_by_name("timestamp"),
                b.column_by_name("event_id"),
            ) else {
                continue;
            };
            let (k, ts, ev) = (
                k.as_string::<i32>(),
                ts.as_primitive::<TimestampMillisecondType>(),
                ev.as_string::<i32>(),
            );
            for i in 0..b.num_rows() {
                out.insert(k.value(i).to_owned(), (ts.value(i), ev.value(i).to_owned()));
            }
        }
        Ok(out)
    }

    /// Which of `keys` (`(user_id, event_id)`) a per-user table holds, with
    /// `column` (`None` where null): a stored row is only ever another row
    /// of the same user (docs/security.md).
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    async fn stored_pairs(
        &self,
        name: TableName,
        keys: &[(&str, &str)],
        column: &str,
    ) -> Result<HashMap<(String, String), Option<ArrayRef>>> {
        use arrow_array::Array;

        let wanted: std::collections::HashSet<(&str, &str)> = keys.iter().copied().collect();
        let mut ids: Vec<&str> = keys.iter().map(|k| k.1).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut out = HashMap::new();
        let columns = ["event_id", "user_id", column];
        for b in lookup(self.table(name), "event_id", &ids, &columns, None).await? {
            let (Some(ev), Some(user), Some(col)) = (
                b.column_by_name("event_id"),
                b.column_by_name("user_id"),
                b.column_by_name(column),
            ) else {
                continue;
            };
            let (ev, user) = (ev.as_string::<i32>(), user.as_string::<i32>());
            for i in 0..b.num_rows() {
                if !wanted.contains(&(user.value(i), ev.value(i))) {
                    continue;
                }
                let value = col.is_valid(i).then(|| col.slice(i, 1));
                out.insert((user.value(i).to_owned(), ev.value(i).to_owned()), value);
            }
        }
        Ok(out)
    }

    /// The stored timestamp of each of `keys` (`(user_id, event_id)`) that a
    /// per-user table holds; the embed stage and the ledger's suspect keys
    /// ask only which are there.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_turns(
        &self,
        name: TableName,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), i64>> {
        Ok(self
            .stored_pairs(name, keys, "timestamp")
            .await?
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?.as_primitive::<TimestampMillisecondType>().value(0))))
            .collect())
    }

    /// The stored vector of each of the dialogue turns `keys` (`(user_id,
    /// event_id)`, from `turn_vectors`; turns without one are absent from
    /// the map). Only the same user's row is ever reused: under 6e978f1 a
    /// turn reusing another tenant's `event_id` was given that tenant's
    /// vector.
    ///
    /// A replayed batch carries the vectors its first attempt stored, so the
    /// STEAM stage observes a replayed turn as it would have the first time,
    /// and nothing is embedded twice.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_vectors(
        &self,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), Vec<f32>>> {
        Ok(self
            .stored_pairs(TableName::TurnVectors, keys, "embedding")
            .await?
            .into_iter()
            .filter_map(|(k, v)| {
                let v = v?;
                let list = v.as_fixed_size_list();
                let values = list.value(0);
                Some((
                    k,
                    values
                        .as_primitive::<arrow_array::types::Float32Type>()
                        .values()
                        .to_vec(),
                ))
            })
            .collect())
    }

    /// The stored dialogue turns of `sessions` (user, session):
    /// `(user, session, timestamp, event_id, "role: text")`, unordered.
    /// One query per 500 sessions, through the `user_id` index.
    ///
    /// The embed stage reads the turns that precede a new turn in its
    /// session from here when they are not in the batch.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn session_turns(
        &self,
        sessions: &[(&str, &str)],
    ) -> Result<Vec<(String, String, i64, String, String)>> {
        use futures::TryStreamExt;
        use lancedb::query::{ExecutableQuery, QueryBase, Select};

        let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let mut out = Vec::new();
        for chunk in sessions.chunks(500) {
            let users: std::collections::BTreeSet<&str> = chunk.iter().map(|s| s.0).collect();
            let ids: std::collections::BTreeSet<&str> = chunk.iter().map(|s| s.1).collect();
            let list = |xs: &std::collections::BTreeSet<&str>| {
                xs.iter().map(|x| quote(x)).collect::<Vec<_>>().join(",")
            };
            let filter = format!(
                "user_id IN ({}) AND session_id IN ({}) AND kind = 'dialogue_turn' AND text IS NOT NULL",
                list(&users),
                list(&ids)
            );
            let batches: Vec<RecordBatch> = self
                .table(TableName::Interactions)
                .query()
                .only_if(filter)
                .select(Select::columns(&[
                    "user_id",
                    "session_id",
                    "timestamp",
                    "event_id",
                    "role",
                    "text",
                ]))
                .execute()
                .await
                .map_err(Error::lance("looking up session turns"))?
                .try_collect()
                .await
                .map_err(Error::lance("looking up session turns"))?;
            let wanted: std::collections::HashSet<(&str, &str)> = chunk.iter().copied().collect();
            for b in batches {
                let str_col = |i: usize| b.column(i).as_string::<i32>();
                let (user, session, event, role, text) =
                    (str_col(0), str_col(1), str_col(3), str_col(4), str_col(5));
                let ts = b.column(2).as_primitive::<TimestampMillisecondType>();
                for r in 0..b.num_rows() {
                    if !wanted.contains(&(user.value(r), session.value(r))) {
                        continue;
                    }
                    let role = if arrow_array::Array::is_valid(role, r) {
                        role.value(r)
                    } else {
                        "user"
                    };
                    out.push((
                        user.value(r).to_owned(),
                        session.value(r).to_owned(),
                        ts.value(r),
                        event.value(r).to_owned(),
                        format!("{role}: {}", text.value(r)),
                    ));
                }
            }
        }
        Ok(out)
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

/// How many times [`merge_keyed`] recomputes a write that lost a commit
/// race to a concurrent write of the same keys.
const INSERT_ATTEMPTS: u32 = 10;

/// Which rows of a keyed merge replace stored ones: the newer version of an
/// item or profile (by timestamp, then event id).
const NEWER: &str = "target.timestamp < source.timestamp OR (target.timestamp = source.timestamp AND target.event_id < source.event_id)";

/// The exact path of an insert-if-absent table: [`dedup_absent`], then
/// [`insert_absent`]; returns `(rows after the dedup, inserted, updated,
/// version)`.
async fn dedup_insert_absent(
    table: &Table,
    name: TableName,
    batch: &RecordBatch,
    rows: Vec<(u64, i64)>,
) -> lancedb::Result<(u64, u64, u64, u64)> {
    let (batch, rows) = dedup_absent(name, batch, rows).map_err(|e| lancedb::Error::Runtime {
        message: format!("deduplicating a batch for {}: {e}", name.as_str()),
    })?;
    let n = batch.num_rows() as u64;
    let (i, u, v) = insert_absent(table, name, batch, rows.iter().map(|r| r.0)).await?;
    Ok((n, i, u, v))
}

/// Inserts the rows of `batch` whose key ([`TableName::key_columns`]: the
/// pair `(event_id, user_id)`) is not in `table` yet (keys unique within
/// the batch), in one commit; returns `(inserted, 0, version)`. Both
/// columns carry a BTree index, so lance probes both and joins on the pair.
///
/// LanceDB's `merge_insert` finds the present keys through the key's BTree
/// index, but that path commits without naming the keys it inserted (lance
/// 14: only its unindexed path does), so two writers inserting the same new
/// key at once both commit it: a batch replayed by the instance that took
/// over a partition while the one that lost it still writes it. This runs
/// the same merge uncommitted, names every key of the batch in the commit
/// (an exact set of key hashes, the form lance compares exactly), and
/// commits it through lance: a concurrent commit that names one of the same
/// keys makes this one conflict, and the retry finds the keys present.
async fn insert_absent(
    table: &Table,
    name: TableName,
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
) -> lancedb::Result<(u64, u64, u64)> {
    merge_keyed(table, name.key_columns(), batch, hashes, None).await
}

/// Upserts `batch` by `key` (keys unique within the batch): new keys are
/// inserted, stored rows replaced where [`NEWER`]; returns `(inserted,
/// updated, version)`. Committed as [`insert_absent`] commits, naming every
/// key of the batch, so two writers upserting the same new item at once
/// store it once: the later conflicts, and its retry updates the row the
/// first stored (or leaves it, if that one is newer).
async fn upsert_newer(
    table: &Table,
    key: &str,
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
) -> lancedb::Result<(u64, u64, u64)> {
    merge_keyed(table, &[key], batch, hashes, Some(NEWER)).await
}

/// The merge of [`insert_absent`] (`update_if` None: matched rows are kept)
/// or [`upsert_newer`] (matched rows replaced where `update_if` holds), on
/// the columns `on`. The commit names the hashes of the first column's
/// values (`hashes`): two writers inserting one `event_id` for different
/// users conflict needlessly, and the retry finds the other's row is not
/// its pair.
async fn merge_keyed(
    table: &Table,
    on: &[&str],
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
    update_if: Option<&str>,
) -> lancedb::Result<(u64, u64, u64)> {
    use lance::dataset::transaction::Operation;
    use lance::dataset::{CommitBuilder, MergeInsertBuilder, WhenMatched, WhenNotMatched};

    let handle = table.dataset().ok_or_else(|| not_native(table))?;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let dataset = handle.get().await?;
        let key = on[0];
        let mut job = MergeInsertBuilder::try_new(
            dataset.clone(),
            on.iter().map(|c| (*c).to_owned()).collect(),
        )?;
        job.when_matched(match update_if {
            Some(expr) => WhenMatched::update_if(&dataset, expr)?,
            None => WhenMatched::DoNothing,
        })
        .when_not_matched(WhenNotMatched::InsertAll);
        let mut merge = job
            .try_build()?
            .execute_uncommitted_batches(vec![batch.clone()])
            .await?;
        let (inserted, updated) = (merge.stats.num_inserted_rows, merge.stats.num_updated_rows);
        if inserted + updated == 0 {
            // Every key is present (and not older): nothing to commit.
            return Ok((0, 0, dataset.version().version));
        }
        if let Operation::Update {
            inserted_rows_filter,
            ..
        } = &mut merge.transaction.operation
        {
            *inserted_rows_filter = Some(fresh::exact_filter(&dataset, key, hashes.clone())?);
        }
        let mut commit = CommitBuilder::new(dataset);
        if let Some(rows) = merge.affected_rows.take() {
            commit = commit.with_affected_rows(rows);
        }
        match commit.execute(merge.transaction).await {
            Ok(committed) => {
                let version = committed.version().version;
                handle.update(committed);
                return Ok((inserted, updated, version));
            }
            Err(
                e @ (lance::Error::RetryableCommitConflict { .. }
                | lance::Error::TooMuchWriteContention { .. }),
            ) if attempt < INSERT_ATTEMPTS => {
                tracing::debug!(table = table.name(), attempt, error = %Chain(&e), "A keyed merge lost a commit race; recomputing it.");
                table.checkout_latest().await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The `(user_id, event_id)` of `rows` of `batch`.
fn pairs_at<'a>(batch: &'a RecordBatch, rows: &[usize]) -> Result<Vec<(&'a str, &'a str)>> {
    let col = |n: &str| {
        batch
            .column_by_name(n)
            .map(|c| c.as_string::<i32>())
            .ok_or_else(|| Error::Internal {
                message: format!("a per-user batch lacks {n}"),
            })
    };
    let (users, ids) = (col("user_id")?, col("event_id")?);
    Ok(rows
        .iter()
        .map(|&r| (users.value(r), ids.value(r)))
        .collect())
}

/// Why `table` has no lance dataset handle (`Table::dataset`).
fn not_native(table: &Table) -> lancedb::Error {
    lancedb::Error::NotSupported {
        message: format!("{} is not a local or object-store table", table.name()),
    }
}

/// The error message for a batch without `name`'s key or timestamp column.
fn lacks_key(name: TableName) -> String {
    format!(
        "a batch for {} lacks {} or timestamp",
        name.as_str(),
        name.key()
    )
}

/// [`dedup`] for an insert-if-absent table, given each row's key hash and
/// timestamp ([`fresh::keys_of`]), returning with the batch those of the
/// kept rows. One SipHash per key serves the in-batch dedup, the ledger and
/// the commit's key set.
fn dedup_absent(
    name: TableName,
    batch: &RecordBatch,
    rows: Vec<(u64, i64)>,
) -> Result<(RecordBatch, Vec<(u64, i64)>)> {
    let key = name.key();
    let lacks = || Error::Internal {
        message: lacks_key(name),
    };
    let general = || -> Result<(RecordBatch, Vec<(u64, i64)>)> {
        let batch = dedup(name, batch)?;
        let rows = fresh::keys_of(&batch, key).ok_or_else(lacks)?;
        Ok((batch, rows))
    };
    if rows.len() != batch.num_rows() {
        // Null keys (no table schema allows them).
        return general();
    }
    let keys = batch
        .column_by_name(key)
        .ok_or_else(lacks)?
        .as_string::<i32>();
    let users = batch
        .column_by_name("user_id")
        .ok_or_else(lacks)?
        .as_string::<i32>();
    let mut first =
        fresh::HashMap::<u64, u32>::with_capacity_and_hasher(rows.len(), Default::default());
    let mut repeats = Vec::new();
    for (i, (h, _)) in rows.iter().enumerate() {
        match first.entry(*h) {
            Entry::Vacant(v) => {
                v.insert(i as u32);
            }
            Entry::Occupied(o) => {
                let j = *o.get() as usize;
                if keys.value(j) != keys.value(i) || users.value(j) != users.value(i) {
                    // Two keys with one 64-bit hash, or one event_id of two
                    // users (both are stored): the general dedup.
                    return general();
                }
                repeats.push(i);
            }
        }
    }
    if repeats.is_empty() {
        return Ok((batch.clone(), rows));
    }
    let mut repeated = repeats.into_iter().peekable();
    let keep: Vec<u32> = (0..batch.num_rows())
        .filter(|&i| repeated.next_if_eq(&i).is_none())
        .map(|i| i as u32)
        .collect();
    let rows = keep.iter().map(|&i| rows[i as usize]).collect();
    let batch = arrow_select::take::take_record_batch(batch, &UInt32Array::from(keep))?;
    Ok((batch, rows))
}

/// Removes rows whose key ([`TableName::key_columns`]) repeats within the
/// batch: for the per-user tables the first occurrence of each
/// `(event_id, user_id)` stays; for items and profiles the newest by
/// `(timestamp, event_id)`. merge_insert requires unique source keys.
pub(crate) fn dedup(name: TableName, batch: &RecordBatch) -> Result<RecordBatch> {
    let col = |n: &str| {
        batch.column_by_name(n).ok_or_else(|| Error::Internal {
            message: format!("batch for {} lacks {n}", name.as_str()),
        })
    };
    let keys = col(name.key())?.as_string::<i32>();
    let mut keep: HashMap<&str, u32> = HashMap::with_capacity(batch.num_rows());
    match name {
        TableName::Interactions | TableName::TurnVectors | TableName::Passages => {
            // By (user_id, event_id): one event_id of two users is two rows.
            let users = col("user_id")?.as_string::<i32>();
            let mut pairs: HashMap<(&str, &str), u32> = HashMap::with_capacity(batch.num_rows());
            for (i, k) in keys.iter().enumerate() {
                pairs
                    .entry((k.unwrap_or_default(), users.value(i)))
                    .or_insert(i as u32);
            }
            if pairs.len() == batch.num_rows() {
                return Ok(batch.clone());
            }
            let mut idx: Vec<u32> = pairs.into_values().collect();
            idx.sort_unstable();
            return Ok(arrow_select::take::take_record_batch(
                batch,
                &UInt32Array::from(idx),
            )?);
        }
        TableName::Items | TableName::Profiles => {
            let ts = col("timestamp")?.as_primitive::<TimestampMillisecondType>();
            let ids = col("event_id")?.as_string::<i32>();
            let rank = |i: usize| (ts.value(i), ids.value(i));
            for (i, k) in keys.iter().enumerate() {
                match keep.entry(k.unwrap_or_default()) {
                    Entry::Vacant(v) => {
                        v.insert(i as u32);
                    }
                    Entry::Occupied(mut o) => {
                        if rank(i) > rank(*o.get() as usize) {
                            o.insert(i as u32);
                        }
                    }
                }
            }
        }
    }
    if keep.len() == batch.num_rows() {
        return Ok(batch.clone());
    }
    let mut idx: Vec<u32> = keep.into_values().collect();
    idx.sort_unstable();
    Ok(arrow_select::take::take_record_batch(
        batch,
        &UInt32Array::from(idx),
    )?)
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
mod tests {
    use arrow_array::RecordBatchIterator;

    use super::*;

    fn batches(events: &[String]) -> steamrf_schemas::TableBatches {
        fixture(events, 0)
    }

    fn click(id: &str) -> String {
        format!(
            r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"u","item_id":"i"}}"#
        )
    }

    fn item(event: &str, ts: i64, title: &str) -> String {
        format!(
            r#"{{"type":"item","schema_version":1,"event_id":"{event}","timestamp":{ts},"item_id":"i1","title":"{title}"}}"#
        )
    }

    /// The default LanceDB settings, pointed at `dir`.
    fn lancedb_config(dir: &std::path::Path) -> LanceDbConfig {
        let defaults = crate::config::Config::load_with_env(None, [])
            .unwrap()
            .lancedb;
        LanceDbConfig {
            uri: dir.to_str().unwrap().to_owned(),
            ..defaults
        }
    }

    async fn sink() -> (tempfile::TempDir, LanceSink) {
        sink_with(500_000).await
    }

    async fn sink_with(reindex_rows: u64) -> (tempfile::TempDir, LanceSink) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LanceDbConfig {
            reindex_rows,
            ..lancedb_config(dir.path())
        };
        let sink = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        (dir, sink)
    }

    async fn count(s: &LanceSink, t: TableName) -> usize {
        s.table(t).count_rows(None).await.unwrap()
    }

    #[tokio::test]
    async fn interactions_are_idempotent_by_event_id() {
        let (_dir, s) = sink().await;
        let b = batches(&[click("a"), click("b"), click("a")]);
        let batch = b.interactions.unwrap();
        let first = s.write(TableName::Interactions, &batch).await.unwrap();
        assert_eq!(
            (first.inserted, first.skipped),
            (2, 0),
            "the in-batch duplicate is dropped before the merge"
        );
        let replay = s.write(TableName::Interactions, &batch).await.unwrap();
        assert_eq!((replay.inserted, replay.updated, replay.skipped), (0, 0, 2));
        assert_eq!(count(&s, TableName::Interactions).await, 2);
        let more = batches(&[click("b"), click("c")]).interactions.unwrap();
        s.write(TableName::Interactions, &more).await.unwrap();
        assert_eq!(count(&s, TableName::Interactions).await, 3);
        assert_eq!(s.metrics.total_rows_written(), 3);
    }

    #[test]
    fn the_hashed_dedup_keeps_what_the_general_one_keeps() {
        let b = batches(&[click("a"), click("b"), click("a"), click("c"), click("b")])
            .interactions
            .unwrap();
        let all = fresh::keys_of(&b, "event_id").unwrap();
        let (kept, rows) = dedup_absent(TableName::Interactions, &b, all).unwrap();
        let general = dedup(TableName::Interactions, &b).unwrap();
        assert_eq!(kept, general);
        assert_eq!(rows, fresh::keys_of(&general, "event_id").unwrap());
        let offsets = kept
            .column_by_name("source_offset")
            .unwrap()
            .as_primitive::<arrow_array::types::Int64Type>()
            .values()
            .to_vec();
        assert_eq!(offsets, [0, 1, 3], "first occurrences, in order");
        let unique = batches(&[click("x"), click("y")]).interactions.unwrap();
        let all = fresh::keys_of(&unique, "event_id").unwrap();
        let (same, rows) = dedup_absent(TableName::Interactions, &unique, all).unwrap();
        assert_eq!((same.num_rows(), rows.len()), (2, 2));
    }

    /// New `interactions` tables store their id columns with LZ4 (the
    /// schema's `lance-encoding:compression` hint); a table created before
    /// the hint keeps its schema and takes the new batches, on the fresh
    /// path and the exact one.
    #[tokio::test]
    async fn the_id_encoding_hint_reaches_new_tables_and_old_ones_still_take_batches() {
        let t = TableName::Interactions;
        let (_dir, s) = sink().await;
        let schema = s.table(t).schema().await.unwrap();
        let hint = |schema: &arrow_schema::Schema| {
            schema
                .field_with_name("event_id")
                .unwrap()
                .metadata()
                .get("lance-encoding:compression")
                .cloned()
        };
        assert_eq!(hint(&schema).as_deref(), Some("lz4"));

        let dir = tempfile::tempdir().unwrap();
        let db = lancedb::connect(dir.path().to_str().unwrap())
            .execute()
            .await
            .unwrap();
        let plain: Vec<arrow_schema::Field> = t
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone().with_metadata(Default::default()))
            .collect();
        db.create_empty_table(t.as_str(), Arc::new(arrow_schema::Schema::new(plain)))
            .execute()
            .await
            .unwrap();
        let old = LanceSink::open(&lancedb_config(dir.path()), Metrics::new(&[]))
            .await
            .unwrap();
        assert_eq!(hint(&old.table(t).schema().await.unwrap()), None);
        let batch = batches(&[click("a"), click("b")]).interactions.unwrap();
        assert_eq!(old.write(t, &batch).await.unwrap().inserted, 2);
        let replay = batches(&[click("b"), click("c")]).interactions.unwrap();
        let r = old.write(t, &replay).await.unwrap();
        assert_eq!((r.inserted, r.skipped), (1, 1));
        assert_eq!(count(&old, t).await, 3);
    }

    #[tokio::test]
    async fn key_index_is_created_and_kept_up_to_date() {
        let (_dir, s) = sink_with(3).await;
        let t = TableName::Interactions;
        let first = batches(&[click("a"), click("b")]).interactions.unwrap();
        s.write(t, &first).await.unwrap();
        assert_eq!(
            key_index(s.table(t), t).await.unwrap(),
            None,
            "below reindex_rows: no index yet"
        );
        let second = batches(&[click("c"), click("d")]).interactions.unwrap();
        s.write(t, &second).await.unwrap();
        // The update runs beside the writes, on its own handle; the writer's
        // handle sees it from its next commit on (here: moved explicitly).
        s.settle().await;
        s.table(t).checkout_latest().await.unwrap();
        assert!(
            key_index(s.table(t), t).await.unwrap().is_some(),
            "4 rows >= 3: indexed"
        );
        // Through the index, on indexed and unindexed fragments alike, replays add nothing.
        let third = batches(&[click("e")]).interactions.unwrap();
        s.write(t, &third).await.unwrap();
        for b in [&first, &second, &third] {
            let r = s.write(t, b).await.unwrap();
            assert_eq!((r.inserted, r.updated), (0, 0));
        }
        assert_eq!(count(&s, t).await, 5);
        let stats = s
            .table(t)
            .index_stats(key_index(s.table(t), t).await.unwrap().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(stats.num_indexed_rows + stats.num_unindexed_rows, 5);
    }

    #[test]
    fn index_updates_merge_like_a_binary_counter() {
        // Equal updates of 1: the segments are the set bits of the count.
        let mut sizes: Vec<u64> = Vec::new();
        let mut merged_rows = 0;
        for n in 1..=1000u64 {
            let m = segments_to_merge(&sizes, 1);
            let folded: u64 = sizes.drain(sizes.len() - m..).sum();
            merged_rows += folded + 1;
            sizes.push(folded + 1);
            assert_eq!(sizes.len() as u32, n.count_ones(), "after {n} updates");
            assert!(sizes.windows(2).all(|w| w[0] > w[1]), "{sizes:?}");
        }
        // Each row is merged about log2(1000) times, not ~500 times as
        // when every update folds in the whole index.
        assert!(merged_rows <= 1000 * 11, "{merged_rows}");
        // A large update folds in every smaller segment; a small one none.
        assert_eq!(segments_to_merge(&[8, 4, 2], 100), 3);
        assert_eq!(segments_to_merge(&[8, 4, 2], 1), 0);
        assert_eq!(segments_to_merge(&[8, 4, 2], 2), 3, "carries all the way");
        assert_eq!(segments_to_merge(&[8, 4, 1], 1), 1);
        assert_eq!(segments_to_merge(&[], 5), 0);
    }

    #[tokio::test]
    async fn index_updates_add_segments_and_lookups_read_them_all() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LanceDbConfig {
            reindex_rows: 1,
            // Every write looks its keys up, through the index.
            fresh_keys: 0,
            ..lancedb_config(dir.path())
        };
        let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let t = TableName::Interactions;
        let mut written = Vec::new();
        for round in 0..6 {
            let ids: Vec<String> = (0..2).map(|i| format!("r{round}-{i}")).collect();
            let events: Vec<String> = ids.iter().map(|id| click(id)).collect();
            let b = batches(&events).interactions.unwrap();
            let r = s.write(t, &b).await.unwrap();
            assert_eq!(r.inserted, 2);
            s.settle().await;
            written.push(b);
        }
        s.table(t).checkout_latest().await.unwrap();
        let segments = index_segments(s.table(t), "event_id").await.unwrap();
        assert!(
            (2..6).contains(&segments),
            "tiers, neither one segment nor one per update: {segments}"
        );
        // Replays of every batch, whichever segment holds their keys, add nothing.
        for b in &written {
            let r = s.write(t, b).await.unwrap();
            assert_eq!((r.inserted, r.skipped), (0, 2));
        }
        assert_eq!(count(&s, t).await, 12);
    }

    /// Regression (seen in the two-instance e2e test): two instances creating
    /// the tables at once left one with a handle that every retry failed on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_creators_both_write() {
        for round in 0..6 {
            let dir = tempfile::tempdir().unwrap();
            let cfg = lancedb_config(dir.path());
            let (a, b) = tokio::join!(
                LanceSink::open(&cfg, Metrics::new(&[])),
                LanceSink::open(&cfg, Metrics::new(&[]))
            );
            let (a, b) = (a.unwrap(), b.unwrap());
            for (s, id) in [(&a, "a"), (&b, "b")] {
                let batch = batches(&[item(id, 1000, "t")]).items.unwrap();
                let mut attempt = 0;
                while let Err(e) = s.write(TableName::Items, &batch).await {
                    attempt += 1;
                    assert!(attempt < 3, "round {round}: {id} keeps failing: {e:#}");
                }
            }
            assert_eq!(
                count(&a, TableName::Items).await,
                1,
                "round {round}: same item_id"
            );
        }
    }

    /// Writes `batch` into `interactions`, retrying failed commits as the
    /// pipeline's writer does; returns how many were retried.
    async fn write_retrying(s: &LanceSink, batch: &RecordBatch) -> usize {
        let mut attempt = 0;
        while let Err(e) = s.write(TableName::Interactions, batch).await {
            attempt += 1;
            assert!(attempt < 5, "a write keeps failing: {e:#}");
        }
        attempt
    }

    /// Tables made before steamrf declared their key are upgraded when opened;
    /// opening again (or by a second instance) changes nothing.
    #[tokio::test]
    async fn opening_declares_the_key_the_primary_key_also_on_old_tables() {
        let dir = tempfile::tempdir().unwrap();
        let db = lancedb::connect(dir.path().to_str().unwrap())
            .execute()
            .await
            .unwrap();
        let name = TableName::Interactions;
        let old = open_or_create_named(&db, name.as_str(), name.schema())
            .await
            .unwrap();
        assert!(!primary_key_declared(&old, name.key()).await.unwrap());
        let t = open_or_create(&db, name).await.unwrap();
        assert!(primary_key_declared(&t, name.key()).await.unwrap());
        let again = open_or_create(&db, name).await.unwrap();
        assert!(primary_key_declared(&again, name.key()).await.unwrap());
        // The stale handle from before the upgrade learns it too.
        ensure_primary_key(&old, name.key()).await.unwrap();
    }

    /// Two writers insert the same new keys at the same moment, round after
    /// round: a batch replayed by the instance that took over a partition
    /// while the one that lost it still writes it (a broker restart makes
    /// this happen). Each key must be stored once. Both merges find the keys
    /// absent and each commit only adds a fragment, so LanceDB sees no
    /// conflict unless the commits name the keys they insert (lance issue
    /// 4585): [`insert_absent`] does, on either side of `reindex_rows`.
    async fn same_new_keys_from_two_writers(reindex_rows: u64) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LanceDbConfig {
            reindex_rows,
            ..lancedb_config(dir.path())
        };
        let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let rounds = 30;
        let mut retries = 0;
        for round in 0..rounds {
            let ids: Vec<String> = (0..25).map(|i| click(&format!("r{round}-{i}"))).collect();
            let batch = batches(&ids).interactions.unwrap();
            let write =
                |s: LanceSink, batch: RecordBatch| async move { write_retrying(&s, &batch).await };
            let (ra, rb) = tokio::join!(
                tokio::spawn(write(a.clone(), batch.clone())),
                tokio::spawn(write(b.clone(), batch))
            );
            retries += ra.unwrap() + rb.unwrap();
        }
        a.settle().await;
        b.settle().await;
        let t = a.table(TableName::Interactions);
        t.checkout_latest().await.unwrap();
        assert_eq!(
            key_index(t, TableName::Interactions)
                .await
                .unwrap()
                .is_some(),
            reindex_rows > 0,
            "the merges ran on the path under test"
        );
        assert_eq!(
            t.count_rows(None).await.unwrap(),
            25 * rounds,
            "{retries} writes retried"
        );
        eprintln!(
            "same new keys from two writers (reindex_rows {reindex_rows}): {retries} writes retried"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_inserting_the_same_new_keys_store_each_once() {
        same_new_keys_from_two_writers(0).await;
    }

    /// The same through the key's BTree index, where LanceDB's own
    /// `merge_insert` stored such keys twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_inserting_the_same_new_keys_through_the_index_store_each_once() {
        same_new_keys_from_two_writers(20).await;
    }

    /// Two writers (separate connections, as two processes) commit to the
    /// same table at once, with overlapping keys (a replay racing a live
    /// write): every key once, none lost. Failed commits are retried, as the
    /// pipeline's writer does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_on_one_table_write_each_key_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lancedb_config(dir.path());
        let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let run = |s: LanceSink, from: usize| async move {
            let mut retries = 0;
            for chunk in (from..from + 1200).collect::<Vec<_>>().chunks(25) {
                let ids: Vec<String> = chunk.iter().map(|i| click(&format!("e{i}"))).collect();
                let batch = batches(&ids).interactions.unwrap();
                retries += write_retrying(&s, &batch).await;
            }
            retries
        };
        // Keys 0..1200 and 600..1800: 600 written by both, concurrently.
        let (ra, rb) = tokio::join!(tokio::spawn(run(a.clone(), 0)), tokio::spawn(run(b, 600)));
        let retries = ra.unwrap() + rb.unwrap();
        let t = a.table(TableName::Interactions);
        t.checkout_latest().await.unwrap();
        assert_eq!(t.count_rows(None).await.unwrap(), 1800, "{retries} retries");
        let out = crate::sql::query(
            &cfg,
            "SELECT count(DISTINCT event_id) AS n FROM interactions",
        )
        .await
        .unwrap();
        use arrow_array::cast::AsArray;
        let distinct = out[0]
            .column(0)
            .as_primitive::<arrow_array::types::Int64Type>()
            .value(0);
        assert_eq!(distinct, 1800);
        eprintln!("two writers: {retries} commits retried");
    }

    fn paths(s: &LanceSink) -> (u64, u64) {
        let n = |p: &str| {
            s.metrics
                .fresh_writes
                .with_label_values(&["interactions", p])
                .get()
        };
        (n("fresh"), n("exact"))
    }

    fn clicks(ids: std::ops::Range<usize>) -> RecordBatch {
        let ids: Vec<String> = ids.map(|i| click(&format!("e{i}"))).collect();
        batches(&ids).interactions.unwrap()
    }

    /// New keys skip the lookup; a replay, a re-send among new keys, and a
    /// replay after a restart (the ledger reloaded from the table) take it
    /// and add nothing.
    #[tokio::test]
    async fn fresh_batches_skip_the_lookup_and_replays_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lancedb_config(dir.path());
        let t = TableName::Interactions;
        let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        for r in [0..10, 10..20] {
            assert_eq!(s.write(t, &clicks(r)).await.unwrap().inserted, 10);
        }
        assert_eq!(paths(&s), (2, 0));
        let replay = s.write(t, &clicks(0..10)).await.unwrap();
        assert_eq!((replay.inserted, replay.skipped), (0, 10));
        let resend = s.write(t, &clicks(15..25)).await.unwrap();
        assert_eq!((resend.inserted, resend.skipped), (5, 5));
        assert_eq!(paths(&s), (2, 2));
        assert_eq!(count(&s, t).await, 25);
        drop(s);
        let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let replay = s.write(t, &clicks(20..25)).await.unwrap();
        assert_eq!(replay.inserted, 0);
        s.write(t, &clicks(25..30)).await.unwrap();
        assert_eq!(paths(&s), (1, 1));
        assert_eq!(count(&s, t).await, 30);
    }

    /// A batch that repeats a key is not fresh (the ledger sees the key
    /// twice): it takes the exact path, which stores the key once; the
    /// next batch of new keys is fresh again.
    #[tokio::test]
    async fn a_batch_repeating_a_key_takes_the_exact_path_and_stores_it_once() {
        let (_dir, s) = sink().await;
        let t = TableName::Interactions;
        let twice = batches(&[click("a"), click("b"), click("a")])
            .interactions
            .unwrap();
        let w = s.write(t, &twice).await.unwrap();
        assert_eq!((w.inserted, w.skipped), (2, 0));
        assert_eq!(paths(&s), (0, 1));
        let next = batches(&[click("c"), click("d")]).interactions.unwrap();
        assert_eq!(s.write(t, &next).await.unwrap().inserted, 2);
        assert_eq!(paths(&s), (1, 1));
        assert_eq!(count(&s, t).await, 4);
    }

    /// A fresh batch whose keys another writer committed after this
    /// writer's ledger was current (the instance that lost a partition
    /// still writing it): the commit conflicts, and the lookup finds them.
    #[tokio::test]
    async fn a_fresh_batch_another_writer_committed_meanwhile_is_looked_up() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lancedb_config(dir.path());
        let t = TableName::Interactions;
        let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        b.write(t, &clicks(0..5)).await.unwrap();
        a.write(t, &clicks(5..15)).await.unwrap();
        let again = b.write(t, &clicks(5..15)).await.unwrap();
        assert_eq!((again.inserted, again.skipped), (0, 10));
        assert_eq!(paths(&b), (1, 1), "tried fresh, then looked up");
        // b learned a's keys from its commit: a replay now goes straight to the lookup.
        b.write(t, &clicks(5..15)).await.unwrap();
        assert_eq!(paths(&b), (1, 2));
        let table = a.table(t);
        table.checkout_latest().await.unwrap();
        assert_eq!(table.count_rows(None).await.unwrap(), 15);
    }

    /// A sink that has written clicks 0..5 (so its ledger is loaded), and
    /// a second connection to the same tables.
    async fn ledger_loaded_and_another_connection() -> (tempfile::TempDir, LanceSink, Connection) {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lancedb_config(dir.path());
        let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        s.write(TableName::Interactions, &clicks(0..5))
            .await
            .unwrap();
        let other = connect(&cfg).await.unwrap();
        (dir, s, other)
    }

    /// Another instance overwrites the table after this one loaded its
    /// ledger (both created it at once): the fresh commit from the ledger's
    /// version can never pass, so the failed write drops the ledger and the
    /// retry, as the writer retries, reloads it and lands.
    #[tokio::test]
    async fn an_overwrite_after_the_ledger_loaded_is_survived_by_a_retry() {
        let t = TableName::Interactions;
        let (_dir, s, other) = ledger_loaded_and_another_connection().await;
        let empty = RecordBatch::new_empty(t.schema());
        other
            .create_table(
                t.as_str(),
                Box::new(RecordBatchIterator::new([Ok(empty)], t.schema()))
                    as Box<dyn arrow_array::RecordBatchReader + Send>,
            )
            .mode(lancedb::database::CreateTableMode::Overwrite)
            .execute()
            .await
            .unwrap();
        let batch = clicks(5..10);
        let mut failures = 0;
        while let Err(e) = s.write(t, &batch).await {
            failures += 1;
            assert!(failures < 3, "the retry did not recover: {e}");
        }
        assert_eq!(count(&s, t).await, 5, "the overwrite emptied the table");
    }

    /// Rows added by another tool without naming their keys (a plain
    /// append): the next fresh commit conflicts with it, and the ledger
    /// reloads from the table.
    #[tokio::test]
    async fn an_append_the_ledger_cannot_read_reloads_it() {
        let t = TableName::Interactions;
        let (_dir, s, other) = ledger_loaded_and_another_connection().await;
        let table = other.open_table(t.as_str()).execute().await.unwrap();
        let appended = clicks(5..10);
        let schema = appended.schema();
        table
            .add(Box::new(RecordBatchIterator::new([Ok(appended)], schema))
                as Box<dyn arrow_array::RecordBatchReader + Send>)
            .execute()
            .await
            .unwrap();
        let w = s.write(t, &clicks(8..12)).await.unwrap();
        assert_eq!((w.inserted, w.skipped), (2, 2));
        assert!(s.tables[&t].ledger.lock().await.is_none(), "to be reloaded");
        let w = s.write(t, &clicks(5..10)).await.unwrap();
        assert_eq!(w.inserted, 0, "the reloaded ledger knows the appended keys");
        assert_eq!(paths(&s), (1, 2));
        assert_eq!(count(&s, t).await, 12);
    }

    /// Two writers upsert the same new items at the same moment, through
    /// the key's index (as two instances ingesting one catalogue): each item
    /// once, at its newest version. LanceDB's own `merge_insert` commits
    /// without naming the keys on that path and stored such items twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_writers_upserting_the_same_new_items_through_the_index_store_each_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LanceDbConfig {
            reindex_rows: 20,
            ..lancedb_config(dir.path())
        };
        let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let rounds = 20;
        let mut retries = 0;
        for round in 0..rounds {
            // Writer a has version 1 of each item, writer b version 2.
            let version = |v: i64| -> RecordBatch {
                let events: Vec<String> = (0..25)
                    .map(|i| {
                        format!(
                            r#"{{"type":"item","schema_version":1,"event_id":"r{round}-{i}-v{v}","timestamp":{},"item_id":"r{round}-{i}","title":"v{v}"}}"#,
                            1000 * v
                        )
                    })
                    .collect();
                batches(&events).items.unwrap()
            };
            let write = |s: LanceSink, batch: RecordBatch| async move {
                let mut tries = 0;
                while let Err(e) = s.write(TableName::Items, &batch).await {
                    tries += 1;
                    assert!(tries < 20, "{e}");
                }
                tries
            };
            let (ra, rb) = tokio::join!(
                tokio::spawn(write(a.clone(), version(1))),
                tokio::spawn(write(b.clone(), version(2)))
            );
            retries += ra.unwrap() + rb.unwrap();
        }
        a.settle().await;
        b.settle().await;
        let t = a.table(TableName::Items);
        t.checkout_latest().await.unwrap();
        assert!(
            key_index(t, TableName::Items).await.unwrap().is_some(),
            "the merges ran through the index"
        );
        assert_eq!(
            t.count_rows(None).await.unwrap(),
            25 * rounds,
            "{retries} retries"
        );
        let old = t.count_rows(Some("title = 'v1'".into())).await.unwrap();
        assert_eq!(old, 0, "every item at its newest version");
    }

    #[tokio::test]
    async fn items_upsert_newest_wins_and_replays_converge() {
        let (_dir, s) = sink().await;
        let v2 = batches(&[item("e2", 2000, "New title")]).items.unwrap();
        let v1 = batches(&[item("e1", 1000, "Old title")]).items.unwrap();
        s.write(TableName::Items, &v2).await.unwrap();
        // An older version arriving late changes nothing; a replay of v2 neither.
        let late = s.write(TableName::Items, &v1).await.unwrap();
        assert_eq!((late.inserted, late.updated), (0, 0));
        let replay = s.write(TableName::Items, &v2).await.unwrap();
        assert_eq!((replay.inserted, replay.updated), (0, 0));
        let v3 = batches(&[item("e3", 3000, "Newest"), item("e0", 500, "Ancient")])
            .items
            .unwrap();
        let up = s.write(TableName::Items, &v3).await.unwrap();
        assert_eq!(
            (up.inserted, up.updated),
            (0, 1),
            "within a batch the newest row is kept"
        );
        assert_eq!(count(&s, TableName::Items).await, 1);
        let rows = crate::sql::query_table(s.table(TableName::Items), "SELECT title FROM t")
            .await
            .unwrap();
        let titles = arrow_cast::pretty::pretty_format_batches(&rows)
            .unwrap()
            .to_string();
        assert!(titles.contains("Newest"), "{titles}");
    }

    #[tokio::test]
    async fn stored_versions_finds_keys_with_quotes() {
        let (_dir, s) = sink().await;
        let it = |id: &str, ev: &str, ts: i64| {
            format!(
                r#"{{"type":"item","schema_version":1,"event_id":"{ev}","timestamp":{ts},"item_id":"{id}","title":"t"}}"#
            )
        };
        let events = vec![it("it-e1", "e1", 10), it("it-e'2", "e'2", 20)];
        let b = batches(&events);
        s.write(TableName::Items, b.items.as_ref().unwrap())
            .await
            .unwrap();
        let click = batches(&[click("c'1")]);
        s.write(
            TableName::Interactions,
            click.interactions.as_ref().unwrap(),
        )
        .await
        .unwrap();
        let items = s
            .stored_versions(TableName::Items, &["it-e1", "it-e'2", "absent"])
            .await
            .unwrap();
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(items["it-e'2"], (20, "e'2".to_owned()));
        // Per user: another user's row under the same event_id is not it.
        let seen = s
            .stored_turns(
                TableName::Interactions,
                &[("u", "c'1"), ("u", "nope"), ("other", "c'1")],
            )
            .await
            .unwrap();
        assert_eq!(
            seen,
            HashMap::from([(("u".to_owned(), "c'1".to_owned()), 1000)])
        );
    }

    /// Issue 44, item 4, as the issue gives it: with four keys remembered,
    /// e1…e5 (one batch each) push e1 out of the ledger; e1 re-sent with a
    /// newer timestamp beside a new event is looked up (key by key, not the
    /// whole batch) and stored once. Under 6e978f1 `interactions` held e1
    /// twice.
    #[tokio::test]
    async fn a_re_send_of_a_forgotten_event_with_a_newer_timestamp_is_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = LanceDbConfig {
            fresh_keys: 4,
            ..lancedb_config(dir.path())
        };
        let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let at = |id: &str, ts: i64| {
            format!(
                r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"u","item_id":"i"}}"#
            )
        };
        for n in 1..=5 {
            let b = batches(&[at(&format!("e{n}"), n * 1000)]);
            s.write(TableName::Interactions, b.interactions.as_ref().unwrap())
                .await
                .unwrap();
        }
        let b = batches(&[at("e1", 9000), at("e6", 9000)]);
        let stats = s
            .write(TableName::Interactions, b.interactions.as_ref().unwrap())
            .await
            .unwrap();
        assert_eq!(stats.inserted, 1, "{stats:?}");
        assert_eq!(count(&s, TableName::Interactions).await, 6);
        let lookups = s
            .metrics
            .suspect_lookups
            .with_label_values(&["interactions"])
            .get();
        assert_eq!(lookups, 1, "e1 alone was looked up");
    }

    /// Issue 44, item 2: an `event_id` is unique per user, not table-wide.
    /// Another tenant's row under the same `event_id`, written first, neither
    /// hides this one (under 6e978f1 it was dropped as a duplicate) nor
    /// stands in for it; a re-send of either is still stored once, on the
    /// fresh path and on the exact path alike.
    #[tokio::test]
    async fn one_event_id_of_two_users_is_two_rows_and_each_is_stored_once() {
        let (_dir, s) = sink().await;
        let turn = |user: &str, id: &str, text: &str| {
            format!(
                r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"{user}","session_id":"s","role":"user","text":"{text}"}}"#
            )
        };
        let write = |events: Vec<String>| {
            let s = &s;
            async move {
                let b = batches(&events);
                s.write(TableName::Interactions, b.interactions.as_ref().unwrap())
                    .await
                    .unwrap()
            }
        };
        // The squatter first, then the owner (fresh path: a new key each).
        assert_eq!(
            write(vec![turn("globex:eve", "acme-d-2", "squat")])
                .await
                .inserted,
            1
        );
        assert_eq!(
            write(vec![turn("acme:ann", "acme-d-2", "mine")])
                .await
                .inserted,
            1
        );
        // Both in one batch, with a re-send of each (the exact path).
        let stats = write(vec![
            turn("acme:ann", "acme-d-3", "a"),
            turn("globex:eve", "acme-d-3", "b"),
            turn("acme:ann", "acme-d-3", "a"),
            turn("globex:eve", "acme-d-2", "squat again"),
        ])
        .await;
        assert_eq!(stats.inserted, 2, "{stats:?}");
        assert_eq!(
            write(vec![turn("acme:ann", "acme-d-2", "re-sent")])
                .await
                .inserted,
            0
        );
        let rows = s
            .stored_turns(
                TableName::Interactions,
                &[
                    ("acme:ann", "acme-d-2"),
                    ("globex:eve", "acme-d-2"),
                    ("acme:ann", "acme-d-3"),
                    ("globex:eve", "acme-d-3"),
                ],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), 4, "{rows:?}");
        let n = s
            .table(TableName::Interactions)
            .count_rows(None)
            .await
            .unwrap();
        assert_eq!(n, 4);
    }

    #[tokio::test]
    async fn reopening_checks_the_schema() {
        let (dir, s) = sink().await;
        drop(s);
        let cfg = lancedb_config(dir.path());
        LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
        let db = connect(&cfg).await.unwrap();
        db.drop_table("profiles", &[]).await.unwrap();
        let wrong = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "user_id",
            arrow_schema::DataType::Utf8,
            false,
        )]));
        db.create_empty_table("profiles", wrong)
            .execute()
            .await
            .unwrap();
        let err = LanceSink::open(&cfg, Metrics::new(&[]))
            .await
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("table profiles exists with a different schema"),
            "{err}"
        );
    }
}
