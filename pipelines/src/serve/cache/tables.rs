//! The service's reads of the tables: a user's most recent rows through
//! the `user_id` indexes (cut at `serve.max_user_rows`), the catalogue and
//! the prototypes, members by id, and which rows changed between two table
//! versions (the fragments each commit touched).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::{TimestampMillisecondType, UInt64Type};
use futures::TryStreamExt;
use futures::future::BoxFuture;
use lancedb::query::{ExecutableQuery, QueryBase, Select};
use lancedb::{Connection, Table};
use steamrf_operators::rank::TenantItemCf;
use steamrf_operators::steam::MemoryId;
use steamrf_operators::steam::memory::Memory;

use super::Loader;
use super::build::{UserRows, build_user};
use super::corpus::UserData;
use super::snapshot::{Snapshot, catalogue, item_texts, prototypes};
use crate::config::{CorpusKind, ServeConfig};
use crate::error::{Chain, Error, Result};
use crate::sink::ids::{is_legacy, sql_list};

/// The tables the service reads (opened once they exist).
pub struct Tables {
    pub(super) db: Connection,
    pub(super) open: std::sync::RwLock<BTreeMap<&'static str, Table>>,
    /// What the ranker needs beyond the catalogue's vectors.
    pub(super) signals: SignalSources,
}

/// Which of the ranker's statistics the snapshot keeps (`serve.ranker`).
#[derive(Debug, Clone, Default)]
pub struct SignalSources {
    /// BM25 over the items' texts, made with this template
    /// (`embed.item_template`, the text the items' vectors are made from).
    pub item_template: Option<String>,
    /// Users per item from `interactions`, re-read at most this often.
    pub item_cf: Option<Duration>,
    /// `tenancy.separator`: the item statistics are kept per tenant.
    pub tenant_separator: Option<char>,
}

/// The `interactions` columns a corpus is built from, in the order `build` reads them.
pub(super) const INTERACTION_COLUMNS: &[&str] = &[
    "event_id",
    "kind",
    "user_id",
    "timestamp",
    "item_id",
    "session_id",
    "role",
    "text",
    "source_partition",
    "source_offset",
];

/// The `turn_vectors` columns a corpus is built from (`terms` and
/// `weights` read by name, and only where the table has them yet).
pub(super) const TURN_VECTOR_COLUMNS: &[&str] = &["event_id", "embedding", "terms", "weights"];

/// Columns newer builds added: a table an older ingest wrote (and no newer
/// one has opened yet) lacks them, and a read leaves them out.
const ADDED_COLUMNS: &[&str] = &["terms", "weights"];

/// The `passages` columns a corpus is built from, in the order `build` reads them.
pub(super) const PASSAGE_COLUMNS: &[&str] =
    &["event_id", "session_id", "first_event_id", "embedding"];

/// Every table whose version is watched, in a fixed order.
pub const TABLES: [&str; 7] = [
    "interactions",
    "turn_vectors",
    "items",
    "memories",
    "memory_links",
    "prototypes",
    "passages",
];

impl std::fmt::Debug for Tables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tables")
            .field("open", &self.read().keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A SQL string literal.
pub(super) fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `filter` narrowed to the rows at or after (`ts`, `event_id`).
pub(super) fn cut_filter(filter: &str, ts: i64, event_id: &str) -> String {
    let at = chrono::DateTime::from_timestamp_millis(ts).map_or_else(
        || "1970-01-01 00:00:00.000".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
    );
    format!(
        "{filter} AND (`timestamp` > TIMESTAMP '{at}' OR (`timestamp` = TIMESTAMP '{at}' AND event_id >= {}))",
        literal(event_id)
    )
}

pub(super) fn lance_err(context: &str) -> impl FnOnce(lance::Error) -> Error + '_ {
    move |e| Error::lance(context.to_owned())(lancedb::Error::from(e))
}

impl Tables {
    /// Over `db`, keeping the statistics `signals` asks for.
    pub fn new(db: Connection, signals: SignalSources) -> Self {
        Self {
            db,
            open: std::sync::RwLock::new(BTreeMap::new()),
            signals,
        }
    }

    /// Whether users per item are kept, and how often they are re-read.
    pub fn item_cf_interval(&self) -> Option<Duration> {
        self.signals.item_cf
    }

    /// Users per item from every `interactions` row with an item, per
    /// tenant.
    ///
    /// # Errors
    /// LanceDB failures.
    pub async fn item_cf(&self) -> Result<TenantItemCf> {
        let batches = self
            .query(
                "interactions",
                &["user_id", "item_id"],
                Some("item_id IS NOT NULL".to_owned()),
            )
            .await?;
        let separator = self.signals.tenant_separator;
        tokio::task::spawn_blocking(move || {
            let pairs = batches.iter().flat_map(|b| {
                let users = b.column(0).as_string::<i32>();
                let items = b.column(1).as_string::<i32>();
                users.iter().zip(items.iter()).filter_map(|(u, i)| u.zip(i))
            });
            TenantItemCf::new(pairs, separator)
        })
        .await
        .map_err(|e| Error::Internal {
            message: format!("reading the item statistics panicked: {e}"),
        })
    }

    pub(super) fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<&'static str, Table>> {
        self.open
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn table(&self, name: &str) -> Option<Table> {
        self.read().get(name).cloned()
    }

    /// Each table's latest version (0: not created yet). The handles move
    /// to those versions, so later reads see at least them.
    ///
    /// # Errors
    /// LanceDB failures other than a missing table.
    pub async fn versions(&self) -> Result<BTreeMap<&'static str, u64>> {
        let mut out = BTreeMap::new();
        for name in TABLES {
            let t = match self.table(name) {
                Some(t) => t,
                None => match self.db.open_table(name).execute().await {
                    Ok(t) => {
                        self.open
                            .write()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(name, t.clone());
                        t
                    }
                    Err(lancedb::Error::TableNotFound { .. }) => {
                        out.insert(name, 0);
                        continue;
                    }
                    Err(e) => return Err(Error::lance(format!("opening {name}"))(e)),
                },
            };
            t.checkout_latest()
                .await
                .map_err(Error::lance(format!("refreshing {name}")))?;
            let v = t
                .version()
                .await
                .map_err(Error::lance(format!("reading the version of {name}")))?;
            out.insert(name, v);
        }
        Ok(out)
    }

    /// The filter that reads `user_id`'s most recent `max` interactions
    /// (by timestamp, then event id) from any per-user table, and how many
    /// older ones it leaves out. Only the keys are read to find the cut, so
    /// a user with millions of events costs a bounded read and build.
    pub(super) async fn recent(&self, user_id: &str, max: usize) -> Result<(String, usize)> {
        let filter = format!("user_id = {}", literal(user_id));
        let keys = self
            .query(
                "interactions",
                &["timestamp", "event_id"],
                Some(filter.clone()),
            )
            .await?;
        let n: usize = keys.iter().map(RecordBatch::num_rows).sum();
        if n <= max {
            return Ok((filter, 0));
        }
        let mut all: Vec<(i64, &str)> = Vec::with_capacity(n);
        for b in &keys {
            let ts = b.column(0).as_primitive::<TimestampMillisecondType>();
            let ids = b.column(1).as_string::<i32>();
            all.extend((0..b.num_rows()).map(|r| (ts.value(r), ids.value(r))));
        }
        // Ascending, the oldest row kept is at n − max.
        let cut = n - max;
        let (_, &mut (ts, id), _) = all.select_nth_unstable(cut);
        Ok((cut_filter(&filter, ts, id), cut))
    }

    pub(super) async fn query(
        &self,
        name: &str,
        columns: &[&str],
        filter: Option<String>,
    ) -> Result<Vec<RecordBatch>> {
        let Some(t) = self.table(name) else {
            return Ok(Vec::new());
        };
        let mut columns = columns.to_vec();
        if columns.iter().any(|c| ADDED_COLUMNS.contains(c)) {
            let schema = t
                .schema()
                .await
                .map_err(Error::lance(format!("reading the schema of {name}")))?;
            columns.retain(|c| !ADDED_COLUMNS.contains(c) || schema.field_with_name(c).is_ok());
        }
        let columns = &columns;
        let read = || async {
            let mut q = t.query().select(Select::columns(columns));
            if let Some(f) = &filter {
                q = q.only_if(f.clone());
            }
            q.execute().await?.try_collect::<Vec<_>>().await
        };
        match read().await {
            Ok(batches) => Ok(batches),
            // The handle's version may be gone: a forget compacts the tables
            // and prunes their old versions at once, so a read between that
            // and the next refresh finds its files deleted. Move to the
            // latest version and read again, once.
            Err(first) => {
                tracing::debug!(table = name, error = %Chain(&first), "Reading failed; retrying at the latest version.");
                t.checkout_latest()
                    .await
                    .map_err(Error::lance(format!("reading {name}")))?;
                read()
                    .await
                    .map_err(Error::lance(format!("reading {name}")))
            }
        }
    }

    /// Reads the shared part: the catalogue and the published prototypes.
    ///
    /// # Errors
    /// LanceDB failures.
    pub async fn load_shared(&self) -> Result<Snapshot> {
        let mut columns = vec!["item_id", "title", "embedding"];
        if self.signals.item_template.is_some() {
            columns.extend(["categories", "description"]);
        }
        let items = self.query("items", &columns, None).await?;
        let protos = self
            .query(
                "prototypes",
                &[
                    "prototype_id",
                    "content",
                    "embedding",
                    "member_ids",
                    "users",
                ],
                None,
            )
            .await?;
        let template = self.signals.item_template.clone();
        tokio::task::spawn_blocking(move || {
            let mut snap = Snapshot::new(catalogue(&items), prototypes(&protos)?);
            snap.text = template.map(|t| Arc::new(item_texts(&items, &t)));
            Ok(snap)
        })
        .await
        .map_err(|e| Error::Internal {
            message: format!("reading the catalogue panicked: {e}"),
        })?
    }

    /// The rows of `name` that versions after `from` up to the handle's
    /// current one added, rewrote or deleted, projected on `columns`:
    /// read from the fragments each commit touched (for a deletion, the
    /// deleted rows of the version before). Commits that move rows without
    /// changing them (compaction, index updates) are skipped. `None` when
    /// the changes cannot be told (`from` is 0, a version was cleaned up, the
    /// table was overwritten or restored): the caller drops everything.
    ///
    /// # Errors
    /// LanceDB failures reading fragments.
    pub async fn changed_rows(
        &self,
        name: &str,
        from: u64,
        columns: &[&str],
    ) -> Result<Option<Vec<RecordBatch>>> {
        let Some(t) = self.table(name) else {
            return Ok(None);
        };
        let Some(ds) = t.dataset() else {
            return Ok(None);
        };
        let base = ds
            .get()
            .await
            .map_err(Error::lance(format!("opening {name}")))?;
        let to = base.version().version;
        if from == 0 || from > to {
            return Ok(None);
        }
        let ctx = format!("reading the changes of {name}");
        let Ok(mut prev) = base.checkout_version(from).await else {
            return Ok(None);
        };
        let mut out = Vec::new();
        for v in from + 1..=to {
            let Ok(cur) = base.checkout_version(v).await else {
                return Ok(None);
            };
            let op = cur
                .read_transaction()
                .await
                .map_err(lance_err(&ctx))?
                .map(|t| t.operation.name().to_owned());
            match op.as_deref() {
                // Same rows, moved or indexed.
                Some("Rewrite" | "CreateIndex" | "ReserveFragments" | "UpdateConfig") => {}
                Some(
                    "Append" | "Delete" | "Update" | "Merge" | "DataReplacement" | "DataOverlay",
                ) => {
                    fragment_changes(&prev, &cur, columns, &ctx, &mut out).await?;
                }
                _ => return Ok(None),
            }
            prev = cur;
        }
        Ok(Some(out))
    }
}

/// Appends to `out` the rows that differ between two consecutive versions
/// of a dataset, fragment by fragment.
pub(super) async fn fragment_changes(
    prev: &lance::Dataset,
    cur: &lance::Dataset,
    columns: &[&str],
    ctx: &str,
    out: &mut Vec<RecordBatch>,
) -> Result<()> {
    let before: HashMap<u64, _> = prev.fragments().iter().map(|f| (f.id, f)).collect();
    let after: HashSet<u64> = cur.fragments().iter().map(|f| f.id).collect();
    for f in cur.fragments().iter() {
        match before.get(&f.id) {
            None => out.extend(scan_fragment(cur, f.clone(), columns, None, ctx).await?),
            Some(p) if p.files != f.files || p.overlays != f.overlays => {
                out.extend(scan_fragment(cur, f.clone(), columns, None, ctx).await?);
                out.extend(scan_fragment(prev, (*p).clone(), columns, None, ctx).await?);
            }
            Some(p) if p.deletion_file != f.deletion_file => {
                // Rows live before and deleted now.
                let dv = match cur.get_fragment(f.id as usize) {
                    Some(ff) => ff.get_deletion_vector().await.map_err(lance_err(ctx))?,
                    None => None,
                };
                if let Some(dv) = dv {
                    let rows =
                        scan_fragment(prev, (*p).clone(), columns, Some(&|o| dv.contains(o)), ctx)
                            .await?;
                    out.extend(rows);
                }
            }
            Some(_) => {}
        }
    }
    for p in prev.fragments().iter().filter(|p| !after.contains(&p.id)) {
        out.extend(scan_fragment(prev, p.clone(), columns, None, ctx).await?);
    }
    Ok(())
}

/// `columns` of one fragment's live rows; with `keep`, only the rows whose
/// offset in the fragment it accepts.
pub(super) async fn scan_fragment(
    ds: &lance::Dataset,
    fragment: lance::table::format::Fragment,
    columns: &[&str],
    keep: Option<&(dyn Fn(u32) -> bool + Sync)>,
    ctx: &str,
) -> Result<Vec<RecordBatch>> {
    let mut scan = ds.scan();
    scan.with_fragments(vec![fragment])
        .project(columns)
        .map_err(lance_err(ctx))?;
    if keep.is_some() {
        scan.with_row_address();
    }
    let batches: Vec<RecordBatch> = scan
        .try_into_stream()
        .await
        .map_err(lance_err(ctx))?
        .try_collect()
        .await
        .map_err(lance_err(ctx))?;
    let Some(keep) = keep else {
        return Ok(batches);
    };
    let mut out = Vec::with_capacity(batches.len());
    for b in batches {
        let Some(addr) = b.column_by_name("_rowaddr") else {
            return Err(Error::Internal {
                message: format!("{ctx}: a scan with row addresses returned none"),
            });
        };
        let mask: arrow_array::BooleanArray = addr
            .as_primitive::<UInt64Type>()
            .values()
            .iter()
            .map(|&a| Some(keep((a & 0xFFFF_FFFF) as u32)))
            .collect();
        out.push(arrow_select::filter::filter_record_batch(&b, &mask)?);
    }
    Ok(out)
}

/// A fill that read at least this much trims the heap when it is done.
const TRIM_AFTER_READ: usize = 8 << 20;

impl Loader for Tables {
    fn user<'a>(
        &'a self,
        cfg: &'a ServeConfig,
        snap: &'a Snapshot,
        user_id: &'a str,
    ) -> BoxFuture<'a, Result<UserData>> {
        Box::pin(async move {
            let (filter, cut) = self.recent(user_id, cfg.max_user_rows).await?;
            let passages = async {
                if cfg.kinds.contains(&CorpusKind::Passage) {
                    self.query("passages", PASSAGE_COLUMNS, Some(filter.clone()))
                        .await
                } else {
                    Ok(Vec::new())
                }
            };
            let (interactions, turn_vectors, memories, passages) = futures::try_join!(
                self.query("interactions", INTERACTION_COLUMNS, Some(filter.clone())),
                self.query("turn_vectors", TURN_VECTOR_COLUMNS, Some(filter.clone())),
                self.query(
                    "memories",
                    crate::steam::MEMORY_COLUMNS,
                    Some(filter.clone())
                ),
                passages,
            )?;
            // The corpus (sorting, session joins, BM25, k-means for a large
            // user) is CPU work: on a blocking thread, so one large user's
            // fill never holds up the async workers that answer everyone
            // else (and /healthz).
            let (cfg, items, user) = (cfg.clone(), snap.items.clone(), user_id.to_owned());
            tokio::task::spawn_blocking(move || {
                let mut mems = Vec::new();
                // Memories with 63-bit ids wait for `steamrf migrate`.
                for b in memories.iter().filter(|b| !is_legacy(b.column(0))) {
                    mems.extend(crate::steam::memories_from(b)?);
                }
                let rows = UserRows {
                    interactions: &interactions,
                    turn_vectors: &turn_vectors,
                    passages: &passages,
                };
                let mut u = build_user(&cfg, &items, &user, rows, mems)?;
                u.rows_cut = cut;
                // A large user's batches and the build's scratch are freed
                // here, on a blocking thread whose arena keeps them: hand
                // the pages back, as the refresh does after an eviction, so
                // a user rebuilt on every change leaves no pile of free
                // memory per thread (issue 44, item 3; `bench hammer`).
                let read: usize = [&interactions, &turn_vectors, &passages, &memories]
                    .iter()
                    .flat_map(|bs| bs.iter())
                    .map(RecordBatch::get_array_memory_size)
                    .sum();
                drop((interactions, turn_vectors, passages, memories));
                if read >= TRIM_AFTER_READ {
                    crate::alloc::trim();
                }
                Ok(u)
            })
            .await
            .map_err(|e| Error::Internal {
                message: format!("building a user's corpus panicked: {e}"),
            })?
        })
    }

    fn memories<'a>(&'a self, ids: &'a [MemoryId]) -> BoxFuture<'a, Result<Vec<Memory>>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(ids.len());
            for chunk in ids.chunks(1024) {
                let list = sql_list(chunk);
                let batches = self
                    .query(
                        "memories",
                        crate::steam::MEMORY_COLUMNS,
                        Some(format!("memory_id IN ({list})")),
                    )
                    .await?;
                for b in batches.iter().filter(|b| !is_legacy(b.column(0))) {
                    out.extend(crate::steam::memories_from(b)?);
                }
            }
            Ok(out)
        })
    }
}
