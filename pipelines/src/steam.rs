//! The STEAM stage of the pipeline: after a micro-batch's ingest tables are
//! written and before its offsets are committed, evolve the users' memories
//! (formation, consolidation), extract cross-user relations, maintain
//! communities and prototypes, and persist all of it to the `memories`,
//! `memory_links` and `prototypes` tables.
//!
//! This is the in-process mode: one pipeline instance holds every user's
//! memories. Running community maintenance as a separate single writer fed
//! by an internal topic (for several ingest instances) is not built yet; with
//! `steam.enabled`, run one instance.
//!
//! Replays are idempotent: observations whose event is already linked change
//! nothing, and on start the state is restored from the tables.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use arrow_array::builder::{
    FixedSizeListBuilder, Float32Builder, Int32Builder, Int64Builder, ListBuilder, StringBuilder,
    TimestampMillisecondBuilder,
};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Int64Type, TimestampMillisecondType};
use arrow_array::{Array, RecordBatch, RecordBatchIterator};
use futures::TryStreamExt;
use lancedb::Table;
use lancedb::query::{ExecutableQuery, QueryBase, Select};
use steamrf_kernels::SimilarityKernel;
use steamrf_operators::embed::Embedder;
use steamrf_operators::llm::{
    ChatClient, LlmError, MEMORY_PROMPT, PROTOTYPE_PROMPT, echoes, render,
};
use steamrf_operators::steam::memory::{Memory, Observation};
use steamrf_operators::steam::relations::Link;
use steamrf_operators::steam::{ItemFacts, LinkOutcome, MemoryId, SteamParams, SteamState};
use steamrf_schemas::TableBatches;
use steamrf_schemas::memory::MemoryTable;
use steamrf_schemas::tables::{EMBEDDING_DIM, embedding_field};
use steamrf_schemas::tenancy::tenant_of;

use crate::error::{Chain, Error, Result};
use crate::metrics::Metrics;
use crate::sink::ids::{id_lists_array, ids_array, read_id_lists, read_ids, sql_list};
use crate::sink::{ensure_primary_key, open_or_create_named};

/// Attempts at writing one batch's STEAM tables before the pipeline stops.
const PERSIST_ATTEMPTS: u32 = 8;

/// The `items` columns an item's metadata is read from.
const ITEM_COLUMNS: &[&str] = &["item_id", "title", "categories", "embedding"];

/// What one batch did.
#[derive(Debug, Clone, Copy, Default)]
pub struct SteamStats {
    /// Memories formed.
    pub formed: u64,
    /// Consolidations.
    pub consolidated: u64,
    /// Interactions not observed (item unknown or not embedded, no embedding).
    pub skipped: u64,
    /// Links written.
    pub links: u64,
    /// Prototypes written.
    pub prototypes: u64,
}

/// What [`SteamStage::forget`] removed and changed.
#[derive(Debug, Clone, Default)]
pub struct SteamForget {
    /// Rows deleted from `memories`.
    pub memories: u64,
    /// Rows deleted from `memory_links`.
    pub links: u64,
    /// Other users' memories re-linked.
    pub relinked: u64,
    /// Prototypes rebuilt.
    pub prototypes_rebuilt: u64,
    /// Prototypes withdrawn.
    pub prototypes_withdrawn: u64,
    /// What was left to another process, if anything.
    pub note: Option<String>,
}

/// The stage.
pub struct SteamStage {
    state: SteamState,
    kernel: Arc<dyn SimilarityKernel>,
    /// Item embeddings, for observations of clicks and purchases (their
    /// titles and categories are in the state's catalogue).
    items: HashMap<String, Vec<f32>>,
    memories: Table,
    links: Table,
    prototypes: Table,
    embedder: Option<Arc<dyn Embedder>>,
    llm: Option<Arc<ChatClient>>,
    llm_tokens_seen: (u64, u64),
    metrics: Metrics,
    /// Set on ingest instances when communities are kept by a separate
    /// writer (`steam.communities = "topic"`).
    publish: Option<ChangePublisher>,
    /// The community writer: persists links and prototypes, never memories.
    writer: bool,
    /// The catalogue, for items another instance wrote.
    items_table: Option<Table>,
    /// Partition assignments seen (a new one reloads the memories).
    assignments_seen: u64,
    /// Memory rows written since the `memories` indexes were last brought
    /// up to date (see [`MEMORY_REINDEX_ROWS`]).
    memories_unindexed: std::sync::atomic::AtomicU64,
}

/// Memory rows written between updates of the `memories` BTree indexes on
/// `memory_id` (upserts look keys up) and `user_id` (the retrieval service
/// reads one user's memories at a time). Rows written since are scanned.
const MEMORY_REINDEX_ROWS: u64 = 20_000;

/// Publishes changed memories to the internal changes topic, for the
/// community writers (`steamrf communities`).
///
/// Each record is an Arrow IPC stream of rows of the `memories` table (at
/// most [`CHANGES_PER_RECORD`]), so a writer needs no table read to apply it.
/// A tenant's rows and tombstones all go to the partition
/// [`steamrf_schemas::tenancy::shard_of`] names, so they stay in order and
/// one writer keeps each tenant's communities.
pub struct ChangePublisher {
    producer: rdkafka::producer::FutureProducer,
    topic: String,
    partitions: u32,
    tenant_separator: Option<char>,
}

/// Memories per changes record (~1.7 KB each: well under Kafka's 1 MB default).
pub const CHANGES_PER_RECORD: usize = 256;

/// The changes-topic partition of `user_id`'s tenant.
pub fn change_partition(user_id: &str, partitions: u32, separator: Option<char>) -> i32 {
    let tenant = tenant_of(user_id, separator);
    steamrf_schemas::tenancy::shard_of(tenant, partitions) as i32
}

impl ChangePublisher {
    /// A publisher to `topic`, which has `partitions` partitions.
    pub fn new(
        producer: rdkafka::producer::FutureProducer,
        topic: String,
        partitions: u32,
        tenant_separator: Option<char>,
    ) -> Self {
        Self {
            producer,
            topic,
            partitions: partitions.max(1),
            tenant_separator,
        }
    }

    /// Sends `batch` (rows of `memories`), each row to its tenant's
    /// partition, and waits until the broker has every record.
    ///
    /// # Errors
    /// Encoding or delivery failures (retryable).
    pub async fn publish(&self, batch: &RecordBatch) -> Result<usize> {
        let users = batch
            .column_by_name("user_id")
            .ok_or_else(|| Error::Internal {
                message: "a memories batch without user_id".into(),
            })?
            .as_string::<i32>();
        let mut rows: BTreeMap<i32, Vec<u32>> = BTreeMap::new();
        for r in 0..batch.num_rows() {
            let p = change_partition(users.value(r), self.partitions, self.tenant_separator);
            rows.entry(p).or_default().push(r as u32);
        }
        let mut deliveries = Vec::new();
        for (partition, rows) in rows {
            let part = if rows.len() == batch.num_rows() {
                batch.clone()
            } else {
                arrow_select::take::take_record_batch(batch, &arrow_array::UInt32Array::from(rows))?
            };
            let mut start = 0;
            while start < part.num_rows() {
                let len = CHANGES_PER_RECORD.min(part.num_rows() - start);
                let bytes = encode_changes(&part.slice(start, len))?;
                deliveries.push(self.send(partition, &bytes)?);
                start += len;
            }
        }
        let records = deliveries.len();
        for d in deliveries {
            delivered(d).await?;
        }
        Ok(records)
    }

    /// Queues one record to `partition`.
    fn send(&self, partition: i32, bytes: &[u8]) -> Result<rdkafka::producer::DeliveryFuture> {
        let record: rdkafka::producer::FutureRecord<'_, (), [u8]> =
            rdkafka::producer::FutureRecord::to(&self.topic)
                .partition(partition)
                .payload(bytes);
        self.producer
            .send_result(record)
            .map_err(|(e, _)| Error::kafka("queueing a memory change")(e))
    }
}

/// Waits until the broker has a record [`ChangePublisher::send`] queued.
async fn delivered(d: rdkafka::producer::DeliveryFuture) -> Result<()> {
    match d.await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err((e, _))) => Err(Error::kafka("publishing memory changes")(e)),
        Err(_) => Err(Error::Internal {
            message: "the changes producer was dropped".into(),
        }),
    }
}

/// A user forgotten on an ingest instance, published to the changes topic
/// for the community writer, which then deletes the links to and from the
/// user's memories, re-links the memories that pointed at them and rebuilds
/// or withdraws the prototypes they were part of.
///
/// Encoded as JSON (a changes record of memories is an Arrow IPC stream,
/// which never starts with `{`). It carries the ids of the memories the
/// ingest instance deletes, because the writer may restore its state after
/// they are gone from the `memories` table.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tombstone {
    /// The user forgotten.
    pub forget_user: String,
    /// The `forget` event's id, if any.
    pub event_id: Option<String>,
    /// The user's memories the ingest instance deleted.
    pub memory_ids: Vec<MemoryId>,
}

/// One record of the changes topic.
#[derive(Debug)]
pub enum Change {
    /// Memories formed or consolidated (rows of `memories`).
    Memories(Vec<Memory>),
    /// A user forgotten.
    Forget(Tombstone),
}

/// A changes record: a [`Tombstone`] (JSON) or memories (Arrow IPC).
///
/// # Errors
/// A payload that is neither.
pub fn decode_change(bytes: &[u8]) -> Result<Change> {
    if bytes.first() == Some(&b'{') {
        let t = serde_json::from_slice(bytes).map_err(|e| Error::Internal {
            message: format!("a changes record that is not a tombstone: {e}"),
        })?;
        return Ok(Change::Forget(t));
    }
    decode_changes(bytes).map(Change::Memories)
}

impl ChangePublisher {
    /// Sends a tombstone and waits until the broker has it.
    ///
    /// # Errors
    /// Delivery failures (retryable).
    pub async fn publish_forget(&self, t: &Tombstone) -> Result<()> {
        let bytes = serde_json::to_vec(t).map_err(|e| Error::Internal {
            message: format!("encoding a tombstone: {e}"),
        })?;
        let partition = change_partition(&t.forget_user, self.partitions, self.tenant_separator);
        delivered(self.send(partition, &bytes)?).await
    }
}

/// Arrow IPC stream bytes of `batch`.
///
/// # Errors
/// Arrow failures.
pub fn encode_changes(batch: &RecordBatch) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &batch.schema())?;
    w.write(batch)?;
    w.finish()?;
    drop(w);
    Ok(out)
}

/// The memories in one changes record.
///
/// # Errors
/// A payload that is not an IPC stream of `memories` rows.
pub fn decode_changes(bytes: &[u8]) -> Result<Vec<Memory>> {
    let r = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)?;
    let mut out = Vec::new();
    for b in r {
        out.extend(memories_from(&b?)?);
    }
    Ok(out)
}

impl std::fmt::Debug for SteamStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SteamStage")
            .field("memories", &self.state.len())
            .finish_non_exhaustive()
    }
}

fn kernel_err(e: steamrf_kernels::Error) -> Error {
    Error::Internal {
        message: format!("steam: {e}"),
    }
}

async fn scan(table: &Table, columns: &[&str]) -> Result<Vec<RecordBatch>> {
    table
        .query()
        .select(Select::columns(columns))
        .execute()
        .await
        .map_err(Error::lance("scanning"))?
        .try_collect()
        .await
        .map_err(Error::lance("scanning"))
}

fn strings(list: &dyn Array, row: usize) -> Vec<String> {
    let l = list.as_list::<i32>();
    let v = l.value(row);
    v.as_string::<i32>()
        .iter()
        .flatten()
        .map(str::to_owned)
        .collect()
}

/// Row `row` of a `FixedSizeList<Float32>` column (`None` if null), without copying.
pub(crate) fn vector(col: &dyn Array, row: usize) -> Option<&[f32]> {
    let l = col.as_fixed_size_list();
    if l.is_null(row) {
        return None;
    }
    let dim = l.value_length() as usize;
    let start = l.value_offset(row) as usize;
    Some(&l.values().as_primitive::<Float32Type>().values()[start..start + dim])
}

impl SteamStage {
    /// Opens (or creates) the tables and loads the item catalogue, with an
    /// empty state: [`Self::restore`] fills it (every user, or a community
    /// writer's tenants once it knows its partitions).
    ///
    /// # Errors
    /// LanceDB failures, or tables of another schema.
    pub async fn open(
        db: &lancedb::Connection,
        params: SteamParams,
        kernel: Arc<dyn SimilarityKernel>,
        embedder: Option<Arc<dyn Embedder>>,
        llm: Option<Arc<ChatClient>>,
        metrics: Metrics,
        publish: Option<ChangePublisher>,
    ) -> Result<Self> {
        let open = |t: MemoryTable| open_or_create_named(db, t.as_str(), t.schema());
        let memories = open(MemoryTable::Memories).await?;
        ensure_primary_key(&memories, "memory_id").await?;
        let prototypes = open(MemoryTable::Prototypes).await?;
        ensure_primary_key(&prototypes, "prototype_id").await?;
        let mut stage = Self {
            state: SteamState::new(params, EMBEDDING_DIM),
            kernel,
            items: HashMap::new(),
            memories,
            links: open(MemoryTable::MemoryLinks).await?,
            prototypes,
            embedder,
            llm,
            llm_tokens_seen: (0, 0),
            metrics,
            publish,
            writer: false,
            items_table: None,
            assignments_seen: 0,
            // Coverage is unknown after a restart: brought up to date after the first write.
            memories_unindexed: std::sync::atomic::AtomicU64::new(MEMORY_REINDEX_ROWS),
        };
        // Created here if no ingest instance has yet (the community writer
        // may start first). Read before the memories: prototypes are built
        // from the catalogue's titles and categories.
        let items = crate::sink::open_or_create(db, steamrf_schemas::TableName::Items).await?;
        for b in scan(&items, ITEM_COLUMNS).await? {
            stage.remember_items(&b);
        }
        stage.items_table = Some(items);
        Ok(stage)
    }

    /// Restores the state from the latest `memories` and `memory_links`,
    /// keeping the memories (and links from them) of the users `keep`
    /// accepts: every user, or a community writer's tenants. Communities
    /// and prototypes are rebuilt, and stored prototypes brought up to date.
    ///
    /// # Errors
    /// LanceDB failures; see [`load_state`].
    pub async fn restore(&mut self, keep: &(dyn Fn(&str) -> bool + Sync)) -> Result<()> {
        let started = Instant::now();
        for t in [&self.memories, &self.links, &self.prototypes] {
            t.checkout_latest()
                .await
                .map_err(Error::lance(format!("refreshing {}", t.name())))?;
        }
        let empty = self.state.emptied();
        self.state = load_state_where(&self.memories, &self.links, empty, keep).await?;
        let rewritten = if self.publish.is_none() {
            self.reconcile_prototypes().await?
        } else {
            0
        };
        self.record_sizes();
        tracing::info!(
            memories = self.state.len(),
            communities = self.state.communities().count(),
            items = self.items.len(),
            prototypes_rewritten = rewritten,
            took = ?started.elapsed(),
            "STEAM state restored."
        );
        Ok(())
    }

    /// Brings the stored prototypes to what the restored state publishes.
    ///
    /// - Members: a row whose members differ from the rebuilt community's
    ///   is rewritten.
    /// - Content: rows written by a steamrf before 2026-12-05 quoted
    ///   members' own titles and dialogue snippets (docs/security.md).
    ///   Without an LLM a stored content other than the rebuilt
    ///   deterministic one is rewritten; with one, only rows missing from
    ///   the table are written (an LLM text cannot be told from an old one;
    ///   see docs/security.md for a rebuild).
    /// - Ids: communities rebuilt from scratch are named by their smallest
    ///   member, which need not be the name their incremental history gave
    ///   them. A stored prototype that is not the state's but lists a member
    ///   the state holds is such an old name, and is deleted. Prototypes of
    ///   memories the state does not hold (another writer's tenants) are
    ///   left alone.
    ///
    /// On an up-to-date table it writes nothing. Returns the rows written
    /// or deleted.
    async fn reconcile_prototypes(&self) -> Result<usize> {
        // Content and members, as stored.
        let mut stored: HashMap<MemoryId, (String, Vec<MemoryId>)> = HashMap::new();
        let mut renamed: Vec<MemoryId> = Vec::new();
        for b in scan(&self.prototypes, &["prototype_id", "content", "member_ids"]).await? {
            let (ids, content) = (
                read_ids(b.column(0), "prototypes.prototype_id")?,
                b.column(1).as_string::<i32>(),
            );
            for (r, id) in ids.into_iter().enumerate() {
                let members: Vec<MemoryId> = strings(b.column(2), r)
                    .iter()
                    .filter_map(|m| m.parse().ok())
                    .collect();
                if self.state.prototype(id).is_none() {
                    let held = members.iter().any(|&m| self.state.memory(m).is_some());
                    if held {
                        renamed.push(id);
                    }
                    continue;
                }
                stored.insert(id, (content.value(r).to_owned(), members));
            }
        }
        delete_ids(&self.prototypes, "prototype_id", &renamed).await?;
        let stale: Vec<_> = self
            .state
            .prototypes()
            .filter(|p| match stored.get(&p.id) {
                None => true,
                Some((c, members)) => {
                    *members != p.members || (self.llm.is_none() && *c != p.content)
                }
            })
            .filter_map(|p| self.state.published(p.id))
            .collect();
        if stale.is_empty() {
            return Ok(renamed.len());
        }
        let link = LinkOutcome {
            prototypes: stale,
            ..LinkOutcome::default()
        };
        upsert(&self.prototypes, "prototype_id", prototypes_batch(&link)?).await?;
        Ok(renamed.len() + link.prototypes.len())
    }

    fn remember_items(&mut self, b: &RecordBatch) {
        let (Some(id), Some(title), Some(cats), Some(emb)) = (
            b.column_by_name("item_id"),
            b.column_by_name("title"),
            b.column_by_name("categories"),
            b.column_by_name("embedding"),
        ) else {
            return;
        };
        let (id, title) = (id.as_string::<i32>(), title.as_string::<i32>());
        for r in 0..b.num_rows() {
            self.state.learn_item(
                id.value(r),
                ItemFacts {
                    title: title.value(r).to_owned(),
                    categories: strings(cats, r),
                },
            );
            if let Some(embedding) = vector(emb, r).map(<[f32]>::to_vec) {
                self.items.insert(id.value(r).to_owned(), embedding);
            }
        }
    }

    /// Reads the items `b`'s interactions refer to that are not known here
    /// yet from the `items` table (by its key index).
    async fn fetch_unknown_items(&mut self, b: &RecordBatch) -> Result<()> {
        let Some(col) = b.column_by_name("item_id") else {
            return Ok(());
        };
        let col = col.as_string::<i32>();
        let ids: Vec<&str> = (0..b.num_rows())
            .filter(|&r| col.is_valid(r))
            .map(|r| col.value(r))
            .collect();
        self.fetch_items(ids).await
    }

    /// Reads the items among `ids` not in the catalogue here yet from the
    /// `items` table (by its key index).
    async fn fetch_items<'a>(&mut self, ids: impl IntoIterator<Item = &'a str>) -> Result<()> {
        let Some(items) = &self.items_table else {
            return Ok(());
        };
        let mut unknown: Vec<String> = ids
            .into_iter()
            // `remember_items` puts every item it keeps in the catalogue.
            .filter(|i| !self.items.contains_key(*i))
            .map(str::to_owned)
            .collect();
        unknown.sort_unstable();
        unknown.dedup();
        if unknown.is_empty() {
            return Ok(());
        }
        items
            .checkout_latest()
            .await
            .map_err(Error::lance("refreshing items"))?;
        let keys: Vec<&str> = unknown.iter().map(String::as_str).collect();
        let found = crate::sink::lookup(items, "item_id", &keys, ITEM_COLUMNS, None).await?;
        let before = self.items.len();
        for f in &found {
            self.remember_items(f);
        }
        tracing::debug!(
            unknown = unknown.len(),
            found = self.items.len() - before,
            "Items looked up."
        );
        Ok(())
    }

    /// The write-path state.
    pub fn state(&self) -> &SteamState {
        &self.state
    }

    /// Drops every memory, link, community and prototype held (a writer
    /// left without partitions); the catalogue stays.
    pub fn clear_state(&mut self) {
        self.state = self.state.emptied();
    }

    /// Makes this stage the community writer ([`Self::apply_changes`]), its
    /// state [lean](SteamState::lean) (each embedding kept once; no text a
    /// writer does not read). Called before any memory is loaded: memories
    /// held are dropped, the catalogue is kept.
    pub fn into_writer(mut self) -> Self {
        self.writer = true;
        self.state = self.state.emptied().lean();
        self
    }

    /// Runs the write path for one written micro-batch and persists it.
    ///
    /// # Errors
    /// LanceDB or embedding failures; the batch is then not committed.
    pub async fn apply(&mut self, tables: &TableBatches) -> Result<SteamStats> {
        let started = Instant::now();
        let mut stats = SteamStats::default();
        if self.publish.is_some() {
            // Several ingest instances: after a rebalance this one may own
            // users another instance evolved since; their memories are
            // re-read from the table (written before that instance committed).
            let assigned = self.metrics.rebalances.with_label_values(&["assign"]).get();
            if assigned != self.assignments_seen {
                tracing::info!("Partitions assigned: reloading the memories.");
                self.restore(&|_| true).await?;
                self.assignments_seen = assigned;
            }
        }
        if let Some(items) = &tables.items {
            self.remember_items(items);
        }
        let mut changed: Vec<MemoryId> = Vec::new();
        if let Some(p) = &tables.profiles {
            changed.extend(self.profiles(p).await?);
        }
        if self.publish.is_some()
            && let Some(b) = &tables.interactions
        {
            // Other instances write items this one never saw in a batch.
            self.fetch_unknown_items(b).await?;
        }
        let mut batch: Vec<(String, Observation)> = Vec::new();
        if let Some(b) = &tables.interactions {
            let col = |n: &str| {
                b.column_by_name(n).ok_or_else(|| Error::Internal {
                    message: format!("interactions batch lacks {n}"),
                })
            };
            let (event, kind, user) = (
                col("event_id")?.as_string::<i32>(),
                col("kind")?.as_string::<i32>(),
                col("user_id")?.as_string::<i32>(),
            );
            let ts = col("timestamp")?.as_primitive::<TimestampMillisecondType>();
            let (item, role, text) = (
                col("item_id")?.as_string::<i32>(),
                col("role")?.as_string::<i32>(),
                col("text")?.as_string::<i32>(),
            );
            // Each turn's vector, from the batch's `turn_vectors` rows, by
            // (user, event): one event_id may be two users' turns.
            let mut turn_vectors: HashMap<(&str, &str), &[f32]> = HashMap::new();
            if let Some(tv) = &tables.turn_vectors {
                let tv_col = |n: &str| {
                    tv.column_by_name(n)
                        .map(|c| c.as_string::<i32>())
                        .ok_or_else(|| Error::Internal {
                            message: format!("turn_vectors batch lacks {n}"),
                        })
                };
                let (ids, users) = (tv_col("event_id")?, tv_col("user_id")?);
                let emb = tv
                    .column_by_name("embedding")
                    .ok_or_else(|| Error::Internal {
                        message: "turn_vectors batch lacks embedding".into(),
                    })?;
                for r in 0..tv.num_rows() {
                    if let Some(v) = vector(emb, r) {
                        turn_vectors.insert((users.value(r), ids.value(r)), v);
                    }
                }
            }
            for r in 0..b.num_rows() {
                let obs = match kind.value(r) {
                    "dialogue_turn" => {
                        // The user's own words say what they want; the
                        // assistant's do not.
                        if role.is_null(r) || role.value(r) != "user" {
                            continue;
                        }
                        turn_vectors
                            .get(&(user.value(r), event.value(r)))
                            .map(|e| Observation {
                                embedding: e.to_vec(),
                                event_id: event.value(r).to_owned(),
                                timestamp_ms: ts.value(r),
                                item_id: None,
                                title: None,
                                categories: Vec::new(),
                                text: text.is_valid(r).then(|| text.value(r).to_owned()),
                            })
                    }
                    _ => (!item.is_null(r))
                        .then(|| self.items.get(item.value(r)))
                        .flatten()
                        .map(|embedding| {
                            let facts = self.state.item(item.value(r));
                            Observation {
                                event_id: event.value(r).to_owned(),
                                timestamp_ms: ts.value(r),
                                embedding: embedding.clone(),
                                item_id: Some(item.value(r).to_owned()),
                                title: facts.map(|f| f.title.clone()),
                                categories: facts.map(|f| f.categories.clone()).unwrap_or_default(),
                                text: None,
                            }
                        }),
                };
                match obs {
                    Some(o) => batch.push((user.value(r).to_owned(), o)),
                    None => stats.skipped += 1,
                }
            }
        }
        let o = self.state.observe(batch).map_err(kernel_err)?;
        stats.formed = o.formed;
        stats.consolidated = o.consolidated;
        changed.extend(o.changed);
        if changed.is_empty() {
            return Ok(stats);
        }
        // With a separate community writer, linking is its job.
        let mut link = if self.publish.is_some() {
            LinkOutcome::default()
        } else {
            self.state
                .link(self.kernel.as_ref(), &changed)
                .map_err(kernel_err)?
        };
        if self.llm.is_some() {
            self.llm_contents(&changed, &mut link).await;
        }
        stats.links = link.links.len() as u64;
        stats.prototypes = link.prototypes.len() as u64;
        // Every write of `persist` is idempotent (upserts, and link rows
        // replaced per memory), so a retryable failure is retried as a whole.
        self.persist_with_retries(&changed, &link).await?;
        self.record(&stats, &link, started);
        Ok(stats)
    }

    /// The community writer's step (`steamrf communities`): applies memories
    /// changed by the ingest instances, re-links them, maintains the
    /// communities and prototypes, and persists links and prototypes.
    ///
    /// # Errors
    /// LanceDB failures; the changes are then not committed.
    pub async fn apply_changes(&mut self, memories: Vec<Memory>) -> Result<SteamStats> {
        let started = Instant::now();
        let mut stats = SteamStats::default();
        let mut changed: Vec<MemoryId> = Vec::with_capacity(memories.len());
        // Prototypes name the items their users share, from the catalogue:
        // items another instance learned since are read first.
        let ids: BTreeSet<String> = memories
            .iter()
            .flat_map(|m| m.items.iter().cloned())
            .collect();
        self.fetch_items(ids.iter().map(String::as_str)).await?;
        for m in memories {
            changed.push(m.id);
            self.state.restore_memory(m).map_err(kernel_err)?;
        }
        changed.sort_unstable();
        changed.dedup();
        if changed.is_empty() {
            return Ok(stats);
        }
        let mut link = self
            .state
            .link(self.kernel.as_ref(), &changed)
            .map_err(kernel_err)?;
        if self.llm.is_some() {
            self.llm_contents(&[], &mut link).await;
        }
        stats.links = link.links.len() as u64;
        stats.prototypes = link.prototypes.len() as u64;
        self.persist_with_retries(&changed, &link).await?;
        self.record(&stats, &link, started);
        Ok(stats)
    }

    /// The tables this stage writes: memories, memory_links, prototypes in
    /// process; in the scaled-out write path an ingest instance writes only
    /// memories and the community writer only links and prototypes.
    pub(crate) fn tables(&self) -> Vec<&Table> {
        if self.writer {
            vec![&self.links, &self.prototypes]
        } else if self.publish.is_some() {
            vec![&self.memories]
        } else {
            vec![&self.memories, &self.links, &self.prototypes]
        }
    }

    /// Deletes the user's memories and every link to or from them, and
    /// persists what that changed: the re-linked memories' links, rebuilt
    /// and withdrawn prototypes (docs/reliability.md).
    ///
    /// On an ingest instance of the scaled-out write path the links and
    /// prototypes belong to the community writer: this publishes a
    /// [`Tombstone`] (before deleting the memories, so a crash in between
    /// publishes it again) and the writer does the rest when it reads it,
    /// calling this with the tombstone's `known` memory ids.
    ///
    /// # Errors
    /// LanceDB, Kafka or kernel failures.
    pub async fn forget(
        &mut self,
        user_id: &str,
        event_id: Option<&str>,
        known: &[MemoryId],
    ) -> Result<SteamForget> {
        let (gone, mut link) = self
            .state
            .forget_user(self.kernel.as_ref(), user_id)
            .map_err(kernel_err)?;
        let mut out = SteamForget::default();
        let user = crate::sink::admin::quoted(user_id);
        let filter = format!("user_id = {user}");
        if let Some(p) = &self.publish {
            p.publish_forget(&Tombstone {
                forget_user: user_id.to_owned(),
                event_id: event_id.map(str::to_owned),
                memory_ids: gone.clone(),
            })
            .await?;
            // The prototypes the user's memories are members of are
            // withdrawn now, not when the writer reads the tombstone: it may
            // be down for longer than the tombstone lives, and until then
            // they would go on counting the user and naming items the user
            // chose to every other member (docs/security.md). The writer
            // rebuilds them without the user.
            let doomed: Vec<MemoryId> = self
                .prototype_members()
                .await?
                .into_iter()
                .filter(|(_, members)| members.iter().any(|m| gone.contains(m)))
                .map(|(id, _)| id)
                .collect();
            if !doomed.is_empty() {
                let listed = format!("prototype_id IN ({})", sql_list(&doomed));
                out.prototypes_withdrawn =
                    crate::sink::admin::delete_counted(&self.prototypes, &listed).await?;
            }
            out.memories = crate::sink::admin::delete_counted(&self.memories, &filter).await?;
            out.note = Some(
                "steam.communities = \"topic\": the user's memories and the prototypes they were members of are gone; the links go and the prototypes are rebuilt without the user when `steamrf communities` reads the tombstone published to the changes topic (it logs its own receipt)".into(),
            );
            return Ok(out);
        }
        let mut ids: Vec<MemoryId> = gone.iter().chain(known).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        // Prototypes the table still lists a forgotten memory in although
        // the state no longer does (a state restored after the memories were
        // deleted elsewhere, whose communities may carry other ids): each is
        // withdrawn unless its community still has one, and the current
        // prototypes of its surviving members' communities are written.
        for (id, members) in self.prototype_members().await? {
            if !members.iter().any(|m| ids.binary_search(m).is_ok()) {
                continue;
            }
            let mut now: Vec<MemoryId> = members
                .iter()
                .filter_map(|&m| self.state.communities().community_of(m))
                .collect();
            now.sort_unstable();
            now.dedup();
            if self.state.prototype(id).is_none() && !link.prototypes_removed.contains(&id) {
                link.prototypes_removed.push(id);
            }
            for c in now.into_iter().chain([id]) {
                if !link.prototypes.iter().any(|q| q.id == c)
                    && let Some(p) = self.state.published(c)
                {
                    link.prototypes.push(p);
                }
            }
        }
        // Order matters for a crash halfway: the rebuilt prototypes and the
        // re-linked memories first, then the links, the memories last. Until
        // the memories are gone a restart restores the user and the forget
        // runs again in full; after that only the clean-up is left.
        self.llm_contents(&[], &mut link).await;
        let mut relinked: Vec<MemoryId> = link
            .links
            .iter()
            .map(|l| l.from)
            .chain(link.links_removed.iter().map(|l| l.0))
            .collect();
        relinked.sort_unstable();
        relinked.dedup();
        out.relinked = relinked.len() as u64;
        out.prototypes_rebuilt = link.prototypes.len() as u64;
        out.prototypes_withdrawn = link.prototypes_removed.len() as u64;
        self.persist_with_retries(&relinked, &link).await?;
        // Links by user as well as by id: the writer's state may not hold
        // the memories any more, and links are written with both users.
        let mut links = format!("from_user = {user} OR to_user = {user}");
        if !ids.is_empty() {
            let list = sql_list(&ids);
            links.push_str(&format!(" OR from_id IN ({list}) OR to_id IN ({list})"));
        }
        out.links = crate::sink::admin::delete_counted(&self.links, &links).await?;
        if !self.writer {
            out.memories = crate::sink::admin::delete_counted(&self.memories, &filter).await?;
        }
        tracing::debug!(
            user_id,
            memories = ids.len(),
            relinked = relinked.len(),
            "STEAM state forgot a user."
        );
        Ok(out)
    }

    /// Every row of `prototypes`: its id and member memories.
    async fn prototype_members(&self) -> Result<Vec<(MemoryId, Vec<MemoryId>)>> {
        self.prototypes
            .checkout_latest()
            .await
            .map_err(Error::lance("refreshing prototypes"))?;
        let mut out = Vec::new();
        for b in scan(&self.prototypes, &["prototype_id", "member_ids"]).await? {
            let ids = read_ids(b.column(0), "prototypes.prototype_id")?;
            let members = read_id_lists(b.column(1), "prototypes.member_ids")?;
            out.extend(ids.into_iter().zip(members));
        }
        Ok(out)
    }

    /// [`Self::persist`], retried as a whole on retryable errors (every write
    /// in it is idempotent).
    async fn persist_with_retries(&self, changed: &[MemoryId], link: &LinkOutcome) -> Result<()> {
        crate::error::retry(
            PERSIST_ATTEMPTS,
            "Writing the STEAM tables",
            |e| self.metrics.error("steam", e),
            || self.persist(changed, link),
        )
        .await
    }

    /// The communities and prototypes gauges, from the state.
    fn record_sizes(&self) {
        self.metrics
            .steam_communities
            .set(self.state.communities().count() as i64);
        self.metrics
            .steam_prototypes
            .set(self.state.prototypes().count() as i64);
    }

    fn record(&self, stats: &SteamStats, link: &LinkOutcome, started: Instant) {
        self.metrics
            .steam_memories
            .with_label_values(&["formed"])
            .inc_by(stats.formed);
        self.metrics
            .steam_memories
            .with_label_values(&["consolidated"])
            .inc_by(stats.consolidated);
        self.metrics.steam_skipped.inc_by(stats.skipped);
        self.metrics.steam_links.inc_by(stats.links);
        self.metrics.steam_merges.inc_by(link.delta.merges);
        self.metrics.steam_splits.inc_by(link.delta.splits);
        self.record_sizes();
        self.metrics
            .steam_duration
            .observe(started.elapsed().as_secs_f64());
        if !link.extract_time.is_zero() {
            self.metrics
                .kernel_duration
                .observe(link.extract_time.as_secs_f64());
            let largest = self
                .state
                .communities()
                .iter()
                .map(|(_, m)| m.len())
                .max()
                .unwrap_or(0);
            self.metrics.steam_community_size_max.set(largest as i64);
        }
        let op = |d: &str| self.metrics.operator_rows.with_label_values(&["steam", d]);
        op("in").inc_by(stats.formed + stats.consolidated + stats.skipped);
        op("out").inc_by(stats.formed + stats.consolidated);
        self.metrics
            .operator_duration
            .with_label_values(&["steam"])
            .observe(started.elapsed().as_secs_f64());
    }

    /// Rewrites the content of changed memories and prototypes with the LLM.
    /// A call refused by the token budget or failing after retries keeps the
    /// deterministic content (counted as a fallback, logged).
    async fn llm_contents(&mut self, changed: &[MemoryId], link: &mut LinkOutcome) {
        let Some(llm) = self.llm.clone() else { return };
        let mut prompts: Vec<(bool, MemoryId, String)> = Vec::new();
        for &id in changed {
            if let Some(m) = self.state.memory(id)
                && !(m.facets.is_empty() && m.recent.is_empty())
            {
                prompts.push((
                    false,
                    id,
                    render(MEMORY_PROMPT, &m.facets, &m.recent, &m.content),
                ));
            }
        }
        for p in &link.prototypes {
            // Only what enough members share; nothing shared, nothing to say
            // (an LLM given nothing would invent).
            let d = self.state.digest(&p.members, 8);
            if d.titles.is_empty() && d.facets.is_empty() {
                continue;
            }
            prompts.push((
                true,
                p.id,
                render(PROTOTYPE_PROMPT, &d.facets, &d.titles, ""),
            ));
        }
        let calls = prompts.iter().map(|(_, _, p)| {
            let llm = &llm;
            async move {
                let started = Instant::now();
                let r = llm.complete(p).await;
                (r, started.elapsed())
            }
        });
        let results = futures::future::join_all(calls).await;
        for ((is_proto, id, _), (r, took)) in prompts.into_iter().zip(results) {
            self.metrics.llm_duration.observe(took.as_secs_f64());
            let template = if is_proto {
                PROTOTYPE_PROMPT
            } else {
                MEMORY_PROMPT
            };
            let r = r.and_then(|text| {
                if echoes(template, &text) {
                    Err(LlmError::Unusable(format!(
                        "it repeats the prompt instead of summarising: {:?}",
                        text.chars().take(80).collect::<String>()
                    )))
                } else {
                    Ok(text)
                }
            });
            match r {
                Ok(text) => {
                    self.metrics.llm_calls.with_label_values(&["ok"]).inc();
                    if is_proto {
                        self.state.set_prototype_content(id, text.clone());
                        if let Some(p) = link.prototypes.iter_mut().find(|p| p.id == id) {
                            p.content = text;
                        }
                    } else {
                        self.state.set_memory_content(id, text);
                    }
                }
                Err(e) => {
                    self.metrics
                        .llm_calls
                        .with_label_values(&["fallback"])
                        .inc();
                    if !matches!(e, LlmError::BudgetExhausted(_)) {
                        tracing::warn!(error = %Chain(&e), "LLM summary failed; keeping the deterministic content.");
                    }
                }
            }
        }
        let stats = llm.stats();
        let now = (
            stats
                .prompt_tokens
                .load(std::sync::atomic::Ordering::Relaxed),
            stats
                .completion_tokens
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        let (p0, c0) = std::mem::replace(&mut self.llm_tokens_seen, now);
        self.metrics
            .llm_tokens
            .with_label_values(&["prompt"])
            .inc_by(now.0.saturating_sub(p0));
        self.metrics
            .llm_tokens
            .with_label_values(&["completion"])
            .inc_by(now.1.saturating_sub(c0));
    }

    async fn profiles(&mut self, b: &RecordBatch) -> Result<Vec<MemoryId>> {
        let Some(embedder) = &self.embedder else {
            return Ok(Vec::new());
        };
        let (Some(user), Some(event), Some(ts), Some(attrs)) = (
            b.column_by_name("user_id"),
            b.column_by_name("event_id"),
            b.column_by_name("timestamp"),
            b.column_by_name("attributes"),
        ) else {
            return Ok(Vec::new());
        };
        let (user, event, attrs) = (
            user.as_string::<i32>(),
            event.as_string::<i32>(),
            attrs.as_string::<i32>(),
        );
        let ts = ts.as_primitive::<TimestampMillisecondType>();
        let rows: Vec<usize> = (0..b.num_rows()).filter(|&r| attrs.is_valid(r)).collect();
        let texts: Vec<String> = rows
            .iter()
            .map(|&r| format!("User profile: {}", attrs.value(r)))
            .collect();
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let vectors = embedder
            .embed(texts.clone())
            .await
            .map_err(|e| Error::Embed {
                retryable: e.retryable(),
                source: Box::new(e),
            })?;
        let mut out = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            let changed = self
                .state
                .init_profile(
                    user.value(r),
                    event.value(r),
                    ts.value(r),
                    texts[i].clone(),
                    vectors.row(i).to_vec(),
                )
                .map_err(kernel_err)?;
            out.extend(changed);
        }
        Ok(out)
    }

    async fn maybe_reindex_memories(&self, written: u64) -> Result<()> {
        use std::sync::atomic::Ordering;
        if written == 0
            || self
                .memories_unindexed
                .fetch_add(written, Ordering::Relaxed)
                + written
                < MEMORY_REINDEX_ROWS
        {
            return Ok(());
        }
        crate::sink::ensure_btree(&self.memories, &["memory_id", "user_id"]).await?;
        self.memories_unindexed.store(0, Ordering::Relaxed);
        Ok(())
    }

    async fn persist(&self, changed: &[MemoryId], link: &LinkOutcome) -> Result<()> {
        if !self.writer {
            // Memories: the changed ones and those whose community id moved.
            let mut ids: Vec<MemoryId> = changed.to_vec();
            ids.extend(link.delta.moved.iter().copied());
            ids.sort_unstable();
            ids.dedup();
            let mems: Vec<&Memory> = ids.iter().filter_map(|&id| self.state.memory(id)).collect();
            let batch = memories_batch(&mems)?;
            upsert_owned(&self.memories, batch.clone()).await?;
            self.maybe_reindex_memories(batch.num_rows() as u64).await?;
            if let Some(p) = &self.publish {
                // The table first: a change the writer sees is always durable.
                let records = p.publish(&batch).await?;
                tracing::debug!(
                    memories = batch.num_rows(),
                    records,
                    "Memory changes published."
                );
                return Ok(());
            }
        }
        // Links: replace the re-linked memories' links.
        delete_ids(&self.links, "from_id", changed).await?;
        if !link.links.is_empty() {
            let batch = links_batch(&self.state, &link.links)?;
            let schema = batch.schema();
            self.links
                .add(Box::new(RecordBatchIterator::new([Ok(batch)], schema))
                    as Box<dyn arrow_array::RecordBatchReader + Send>)
                .execute()
                .await
                .map_err(Error::lance("writing links"))?;
        }
        delete_ids(&self.prototypes, "prototype_id", &link.prototypes_removed).await?;
        if !link.prototypes.is_empty() {
            upsert(&self.prototypes, "prototype_id", prototypes_batch(link)?).await?;
        }
        Ok(())
    }
}

/// The `memories` columns a [`Memory`] is read back from.
pub(crate) const MEMORY_COLUMNS: &[&str] = &[
    "memory_id",
    "user_id",
    "content",
    "embedding",
    "interaction_ids",
    "item_ids",
    "created_at",
    "updated_at",
    "version",
    "facets",
    "recent",
];

/// The memories in `b` (rows of the `memories` table; columns by name, at
/// least [`MEMORY_COLUMNS`]). Rows without an embedding are skipped.
///
/// # Errors
/// A missing column.
pub fn memories_from(b: &RecordBatch) -> Result<Vec<Memory>> {
    let col = |name: &str| {
        b.column_by_name(name).ok_or_else(|| Error::Internal {
            message: format!("memories batch without column {name}"),
        })
    };
    let id = read_ids(col("memory_id")?, "memories.memory_id")?;
    let user = col("user_id")?.as_string::<i32>();
    let content = col("content")?.as_string::<i32>();
    let emb = col("embedding")?;
    let inter = col("interaction_ids")?;
    let items = col("item_ids")?;
    let created = col("created_at")?.as_primitive::<TimestampMillisecondType>();
    let updated = col("updated_at")?.as_primitive::<TimestampMillisecondType>();
    let version = col("version")?.as_primitive::<Int64Type>();
    let facets = col("facets")?.as_string::<i32>();
    let recent = col("recent")?;
    let mut out = Vec::with_capacity(b.num_rows());
    for (r, id) in id.into_iter().enumerate() {
        let Some(embedding) = vector(emb, r).map(<[f32]>::to_vec) else {
            continue;
        };
        out.push(Memory {
            id,
            user_id: user.value(r).to_owned(),
            content: content.value(r).to_owned(),
            embedding,
            interactions: strings(inter, r),
            items: strings(items, r),
            community: None,
            created_ms: created.value(r),
            updated_ms: updated.value(r),
            version: version.value(r) as u64,
            facets: serde_json::from_str(facets.value(r)).unwrap_or_default(),
            recent: strings(recent, r),
        });
    }
    Ok(out)
}

/// Memories whose ids [`load_state`] checks against the configured key.
const KEY_SAMPLE: usize = 64;

/// Rebuilds a [`SteamState`] from the `memories` and `memory_links` tables
/// into `state` (empty, holding the item catalogue the deterministic
/// prototypes are built from; communities and prototypes recomputed). The
/// pipeline restores its state with it on start and after a rebalance.
///
/// # Errors
/// LanceDB failures; memories written under another `steam.id_key`; links
/// between tenants.
pub async fn load_state(memories: &Table, links: &Table, state: SteamState) -> Result<SteamState> {
    load_state_where(memories, links, state, &|_| true).await
}

/// [`load_state`] for the users `keep` accepts (and the links from their
/// memories): a community writer's tenants.
///
/// # Errors
/// As [`load_state`].
pub async fn load_state_where(
    memories: &Table,
    links: &Table,
    mut state: SteamState,
    keep: &(dyn Fn(&str) -> bool + Sync),
) -> Result<SteamState> {
    let key = state.params().evolve.id_key;
    let (mut checked, mut explained) = (0usize, 0usize);
    for b in scan(memories, MEMORY_COLUMNS).await? {
        for m in memories_from(&b)? {
            if !keep(&m.user_id) {
                continue;
            }
            if checked < KEY_SAMPLE {
                checked += 1;
                let first = m.interactions.first().map(String::as_str);
                explained += usize::from(key.explains(m.id, &m.user_id, first));
            }
            state.restore_memory(m).map_err(kernel_err)?;
        }
    }
    if checked > 0 && explained == 0 {
        // Another key would give the same user and event new ids: every
        // profile memory twice, the old one treated as an interest (linked
        // across users, its attributes in prototypes).
        return Err(Error::Config {
            problems: vec![format!(
                "memories were written under another steam.id_key ({checked} of them checked, none has the id this key gives its user and forming event); set the key the store was written with (STEAMRF__STEAM__ID_KEY), or start a new store"
            )],
        });
    }
    let mut by_from: BTreeMap<MemoryId, Vec<Link>> = BTreeMap::new();
    let separator = state.params().tenant_separator;
    let mut crossing = 0u64;
    for b in scan(
        links,
        &["from_id", "to_id", "score", "from_user", "to_user"],
    )
    .await?
    {
        let from = read_ids(b.column(0), "memory_links.from_id")?;
        let to = read_ids(b.column(1), "memory_links.to_id")?;
        let score = b.column(2).as_primitive::<Float32Type>();
        let (from_user, to_user) = (
            b.column(3).as_string::<i32>(),
            b.column(4).as_string::<i32>(),
        );
        for r in 0..b.num_rows() {
            if tenant_of(from_user.value(r), separator) != tenant_of(to_user.value(r), separator) {
                crossing += 1;
            }
            if !keep(from_user.value(r)) {
                continue;
            }
            by_from.entry(from[r]).or_default().push(Link {
                from: from[r],
                to: to[r],
                score: score.value(r),
            });
        }
    }
    if crossing > 0 {
        // Written under another `tenancy.separator` (or before one was
        // set): restored, these links would join communities across
        // tenants, and their prototypes would speak of one tenant's users
        // to another's.
        return Err(Error::Config {
            problems: vec![crossing_tenants(crossing, separator)],
        });
    }
    for (from, links) in by_from {
        state.restore_links(from, links);
    }
    state.rebuild();
    Ok(state)
}

/// The start-up refusal for `n` stored links between tenants.
fn crossing_tenants(n: u64, separator: Option<char>) -> String {
    format!(
        "memory_links holds {n} links between users of different tenants under \
         tenancy.separator = {separator:?} (tables written under another separator, \
         or before one was set); stop every ingest instance and the community writer \
         and run `steamrf migrate` (same config): it deletes those links and the \
         prototypes built across them, and the STEAM stage rebuilds its communities"
    )
}

/// Deletes the rows whose `column` is one of `ids` (nothing when empty).
async fn delete_ids(table: &Table, column: &str, ids: &[MemoryId]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    table
        .delete(&format!("{column} IN ({})", sql_list(ids)))
        .await
        .map_err(Error::lance(format!("deleting from {}", table.name())))?;
    Ok(())
}

/// Upserts memories by `memory_id`, never over a row another user owns: a
/// colliding id (forged, or by chance, or formed by another instance that
/// had not seen the stored one) leaves the stored memory and its owner as
/// they were. The owners are read first (through the `memory_id` index); a
/// row another instance writes between that read and the upsert is not
/// seen (each instance's state refuses such ids too).
async fn upsert_owned(table: &Table, batch: RecordBatch) -> Result<()> {
    if batch.num_rows() == 0 {
        return Ok(());
    }
    let col = |n: &str| {
        batch.column_by_name(n).ok_or_else(|| Error::Internal {
            message: format!("a memories batch lacks {n}"),
        })
    };
    let (ids, users) = (
        read_ids(col("memory_id")?, "a memories batch")?,
        col("user_id")?.as_string::<i32>(),
    );
    let stored: Vec<RecordBatch> = table
        .query()
        .only_if(format!("memory_id IN ({})", sql_list(&ids)))
        .select(Select::columns(&["memory_id", "user_id"]))
        .execute()
        .await
        .map_err(Error::lance("reading memory owners"))?
        .try_collect()
        .await
        .map_err(Error::lance("reading memory owners"))?;
    let mut owner: HashMap<MemoryId, String> = HashMap::new();
    for b in &stored {
        let (i, u) = (
            read_ids(b.column(0), "memories.memory_id")?,
            b.column(1).as_string::<i32>(),
        );
        for (r, id) in i.into_iter().enumerate() {
            owner.insert(id, u.value(r).to_owned());
        }
    }
    let keep: Vec<u32> = (0..batch.num_rows())
        .filter(|&r| owner.get(&ids[r]).is_none_or(|o| o == users.value(r)))
        .map(|r| r as u32)
        .collect();
    if keep.len() < batch.num_rows() {
        tracing::warn!(
            refused = batch.num_rows() - keep.len(),
            "Memories whose ids another user holds in the table were not written."
        );
    }
    let batch =
        arrow_select::take::take_record_batch(&batch, &arrow_array::UInt32Array::from(keep))?;
    upsert(table, "memory_id", batch).await
}

async fn upsert(table: &Table, key: &str, batch: RecordBatch) -> Result<()> {
    if batch.num_rows() == 0 {
        return Ok(());
    }
    let mut merge = table.merge_insert(&[key]);
    merge
        .when_matched_update_all(None)
        .when_not_matched_insert_all();
    let schema = batch.schema();
    merge
        .execute(Box::new(RecordBatchIterator::new([Ok(batch)], schema)))
        .await
        .map_err(Error::lance(format!("writing {}", table.name())))?;
    Ok(())
}

fn embedding_builder(n: usize) -> FixedSizeListBuilder<Float32Builder> {
    FixedSizeListBuilder::with_capacity(
        Float32Builder::with_capacity(n * EMBEDDING_DIM),
        EMBEDDING_DIM as i32,
        n,
    )
    .with_field(match embedding_field().data_type() {
        arrow_schema::DataType::FixedSizeList(item, _) => item.clone(),
        other => unreachable!("the embedding column is a FixedSizeList, not {other}"),
    })
}

pub(crate) fn memories_batch(mems: &[&Memory]) -> Result<RecordBatch> {
    let n = mems.len();
    let mut user = StringBuilder::new();
    let mut content = StringBuilder::new();
    let mut emb = embedding_builder(n);
    let mut inter = ListBuilder::new(StringBuilder::new());
    let mut items = ListBuilder::new(StringBuilder::new());
    let mut community = StringBuilder::new();
    let mut created = TimestampMillisecondBuilder::with_capacity(n);
    let mut updated = TimestampMillisecondBuilder::with_capacity(n);
    let mut version = Int64Builder::with_capacity(n);
    let mut support = Int64Builder::with_capacity(n);
    let mut facets = StringBuilder::new();
    let mut recent = ListBuilder::new(StringBuilder::new());
    for m in mems {
        user.append_value(&m.user_id);
        content.append_value(&m.content);
        emb.values().append_slice(&m.embedding);
        emb.append(true);
        for e in &m.interactions {
            inter.values().append_value(e);
        }
        inter.append(true);
        for i in &m.items {
            items.values().append_value(i);
        }
        items.append(true);
        community.append_option(m.community.map(|c| c.to_string()));
        created.append_value(m.created_ms);
        updated.append_value(m.updated_ms);
        version.append_value(m.version as i64);
        support.append_value(m.support() as i64);
        facets.append_value(serde_json::to_string(&m.facets).unwrap_or_else(|_| "{}".into()));
        for r in &m.recent {
            recent.values().append_value(r);
        }
        recent.append(true);
    }
    Ok(RecordBatch::try_new(
        MemoryTable::Memories.schema(),
        vec![
            Arc::new(ids_array(mems.iter().map(|m| m.id))),
            Arc::new(user.finish()),
            Arc::new(content.finish()),
            Arc::new(emb.finish()),
            Arc::new(inter.finish()),
            Arc::new(items.finish()),
            Arc::new(community.finish()),
            Arc::new(created.finish().with_timezone("UTC")),
            Arc::new(updated.finish().with_timezone("UTC")),
            Arc::new(version.finish()),
            Arc::new(support.finish()),
            Arc::new(facets.finish()),
            Arc::new(recent.finish()),
        ],
    )?)
}

fn links_batch(state: &SteamState, links: &[Link]) -> Result<RecordBatch> {
    let mut from_user = StringBuilder::new();
    let mut to_user = StringBuilder::new();
    let mut score = Float32Builder::new();
    for l in links {
        from_user.append_value(state.memory(l.from).map_or("", |m| m.user_id.as_str()));
        to_user.append_value(state.memory(l.to).map_or("", |m| m.user_id.as_str()));
        score.append_value(l.score);
    }
    Ok(RecordBatch::try_new(
        MemoryTable::MemoryLinks.schema(),
        vec![
            Arc::new(ids_array(links.iter().map(|l| l.from))),
            Arc::new(ids_array(links.iter().map(|l| l.to))),
            Arc::new(from_user.finish()),
            Arc::new(to_user.finish()),
            Arc::new(score.finish()),
        ],
    )?)
}

fn prototypes_batch(link: &LinkOutcome) -> Result<RecordBatch> {
    let n = link.prototypes.len();
    let mut content = StringBuilder::new();
    let mut emb = embedding_builder(n);
    let mut users = Int32Builder::with_capacity(n);
    for p in &link.prototypes {
        content.append_value(&p.content);
        emb.values().append_slice(&p.embedding);
        emb.append(true);
        users.append_value(p.users as i32);
    }
    Ok(RecordBatch::try_new(
        MemoryTable::Prototypes.schema(),
        vec![
            Arc::new(ids_array(link.prototypes.iter().map(|p| p.id))),
            Arc::new(content.finish()),
            Arc::new(emb.finish()),
            Arc::new(id_lists_array(
                link.prototypes.iter().map(|p| p.members.as_slice()),
            )),
            Arc::new(users.finish()),
        ],
    )?)
}

/// The chat client for memory and prototype contents (`None`: no URL).
///
/// # Errors
/// [`Error::Config`] for unusable options.
pub fn llm_client(config: &crate::config::Config) -> Result<Option<Arc<ChatClient>>> {
    config
        .steam
        .llm
        .options()
        .map(|opts| {
            ChatClient::new(opts)
                .map(Arc::new)
                .map_err(|e| Error::Config {
                    problems: vec![format!("steam.llm: {e}")],
                })
        })
        .transpose()
}

/// The relation-extraction kernel (`steam.kernel`), exported as a metric.
///
/// # Errors
/// [`Error::Config`] when the chosen backend cannot run.
pub fn kernel(
    config: &crate::config::Config,
    metrics: &Metrics,
) -> Result<Arc<dyn SimilarityKernel>> {
    let kernel = steamrf_kernels::cuda::select(
        config.steam.kernel,
        config.steam.precision,
        config.steam.cpu_precision,
        config.steam.rescore,
    )
    .map_err(|e| Error::Config {
        problems: vec![format!("steam.kernel: {e}")],
    })?;
    metrics
        .kernel_backend
        .with_label_values(&[kernel.backend().as_str()])
        .set(1);
    Ok(relation_index(&config.steam, kernel))
}

/// `kernel` behind the IVF of `steam.relation_index`, or as it is.
pub fn relation_index(
    steam: &crate::config::SteamConfig,
    kernel: Arc<dyn SimilarityKernel>,
) -> Arc<dyn SimilarityKernel> {
    use crate::config::RelationIndex;
    use steamrf_kernels::ivf::{IvfKernel, IvfKernelParams};
    let on_cpu = kernel.backend() == steamrf_kernels::Backend::Cpu;
    match steam.relation_index {
        RelationIndex::Exact => kernel,
        RelationIndex::Auto if !on_cpu => kernel,
        RelationIndex::Auto | RelationIndex::Ivf => {
            // The lists are scored as the exhaustive CPU kernel scores
            // (`steam.cpu_precision`).
            let int8 = steam.cpu_precision.int8();
            let params = IvfKernelParams {
                lists: steam.ivf_lists,
                probes: steam.ivf_probes,
                min_rows: steam.ivf_min_memories,
                int8_rescore: int8.then_some(steam.rescore),
                ..IvfKernelParams::default()
            };
            tracing::info!(
                lists = params.lists,
                probes = params.probes,
                min_memories = params.min_rows,
                precision = if int8 { "int8" } else { "f32" },
                "Relation extraction: IVF over the memories (exact below min_memories)."
            );
            Arc::new(IvfKernel::new(params, kernel))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn memory(id: u64, user: &str) -> Memory {
        Memory {
            id: MemoryId(u128::from(id) << 64 | u128::from(id)),
            user_id: user.into(),
            content: format!("Interested in Jazz ({id})"),
            embedding: (0..EMBEDDING_DIM)
                .map(|i| (i as f32 + id as f32).sin())
                .collect(),
            interactions: vec![format!("e{id}"), format!("f{id}")],
            items: vec!["jazz1".into()],
            community: None,
            created_ms: 1_000,
            updated_ms: 2_000 + id as i64,
            version: 3,
            facets: BTreeMap::from([("Jazz".to_owned(), 2)]),
            recent: vec!["Blue Train".into()],
        }
    }

    #[test]
    fn memory_changes_round_trip_through_arrow_ipc() {
        let mems: Vec<Memory> = (0..(CHANGES_PER_RECORD as u64 + 3))
            .map(|i| memory(i, if i % 2 == 0 { "ann" } else { "acme:ben" }))
            .collect();
        let refs: Vec<&Memory> = mems.iter().collect();
        let batch = memories_batch(&refs).unwrap();
        // What the publisher sends: one record per CHANGES_PER_RECORD rows.
        let mut back = Vec::new();
        let mut start = 0;
        while start < batch.num_rows() {
            let len = CHANGES_PER_RECORD.min(batch.num_rows() - start);
            let bytes = encode_changes(&batch.slice(start, len)).unwrap();
            match decode_change(&bytes).unwrap() {
                Change::Memories(m) => back.extend(m),
                Change::Forget(t) => panic!("memories read as a tombstone: {t:?}"),
            }
            start += len;
        }
        // Memories are normalised on the way into the state, not here.
        assert_eq!(back, mems);
        assert!(decode_changes(b"not arrow").is_err());
        assert!(decode_change(b"not arrow").is_err());
        assert!(decode_change(b"{\"not\":\"a tombstone\"}").is_err());
    }

    #[test]
    fn tombstones_share_the_changes_topic_with_memories() {
        let t = Tombstone {
            forget_user: "acme:o'brien".into(),
            event_id: Some("e-1".into()),
            memory_ids: vec![MemoryId(1), MemoryId(u128::MAX)],
        };
        let bytes = serde_json::to_vec(&t).unwrap();
        match decode_change(&bytes).unwrap() {
            Change::Forget(back) => assert_eq!(back, t),
            Change::Memories(m) => panic!("a tombstone read as memories: {m:?}"),
        }
    }
}
