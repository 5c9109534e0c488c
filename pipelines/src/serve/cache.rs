//! The service's in-memory view of the tables: one searchable corpus per
//! user, the STEAM state (for the local-to-global step and `recommend`),
//! and the item catalogue.
//!
//! A [`Snapshot`] is immutable. The refresh task checks the tables' versions
//! every `serve.refresh_interval`; when one changed, it reads the tables,
//! builds a new snapshot off the async runtime and swaps it in. Requests
//! hold an `Arc` of the snapshot they started with, so a reader never waits
//! for a refresh and never sees half of one, and the pipeline's writes never
//! wait for readers (LanceDB readers read immutable versions).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, TimestampMillisecondType};
use arrow_array::{Array, RecordBatch};
use futures::TryStreamExt;
use lancedb::query::{ExecutableQuery, QueryBase, Select};
use lancedb::{Connection, Table};
use serde::Serialize;
use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::IvfParams;
use steamrf_operators::rfmem::VectorStore;
use steamrf_operators::steam::{SteamParams, SteamState};
use steamrf_schemas::tables::EMBEDDING_DIM;

use crate::config::{CorpusKind, ServeConfig};
use crate::error::{Error, Result};
use crate::steam::vector;

/// What a corpus row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// An atomic memory.
    Memory,
    /// One dialogue turn.
    Dialogue,
    /// A dialogue session (its turns).
    Session,
    /// A click or purchase.
    Interaction,
}

/// One searchable row of a user's corpus.
#[derive(Debug, Clone)]
pub struct Entry {
    /// What it is.
    pub kind: EntryKind,
    /// Its key in its table (memory id, event id, session id).
    pub id: String,
    /// Its text.
    pub content: String,
    /// The table it comes from.
    pub table: &'static str,
    /// The events it was made from.
    pub source_event_ids: Vec<String>,
    /// Kafka partition and offset of its (first) source event, when known.
    pub source: Option<(i32, i64)>,
}

/// One user's corpus.
#[derive(Debug)]
pub struct UserCorpus {
    /// Row `i` of `store` is `entries[i]`.
    pub entries: Vec<Entry>,
    /// The vectors.
    pub store: VectorStore,
}

/// An item of the catalogue.
#[derive(Debug, Clone)]
pub struct ItemInfo {
    /// Its title.
    pub title: String,
    /// Its embedding (unit length).
    pub embedding: Vec<f32>,
}

/// An immutable view of the tables.
#[derive(Debug)]
pub struct Snapshot {
    /// Per user.
    pub users: HashMap<String, Arc<UserCorpus>>,
    /// Memories, links, communities, prototypes.
    pub steam: SteamState,
    /// The catalogue (items with an embedding).
    pub items: HashMap<String, ItemInfo>,
    /// The table versions it was read from (absent tables: 0).
    pub versions: BTreeMap<&'static str, u64>,
    /// How long reading and building took.
    pub load_time: Duration,
}

impl Snapshot {
    /// An empty snapshot (before the first load).
    pub fn empty(params: SteamParams) -> Self {
        Self {
            users: HashMap::new(),
            steam: SteamState::new(params, EMBEDDING_DIM),
            items: HashMap::new(),
            versions: BTreeMap::new(),
            load_time: Duration::ZERO,
        }
    }

    /// Rows over every user.
    pub fn rows(&self) -> usize {
        self.users.values().map(|u| u.entries.len()).sum()
    }
}

/// The tables the service reads (opened once they exist).
pub struct Tables {
    db: Connection,
    open: BTreeMap<&'static str, Table>,
}

/// The `interactions` columns a corpus is built from, in the order `build` reads them.
const INTERACTION_COLUMNS: &[&str] = &[
    "event_id",
    "kind",
    "user_id",
    "timestamp",
    "item_id",
    "session_id",
    "role",
    "text",
    "embedding",
    "source_partition",
    "source_offset",
];

/// Every table read, in a fixed order.
pub const TABLES: [&str; 5] = [
    "interactions",
    "items",
    "memories",
    "memory_links",
    "prototypes",
];

impl std::fmt::Debug for Tables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tables")
            .field("open", &self.open.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Tables {
    /// Over `db`.
    pub fn new(db: Connection) -> Self {
        Self {
            db,
            open: BTreeMap::new(),
        }
    }

    /// Each table's latest version (0: not created yet).
    ///
    /// # Errors
    /// LanceDB failures other than a missing table.
    pub async fn versions(&mut self) -> Result<BTreeMap<&'static str, u64>> {
        let mut out = BTreeMap::new();
        for name in TABLES {
            if !self.open.contains_key(name) {
                match self.db.open_table(name).execute().await {
                    Ok(t) => {
                        self.open.insert(name, t);
                    }
                    Err(lancedb::Error::TableNotFound { .. }) => {
                        out.insert(name, 0);
                        continue;
                    }
                    Err(e) => return Err(Error::lance(format!("opening {name}"))(e)),
                }
            }
            let t = &self.open[name];
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

    async fn scan(&self, name: &str, columns: &[&str]) -> Result<Vec<RecordBatch>> {
        let Some(t) = self.open.get(name) else {
            return Ok(Vec::new());
        };
        t.query()
            .select(Select::columns(columns))
            .execute()
            .await
            .map_err(Error::lance(format!("scanning {name}")))?
            .try_collect()
            .await
            .map_err(Error::lance(format!("scanning {name}")))
    }

    /// Reads everything the service needs and builds a snapshot (the CPU
    /// part on a blocking thread).
    ///
    /// # Errors
    /// LanceDB failures.
    pub async fn load(
        &mut self,
        cfg: &ServeConfig,
        params: SteamParams,
        versions: BTreeMap<&'static str, u64>,
    ) -> Result<Snapshot> {
        let started = Instant::now();
        let interactions = self.scan("interactions", INTERACTION_COLUMNS).await?;
        let items = self
            .scan("items", &["item_id", "title", "embedding"])
            .await?;
        let steam = match (self.open.get("memories"), self.open.get("memory_links")) {
            (Some(m), Some(l)) => crate::steam::load_state(m, l, params).await?,
            _ => SteamState::new(params, EMBEDDING_DIM),
        };
        let prototypes = self
            .scan("prototypes", &["prototype_id", "content"])
            .await?;
        let cfg = cfg.clone();
        let mut snap = tokio::task::spawn_blocking(move || {
            build(&cfg, steam, &interactions, &items, &prototypes, versions)
        })
        .await
        .map_err(|e| Error::Internal {
            message: format!("snapshot build panicked: {e}"),
        })??;
        snap.load_time = started.elapsed();
        Ok(snap)
    }
}

fn opt_str(col: &dyn Array, row: usize) -> Option<&str> {
    let s = col.as_string::<i32>();
    (!s.is_null(row)).then(|| s.value(row))
}

struct Row {
    entry: Entry,
    vector: Vec<f32>,
    ts: i64,
}

struct Turn {
    ts: i64,
    event_id: String,
    content: String,
    vector: Vec<f32>,
    source: Option<(i32, i64)>,
}

#[derive(Default)]
struct Session {
    turns: Vec<Turn>,
}

fn build(
    cfg: &ServeConfig,
    mut steam: SteamState,
    interactions: &[RecordBatch],
    items: &[RecordBatch],
    prototypes: &[RecordBatch],
    versions: BTreeMap<&'static str, u64>,
) -> Result<Snapshot> {
    let want = |k: CorpusKind| cfg.kinds.contains(&k);
    let mut catalogue = HashMap::new();
    for b in items {
        let id = b.column(0).as_string::<i32>();
        let title = b.column(1).as_string::<i32>();
        for r in 0..b.num_rows() {
            if let Some(e) = vector(b.column(2), r) {
                catalogue.insert(
                    id.value(r).to_owned(),
                    ItemInfo {
                        title: title.value(r).to_owned(),
                        embedding: e.to_vec(),
                    },
                );
            }
        }
    }
    for b in prototypes {
        let id = b.column(0).as_primitive::<Int64Type>();
        let content = b.column(1).as_string::<i32>();
        for r in 0..b.num_rows() {
            // The table holds LLM-written contents when an LLM is configured.
            steam.set_prototype_content(id.value(r) as u64, content.value(r).to_owned());
        }
    }
    let mut rows: HashMap<String, Vec<Row>> = HashMap::new();
    let mut sessions: BTreeMap<(String, String), Session> = BTreeMap::new();
    for b in interactions {
        let event = b.column(0).as_string::<i32>();
        let kind = b.column(1).as_string::<i32>();
        let user = b.column(2).as_string::<i32>();
        let ts = b.column(3).as_primitive::<TimestampMillisecondType>();
        let part = b.column(9).as_primitive::<Int32Type>();
        let offset = b.column(10).as_primitive::<Int64Type>();
        for r in 0..b.num_rows() {
            let source = Some((part.value(r), offset.value(r)));
            let user_id = user.value(r);
            if let (Some(text), Some(e)) = (opt_str(b.column(7), r), vector(b.column(8), r)) {
                if !want(CorpusKind::Dialogue) {
                    continue;
                }
                let role = opt_str(b.column(6), r).unwrap_or("user");
                let content = format!("{role}: {text}");
                if cfg.group_sessions
                    && let Some(s) = opt_str(b.column(5), r)
                {
                    sessions
                        .entry((user_id.to_owned(), s.to_owned()))
                        .or_default()
                        .turns
                        .push(Turn {
                            ts: ts.value(r),
                            event_id: event.value(r).to_owned(),
                            content,
                            vector: e.to_vec(),
                            source,
                        });
                    continue;
                }
                rows.entry(user_id.to_owned()).or_default().push(Row {
                    entry: Entry {
                        kind: EntryKind::Dialogue,
                        id: event.value(r).to_owned(),
                        content,
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                    },
                    vector: e.to_vec(),
                    ts: ts.value(r),
                });
            } else if let Some(item) = opt_str(b.column(4), r) {
                if !want(CorpusKind::Interaction) {
                    continue;
                }
                let Some(info) = catalogue.get(item) else {
                    continue;
                };
                rows.entry(user_id.to_owned()).or_default().push(Row {
                    entry: Entry {
                        kind: EntryKind::Interaction,
                        id: event.value(r).to_owned(),
                        content: format!("{}: {}", kind.value(r), info.title),
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                    },
                    vector: info.embedding.clone(),
                    ts: ts.value(r),
                });
            }
        }
    }
    for ((user, session), mut s) in sessions {
        s.turns
            .sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.event_id.cmp(&b.event_id)));
        let mut v = vec![0.0f32; EMBEDDING_DIM];
        for t in &s.turns {
            v.iter_mut().zip(&t.vector).for_each(|(a, b)| *a += b);
        }
        rows.entry(user).or_default().push(Row {
            entry: Entry {
                kind: EntryKind::Session,
                id: session,
                content: s
                    .turns
                    .iter()
                    .map(|t| t.content.as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
                table: "interactions",
                source_event_ids: s.turns.iter().map(|t| t.event_id.clone()).collect(),
                source: s.turns.first().and_then(|t| t.source),
            },
            vector: v,
            ts: s.turns.first().map_or(0, |t| t.ts),
        });
    }
    if want(CorpusKind::Memory) {
        let users: Vec<String> = steam.user_ids().map(str::to_owned).collect();
        for u in users {
            let Some(mems) = steam.user(&u) else {
                continue;
            };
            for m in &mems.memories {
                rows.entry(u.clone()).or_default().push(Row {
                    entry: Entry {
                        kind: EntryKind::Memory,
                        id: m.id.to_string(),
                        content: m.content.clone(),
                        table: "memories",
                        source_event_ids: m.interactions.clone(),
                        source: None,
                    },
                    vector: m.embedding.clone(),
                    ts: m.created_ms,
                });
            }
        }
    }
    let kernel = CpuKernel {
        threads: cfg.search_threads,
        ..CpuKernel::default()
    };
    let builder = CpuKernel::default();
    let mut users = HashMap::with_capacity(rows.len());
    for (user, mut list) in rows {
        // A stable row order: by time, then id.
        list.sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.entry.id.cmp(&b.entry.id)));
        let mut flat = Vec::with_capacity(list.len() * EMBEDDING_DIM);
        let mut entries = Vec::with_capacity(list.len());
        for r in list {
            flat.extend_from_slice(&r.vector);
            entries.push(r.entry);
        }
        let corpus = Corpus::from_vec(flat, EMBEDDING_DIM).map_err(internal)?;
        let store = if entries.len() >= cfg.ivf_min_rows {
            VectorStore::ivf(
                corpus,
                &IvfParams {
                    probes: cfg.ivf_probes,
                    ..IvfParams::default()
                },
                builder,
            )
            .map_err(internal)?
        } else {
            VectorStore::flat(corpus, kernel)
        };
        users.insert(user, Arc::new(UserCorpus { entries, store }));
    }
    Ok(Snapshot {
        users,
        steam,
        items: catalogue,
        versions,
        load_time: Duration::ZERO,
    })
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: format!("building the retrieval snapshot: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use steamrf_schemas::tables::with_embeddings;
    use steamrf_schemas::{Provenance, TableBuilders, decode};

    use super::*;
    use crate::config::Config;

    fn project(b: &RecordBatch, names: &[&str]) -> RecordBatch {
        let idx: Vec<usize> = names
            .iter()
            .map(|n| b.schema().index_of(n).unwrap())
            .collect();
        b.project(&idx).unwrap()
    }

    fn axis(i: usize) -> Vec<f32> {
        let mut v = vec![0.0; EMBEDDING_DIM];
        v[i] = 1.0;
        v
    }

    /// Dialogue turns (two sessions), a click on an embedded item and one
    /// on an unknown item, as the tables hold them.
    fn tables() -> (RecordBatch, RecordBatch) {
        let events = [
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t2","timestamp":2000,"user_id":"u","session_id":"s1","role":"assistant","text":"Try Blue Train."}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t1","timestamp":1000,"user_id":"u","session_id":"s1","role":"user","text":"More Coltrane?"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t3","timestamp":3000,"user_id":"u","session_id":"s2","role":"user","text":"My cat is Miles."}"#,
            r#"{"type":"click","schema_version":1,"event_id":"c1","timestamp":4000,"user_id":"u","item_id":"i1"}"#,
            r#"{"type":"click","schema_version":1,"event_id":"c2","timestamp":5000,"user_id":"u","item_id":"nope"}"#,
            r#"{"type":"item","schema_version":1,"event_id":"it","timestamp":10,"item_id":"i1","title":"Blue Train"}"#,
        ];
        let mut b = TableBuilders::default();
        for (i, e) in events.iter().enumerate() {
            let p = Provenance {
                partition: 0,
                offset: i as i64,
                ingested_at_ms: 0,
            };
            b.append(&decode(e.as_bytes()).unwrap(), p);
        }
        let t = b.finish().unwrap();
        let mut vecs = axis(0);
        vecs.extend(axis(1));
        vecs.extend(axis(2));
        let inter = with_embeddings(&t.interactions.unwrap(), &[0, 1, 2], &vecs).unwrap();
        let items = with_embeddings(&t.items.unwrap(), &[0], &axis(3)).unwrap();
        (
            project(&inter, INTERACTION_COLUMNS),
            project(&items, &["item_id", "title", "embedding"]),
        )
    }

    fn load(group_sessions: bool) -> Snapshot {
        let mut cfg = Config::load_with_env(None, []).unwrap().serve;
        cfg.group_sessions = group_sessions;
        let (inter, items) = tables();
        let steam = SteamState::new(SteamParams::default(), EMBEDDING_DIM);
        build(&cfg, steam, &[inter], &[items], &[], BTreeMap::new()).unwrap()
    }

    #[test]
    fn turns_and_interactions_become_rows_with_provenance() {
        let s = load(false);
        let u = &s.users["u"];
        let rows: Vec<(EntryKind, &str, &str)> = u
            .entries
            .iter()
            .map(|e| (e.kind, e.id.as_str(), e.content.as_str()))
            .collect();
        // In time order; the click on an item without an embedding is not searchable.
        assert_eq!(
            rows,
            [
                (EntryKind::Dialogue, "t1", "user: More Coltrane?"),
                (EntryKind::Dialogue, "t2", "assistant: Try Blue Train."),
                (EntryKind::Dialogue, "t3", "user: My cat is Miles."),
                (EntryKind::Interaction, "c1", "click: Blue Train"),
            ]
        );
        assert_eq!(u.entries[0].source, Some((0, 1)));
        // Row i of the store is entry i: t1 was embedded as axis 1.
        assert_eq!(u.store.vector(0)[1], 1.0);
        assert_eq!(u.store.vector(3)[3], 1.0);
        assert!(s.items.contains_key("i1"));
    }

    #[test]
    fn sessions_group_their_turns_in_order() {
        let s = load(true);
        let u = &s.users["u"];
        let s1 = u.entries.iter().position(|e| e.id == "s1").unwrap();
        let e = &u.entries[s1];
        assert_eq!(e.kind, EntryKind::Session);
        assert_eq!(
            e.content,
            "user: More Coltrane?\nassistant: Try Blue Train."
        );
        assert_eq!(e.source_event_ids, ["t1", "t2"]);
        // The session's vector is the normalised mean of its turns'.
        let v = u.store.vector(s1);
        let h = std::f32::consts::FRAC_1_SQRT_2;
        assert!((v[0] - h).abs() < 1e-6 && (v[1] - h).abs() < 1e-6);
        assert_eq!(u.entries.len(), 3, "two sessions and a click");
    }
}
