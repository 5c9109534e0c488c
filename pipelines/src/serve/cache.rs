//! The service's view of the tables, bounded in memory.
//!
//! - [`Snapshot`]: what every request shares, loaded whole when its tables
//!   change: the item catalogue, the published prototypes (content and
//!   members) with the member → prototype map, and the table versions. It
//!   grows with the catalogue and with the memories in published
//!   communities (their ids), not with the rows users write.
//! - [`Cache`]: each user's corpus and memories, and the members of the
//!   prototypes their memories are in, read on a miss from LanceDB (BTree
//!   indexes on `interactions.user_id`, `memories.user_id` and
//!   `memories.memory_id`) and dropped least recently used first once
//!   `serve.cache_bytes` are held.
//! - The refresh task reads which rows changed between the versions it saw
//!   ([`Tables::changed_rows`]: the fragments each commit added, rewrote or
//!   deleted from) and evicts exactly the users and prototypes they belong to;
//!   compactions and index updates change no content and evict nothing.
//!
//! Entries are immutable and handed out as `Arc`s, so a reader never waits
//! for a refresh and never sees half of one, and the pipeline's writes never
//! wait for readers (LanceDB readers read immutable versions).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, TimestampMillisecondType, UInt64Type};
use arrow_array::{Array, RecordBatch};
use futures::TryStreamExt;
use futures::future::BoxFuture;
use lancedb::query::{ExecutableQuery, QueryBase, Select};
use lancedb::{Connection, Table};
use serde::Serialize;
use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::IvfParams;
use steamrf_operators::lexical::{Bm25Index, Bm25Params};
use steamrf_operators::passage::PassageIndex;
use steamrf_operators::rank::{ItemText, Signals, TenantItemCf};
use steamrf_operators::rfmem::VectorStore;
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_operators::steam::retrieve::MemoryView;
use steamrf_operators::steam::{MemoryId, Prototype};
use steamrf_schemas::tables::EMBEDDING_DIM;

use crate::config::{CorpusKind, ServeConfig};
use crate::error::{Chain, Error, Result};
use crate::sink::ids::{is_legacy, read_id_lists, read_ids, sql_list};
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
    /// A session's passage windows, in the order of the window index.
    pub windows: Vec<Window>,
    /// A session's turns: where each ends in `content` (a newline separates
    /// one from the next). Empty for any other row.
    pub turn_ends: Vec<u32>,
}

/// What an answer hands over for one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerText {
    /// Its text, at most `serve.max_item_bytes`.
    pub content: String,
    /// The text was cut at `serve.max_item_bytes`.
    pub truncated: bool,
    /// The events behind the text handed over (a session's: the turns in it).
    pub source_event_ids: Vec<String>,
}

/// One passage window of a session: the turn it ends at and the turns it
/// covers, as offsets into the session's turns in time order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Window {
    /// The `passages` row (the event id of its last turn).
    pub event_id: String,
    /// First turn covered.
    pub start: u32,
    /// One past the last turn covered.
    pub end: u32,
}

impl Entry {
    /// What an answer hands over for this row: the turns of `window` for
    /// a session hit through one, else the whole content; either cut to at
    /// most `max` bytes at a character boundary.
    pub fn answer_text(&self, window: Option<&Window>, max: usize) -> AnswerText {
        let n = self.turn_ends.len();
        // Where turn `i` starts in `content` (a newline ends each before).
        let start_of = |i: usize| match i.checked_sub(1) {
            None => 0,
            Some(prev) => self.turn_ends[prev] as usize + 1,
        };
        let (from, to) = window
            .map(|w| (w.start as usize, w.end as usize))
            .filter(|&(a, b)| a < b && b <= n)
            .unwrap_or((0, n));
        // A session hands over a slice of its content; any other row (or
        // offsets its content does not hold) the whole content.
        let slice = (n > 0)
            .then(|| (start_of(from), self.turn_ends[to - 1] as usize))
            .and_then(|(lo, hi)| Some((lo, self.content.get(lo..hi)?)));
        let text = slice.map_or(self.content.as_str(), |(_, t)| t);
        let mut at = text.len().min(max);
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        // The events behind the text handed over: the turns it reaches into.
        let ids = match slice {
            Some((lo, _)) => {
                let reached = (from..to).take_while(|&i| start_of(i) < lo + at).count();
                self.source_event_ids
                    .get(from..from + reached)
                    .unwrap_or_default()
            }
            None => &self.source_event_ids,
        };
        AnswerText {
            content: text[..at].to_owned(),
            truncated: at < text.len(),
            source_event_ids: ids.to_vec(),
        }
    }

    fn bytes(&self) -> usize {
        size_of::<Self>()
            + self.id.len()
            + self.content.len()
            + self
                .source_event_ids
                .iter()
                .map(|s| s.len() + size_of::<String>())
                .sum::<usize>()
            + self
                .windows
                .iter()
                .map(|w| w.event_id.len() + size_of::<Window>() + EMBEDDING_DIM * 4)
                .sum::<usize>()
    }
}

/// One user's corpus.
#[derive(Debug)]
pub struct UserCorpus {
    /// Row `i` of `index` is `entries[i]`.
    pub entries: Vec<Entry>,
    /// The rows' vectors, the sessions' windows and BM25 over the contents.
    pub index: PassageIndex,
}

/// What the service holds for one user.
#[derive(Debug)]
pub struct UserData {
    /// The searchable rows.
    pub corpus: UserCorpus,
    /// The user's STEAM memories (the local step of local-to-global).
    pub memories: UserMemories,
    /// Clicks on items the catalogue did not have were left out; a
    /// catalogue change evicts such entries.
    pub unresolved: bool,
    /// The items of the user's interactions, oldest first (every item,
    /// in the catalogue or not): the history the ranker's item-CF and
    /// BM25 score against; empty while `serve.ranker` weighs neither.
    pub history: Vec<String>,
    /// Interactions older than the `serve.max_user_rows` most recent ones,
    /// left out of this corpus.
    pub rows_cut: usize,
    /// Estimated heap bytes (what `serve.cache_bytes` counts).
    pub bytes: usize,
}

/// Other users' memories in one published community: what the
/// local-to-global step scores and recommends from.
#[derive(Debug, Default)]
pub struct Members {
    /// The prototype (community) they are the members of.
    pub prototype: MemoryId,
    /// By id.
    pub memories: HashMap<MemoryId, Memory>,
    /// The items at least `steam.min_users` of their users chose: the only
    /// item ids an answer may name ([`steamrf_operators::steam::shared_items`],
    /// computed once per fill, not per request).
    pub shared: HashSet<String>,
    /// Estimated heap bytes.
    pub bytes: usize,
}

fn memory_bytes(m: &Memory) -> usize {
    size_of::<Memory>()
        + m.user_id.len()
        + m.content.len()
        + m.embedding.len() * 4
        + m.interactions
            .iter()
            .chain(&m.items)
            .chain(&m.recent)
            .map(|s| s.len() + 24)
            .sum::<usize>()
        + m.facets.keys().map(|k| k.len() + 48).sum::<usize>()
}

impl Members {
    /// The members of `prototype` from their memories; items are named when
    /// at least `min_users` of their users chose them.
    pub fn new(
        prototype: MemoryId,
        memories: impl IntoIterator<Item = Memory>,
        min_users: usize,
    ) -> Self {
        let memories: HashMap<MemoryId, Memory> = memories.into_iter().map(|m| (m.id, m)).collect();
        let shared: HashSet<String> =
            steamrf_operators::steam::shared_items(memories.values(), min_users)
                .into_keys()
                .map(str::to_owned)
                .collect();
        let bytes = memories
            .values()
            .map(|m| memory_bytes(m) + 16)
            .sum::<usize>()
            + shared.iter().map(|s| s.len() + 32).sum::<usize>();
        Self {
            prototype,
            memories,
            shared,
            bytes,
        }
    }
}

/// An item of the catalogue.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemInfo {
    /// Its title.
    pub title: String,
    /// Its embedding (unit length).
    pub embedding: Vec<f32>,
}

/// What every request shares (see the module docs).
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The catalogue (items with an embedding).
    pub items: Arc<HashMap<String, ItemInfo>>,
    /// Published prototypes, by community id.
    pub prototypes: Arc<HashMap<MemoryId, Prototype>>,
    /// The published community of each member memory.
    pub community_of: Arc<HashMap<MemoryId, MemoryId>>,
    /// The table versions it reflects (absent tables: 0).
    pub versions: BTreeMap<&'static str, u64>,
    /// How long the last refresh took.
    pub load_time: Duration,
    /// BM25 over the catalogue's texts, when `serve.ranker.bm25` weighs it.
    pub text: Option<Arc<ItemText>>,
    /// Users per item, per tenant, when `serve.ranker` weighs item-CF or
    /// popularity.
    pub item_cf: Option<Arc<TenantItemCf>>,
    /// When `item_cf` was read, and the `interactions` version it read.
    pub item_cf_at: Option<(Instant, u64)>,
}

impl Snapshot {
    /// The shared part over `prototypes` and `items`.
    pub fn new(items: HashMap<String, ItemInfo>, prototypes: HashMap<MemoryId, Prototype>) -> Self {
        let community_of = prototypes
            .values()
            .flat_map(|p| p.members.iter().map(move |&m| (m, p.id)))
            .collect();
        Self {
            items: Arc::new(items),
            prototypes: Arc::new(prototypes),
            community_of: Arc::new(community_of),
            versions: BTreeMap::new(),
            load_time: Duration::ZERO,
            text: None,
            item_cf: None,
            item_cf_at: None,
        }
    }

    /// What the ranker's non-STEAM signals for `user_id` are computed from:
    /// the catalogue's texts, and the item statistics of the user's tenant
    /// only.
    pub fn signals(&self, user_id: &str) -> Signals<'_> {
        Signals {
            item_cf: self.item_cf.as_deref().and_then(|cf| cf.of(user_id)),
            text: self.text.as_deref(),
        }
    }

    /// The prototypes `user`'s memories are in.
    pub fn prototypes_of(&self, user: &UserData) -> Vec<MemoryId> {
        let mut out: Vec<MemoryId> = user
            .memories
            .memories
            .iter()
            .filter_map(|m| self.community_of.get(&m.id).copied())
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// What one request reads: the shared snapshot, the user, and the members of
/// the user's communities (empty without the local-to-global step).
#[derive(Debug)]
pub struct View {
    /// The shared part.
    pub snap: Arc<Snapshot>,
    /// The user asking.
    pub user: Arc<UserData>,
    /// Members of the prototypes the user's memories are in.
    pub members: Vec<Arc<Members>>,
    /// `tenancy.separator`: members of another tenant never count.
    pub separator: Option<char>,
}

impl View {
    /// The items the members of prototype `pid` may be named by (empty when
    /// its members were not read).
    pub fn shared_items(&self, pid: MemoryId) -> Option<&HashSet<String>> {
        self.members
            .iter()
            .find(|m| m.prototype == pid)
            .map(|m| &m.shared)
    }
}

impl MemoryView for View {
    fn user(&self, user_id: &str) -> Option<&UserMemories> {
        (self.user.memories.user_id == user_id).then_some(&self.user.memories)
    }
    fn community_of(&self, m: MemoryId) -> Option<MemoryId> {
        self.snap.community_of.get(&m).copied()
    }
    fn prototype(&self, c: MemoryId) -> Option<&Prototype> {
        self.snap.prototypes.get(&c)
    }
    fn memory(&self, id: MemoryId) -> Option<&Memory> {
        self.user
            .memories
            .memories
            .iter()
            .find(|m| m.id == id)
            .or_else(|| self.members.iter().find_map(|g| g.memories.get(&id)))
    }
    fn tenant_separator(&self) -> Option<char> {
        self.separator
    }
    fn item_vector(&self, item: &str) -> Option<&[f32]> {
        self.snap.items.get(item).map(|i| i.embedding.as_slice())
    }
}

/// Where the cache reads from on a miss: the tables ([`Tables`]), or a fixed
/// set in tests.
pub trait Loader: Send + Sync {
    /// One user's rows and memories.
    fn user<'a>(
        &'a self,
        cfg: &'a ServeConfig,
        snap: &'a Snapshot,
        user_id: &'a str,
    ) -> BoxFuture<'a, Result<UserData>>;

    /// The memories with these ids (those that exist).
    fn memories<'a>(&'a self, ids: &'a [MemoryId]) -> BoxFuture<'a, Result<Vec<Memory>>>;
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    User(String),
    Members(MemoryId),
}

#[derive(Debug, Clone)]
enum Value {
    User(Arc<UserData>),
    Members(Arc<Members>),
}

impl Value {
    fn bytes(&self) -> usize {
        match self {
            Self::User(u) => u.bytes,
            Self::Members(m) => m.bytes,
        }
    }
}

#[derive(Debug, Default)]
struct Lru {
    map: HashMap<Key, (Value, u64)>,
    /// Last use → key; the first entry is the least recently used.
    order: BTreeMap<u64, Key>,
    used: usize,
    /// User entries (the rest are prototype members).
    users: usize,
    tick: u64,
    generation: u64,
    /// The generation of the last invalidation that named each key, so that
    /// a fill is refused only when its own key (or everything) changed
    /// since it began: one user written to every refresh keeps no other
    /// user's fill from being kept. Cleared past [`DIRTY_KEYS`] entries,
    /// when `floor` moves up to the current generation.
    dirty: HashMap<Key, u64>,
    /// Fills that began before this generation are refused (an invalidation
    /// of everything, or of the unresolved users, or a cleared `dirty`).
    floor: u64,
}

/// Keys [`Lru::dirty`] remembers before it is cleared.
const DIRTY_KEYS: usize = 100_000;

impl Lru {
    /// Every change of `map` goes through `put` and `remove`, which keep
    /// `order`, `used` and `users` with it.
    fn put(&mut self, k: Key, v: Value) {
        self.tick += 1;
        self.used += v.bytes();
        self.users += usize::from(matches!(k, Key::User(_)));
        self.order.insert(self.tick, k.clone());
        self.map.insert(k, (v, self.tick));
    }

    fn get(&mut self, k: &Key) -> Option<Value> {
        self.tick += 1;
        let tick = self.tick;
        let (v, last) = self.map.get_mut(k)?;
        self.order.remove(last);
        *last = tick;
        self.order.insert(tick, k.clone());
        Some(v.clone())
    }

    fn remove(&mut self, k: &Key) -> bool {
        match self.map.remove(k) {
            Some((v, last)) => {
                self.order.remove(&last);
                self.used -= v.bytes();
                self.users -= usize::from(matches!(k, Key::User(_)));
                true
            }
            None => false,
        }
    }

    /// Drops the least recently used entry; false when empty.
    fn pop_oldest(&mut self) -> bool {
        match self.order.first_key_value() {
            Some((_, k)) => {
                let k = k.clone();
                self.remove(&k)
            }
            None => false,
        }
    }
}

/// What [`Cache::invalidate`] drops.
#[derive(Debug, Default)]
pub struct Changes {
    /// Users whose rows or memories changed.
    pub users: HashSet<String>,
    /// Prototypes whose members (or a member's content) changed.
    pub prototypes: HashSet<MemoryId>,
    /// Users whose entries left out clicks on then-unknown items (the
    /// catalogue gained items).
    pub unresolved: bool,
    /// Everything (changes that cannot be told apart).
    pub all: bool,
}

impl Changes {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty() && self.prototypes.is_empty() && !self.unresolved && !self.all
    }
}

/// Cache statistics, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Estimated bytes held.
    pub bytes: usize,
    /// User entries.
    pub users: usize,
    /// Prototype member entries.
    pub prototypes: usize,
}

/// Users and prototype members, bounded in bytes, least recently used out
/// first (see the module docs).
#[derive(Debug)]
pub struct Cache {
    budget: usize,
    inner: Mutex<Lru>,
}

impl Cache {
    /// A cache holding about `budget` bytes at most.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            inner: Mutex::new(Lru::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A cached user.
    pub fn user(&self, id: &str) -> Option<Arc<UserData>> {
        match self.lock().get(&Key::User(id.to_owned())) {
            Some(Value::User(u)) => Some(u),
            _ => None,
        }
    }

    /// Cached members of a prototype.
    pub fn members(&self, prototype: MemoryId) -> Option<Arc<Members>> {
        match self.lock().get(&Key::Members(prototype)) {
            Some(Value::Members(m)) => Some(m),
            _ => None,
        }
    }

    /// Counts invalidations: a fill that began before one that named its
    /// key (or everything) may hold rows it changed, so it is answered from
    /// but not kept.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Keeps a user read while the generation was `since`; returns the
    /// entries evicted to make room.
    pub fn insert_user(&self, id: &str, data: Arc<UserData>, since: u64) -> usize {
        self.insert(Key::User(id.to_owned()), Value::User(data), since)
    }

    /// Keeps a prototype's members read while the generation was `since`.
    pub fn insert_members(&self, prototype: MemoryId, m: Arc<Members>, since: u64) -> usize {
        self.insert(Key::Members(prototype), Value::Members(m), since)
    }

    fn insert(&self, k: Key, v: Value, since: u64) -> usize {
        let bytes = v.bytes();
        // One entry may take half the budget at most, so that one huge
        // user cannot flush everyone else.
        if bytes > self.budget / 2 {
            return 0;
        }
        let mut lru = self.lock();
        if since < lru.floor || lru.dirty.get(&k).is_some_and(|&g| g > since) {
            return 0;
        }
        lru.remove(&k);
        let mut evicted = 0;
        while lru.used + bytes > self.budget && lru.pop_oldest() {
            evicted += 1;
        }
        lru.put(k, v);
        evicted
    }

    /// Drops what `c` names and starts a new generation; returns the
    /// entries dropped.
    pub fn invalidate(&self, c: &Changes) -> usize {
        if c.is_empty() {
            return 0;
        }
        let mut lru = self.lock();
        lru.generation += 1;
        let generation = lru.generation;
        if c.all {
            let n = lru.map.len();
            *lru = Lru {
                generation,
                floor: generation,
                ..Lru::default()
            };
            return n;
        }
        let mut doomed: Vec<Key> = c
            .users
            .iter()
            .map(|u| Key::User(u.clone()))
            .chain(c.prototypes.iter().map(|&p| Key::Members(p)))
            .collect();
        if lru.dirty.len() + doomed.len() > DIRTY_KEYS {
            lru.dirty.clear();
            lru.floor = generation;
        } else {
            for k in &doomed {
                lru.dirty.insert(k.clone(), generation);
            }
        }
        if c.unresolved {
            // A fill may not know whether it read an unresolved user.
            lru.floor = generation;
            doomed.extend(lru.map.iter().filter_map(|(k, (v, _))| match v {
                Value::User(u) if u.unresolved => Some(k.clone()),
                _ => None,
            }));
        }
        doomed.iter().filter(|k| lru.remove(k)).count()
    }

    /// What is held.
    pub fn stats(&self) -> CacheStats {
        let lru = self.lock();
        CacheStats {
            bytes: lru.used,
            users: lru.users,
            prototypes: lru.map.len() - lru.users,
        }
    }
}

/// The tables the service reads (opened once they exist).
pub struct Tables {
    db: Connection,
    open: std::sync::RwLock<BTreeMap<&'static str, Table>>,
    /// What the ranker needs beyond the catalogue's vectors.
    signals: SignalSources,
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
const INTERACTION_COLUMNS: &[&str] = &[
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

/// The `turn_vectors` columns a corpus is built from.
const TURN_VECTOR_COLUMNS: &[&str] = &["event_id", "embedding"];

/// The `passages` columns a corpus is built from, in the order `build` reads them.
const PASSAGE_COLUMNS: &[&str] = &["event_id", "session_id", "first_event_id", "embedding"];

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
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// `filter` narrowed to the rows at or after (`ts`, `event_id`).
fn cut_filter(filter: &str, ts: i64, event_id: &str) -> String {
    let at = chrono::DateTime::from_timestamp_millis(ts).map_or_else(
        || "1970-01-01 00:00:00.000".to_owned(),
        |t| t.format("%Y-%m-%d %H:%M:%S%.3f").to_string(),
    );
    format!(
        "{filter} AND (`timestamp` > TIMESTAMP '{at}' OR (`timestamp` = TIMESTAMP '{at}' AND event_id >= {}))",
        literal(event_id)
    )
}

fn lance_err(context: &str) -> impl FnOnce(lance::Error) -> Error + '_ {
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

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<&'static str, Table>> {
        self.open
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn table(&self, name: &str) -> Option<Table> {
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
    async fn recent(&self, user_id: &str, max: usize) -> Result<(String, usize)> {
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

    async fn query(
        &self,
        name: &str,
        columns: &[&str],
        filter: Option<String>,
    ) -> Result<Vec<RecordBatch>> {
        let Some(t) = self.table(name) else {
            return Ok(Vec::new());
        };
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
async fn fragment_changes(
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
async fn scan_fragment(
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

fn opt_str(col: &dyn Array, row: usize) -> Option<&str> {
    let s = col.as_string::<i32>();
    (!s.is_null(row)).then(|| s.value(row))
}

/// The catalogue in `items` batches (`item_id`, `title`, `embedding`).
pub fn catalogue(items: &[RecordBatch]) -> HashMap<String, ItemInfo> {
    let mut out = HashMap::new();
    for b in items {
        let id = b.column(0).as_string::<i32>();
        let title = b.column(1).as_string::<i32>();
        for r in 0..b.num_rows() {
            if let Some(e) = vector(b.column(2), r) {
                out.insert(
                    id.value(r).to_owned(),
                    ItemInfo {
                        title: title.value(r).to_owned(),
                        embedding: e.to_vec(),
                    },
                );
            }
        }
    }
    out
}

/// BM25 over the items' texts in `items` batches (`item_id`, `title`,
/// `embedding`, `categories`, `description`), each made with `template` as
/// ingest makes the text it embeds.
pub fn item_texts(items: &[RecordBatch], template: &str) -> ItemText {
    let mut texts: Vec<(String, String)> = Vec::new();
    for b in items {
        let id = b.column(0).as_string::<i32>();
        let title = b.column(1).as_string::<i32>();
        let categories = b.column(3).as_list::<i32>();
        for r in 0..b.num_rows() {
            let cats = categories.value(r);
            let cats: Vec<&str> = cats.as_string::<i32>().iter().flatten().collect();
            let description = opt_str(b.column(4), r).unwrap_or("");
            texts.push((
                id.value(r).to_owned(),
                crate::embed::item_text(template, title.value(r), &cats, description),
            ));
        }
    }
    ItemText::new(
        texts.iter().map(|(i, t)| (i.as_str(), t.as_str())),
        Bm25Params::default(),
    )
}

/// The prototypes in `prototypes` batches (`prototype_id`, `content`,
/// `embedding`, `member_ids`, `users`).
fn prototypes(batches: &[RecordBatch]) -> Result<HashMap<MemoryId, Prototype>> {
    let mut out = HashMap::new();
    for b in batches {
        if is_legacy(b.column(0)) {
            // Until `steamrf migrate` has run (warned at start).
            continue;
        }
        let ids = read_ids(b.column(0), "prototypes.prototype_id")?;
        let content = b.column(1).as_string::<i32>();
        let members = read_id_lists(b.column(3), "prototypes.member_ids")?;
        let users = b.column(4).as_primitive::<Int32Type>();
        for (r, (pid, members)) in ids.into_iter().zip(members).enumerate() {
            out.insert(
                pid,
                Prototype {
                    id: pid,
                    content: content.value(r).to_owned(),
                    embedding: vector(b.column(2), r)
                        .map(<[f32]>::to_vec)
                        .unwrap_or_default(),
                    members,
                    users: usize::try_from(users.value(r)).unwrap_or(0),
                },
            );
        }
    }
    Ok(out)
}

struct Row {
    entry: Entry,
    vector: Vec<f32>,
    ts: i64,
    windows: Vec<Vec<f32>>,
}

struct Turn {
    ts: i64,
    event_id: String,
    content: String,
    vector: Vec<f32>,
    source: Option<(i32, i64)>,
}

/// A store over `flat` as the service searches it: exact below `min_rows`
/// vectors, an IVF (`serve.ivf_probes` probed) from there on.
///
/// # Errors
/// Vectors of the wrong length.
pub fn vector_store(cfg: &ServeConfig, flat: Vec<f32>, min_rows: usize) -> Result<VectorStore> {
    let n = flat.len() / EMBEDDING_DIM;
    let corpus = Corpus::from_vec(flat, EMBEDDING_DIM).map_err(internal)?;
    Ok(if n >= min_rows {
        VectorStore::ivf(
            corpus,
            &IvfParams {
                probes: cfg.ivf_probes,
                ..IvfParams::default()
            },
            CpuKernel::default(),
        )
        .map_err(internal)?
    } else {
        VectorStore::flat(
            corpus,
            CpuKernel {
                threads: cfg.search_threads,
                ..CpuKernel::default()
            },
        )
    })
}

/// One user's stored rows, as [`build_user`] reads them.
#[derive(Debug, Clone, Copy, Default)]
pub struct UserRows<'a> {
    /// `interactions` rows (columns [`INTERACTION_COLUMNS`]).
    pub interactions: &'a [RecordBatch],
    /// `turn_vectors` rows (columns [`TURN_VECTOR_COLUMNS`]).
    pub turn_vectors: &'a [RecordBatch],
    /// `passages` rows (columns [`PASSAGE_COLUMNS`]).
    pub passages: &'a [RecordBatch],
}

/// One user's [`UserData`] from their stored rows and memories.
///
/// # Errors
/// Vectors of the wrong length.
pub fn build_user(
    cfg: &ServeConfig,
    catalogue: &HashMap<String, ItemInfo>,
    user_id: &str,
    stored: UserRows<'_>,
    memories: Vec<Memory>,
) -> Result<UserData> {
    let UserRows {
        interactions,
        turn_vectors,
        passages,
    } = stored;
    // Each dialogue turn's vector, by event id.
    let mut turn_vector: HashMap<&str, &[f32]> = HashMap::new();
    for b in turn_vectors {
        let ids = b.column(0).as_string::<i32>();
        for r in 0..b.num_rows() {
            if let Some(v) = vector(b.column(1), r) {
                turn_vector.insert(ids.value(r), v);
            }
        }
    }
    let want = |k: CorpusKind| cfg.kinds.contains(&k);
    let mut rows: Vec<Row> = Vec::new();
    let mut unresolved = false;
    let mut sessions: BTreeMap<String, Vec<Turn>> = BTreeMap::new();
    // Only a ranker that scores against the history (item-CF, BM25) needs it.
    let weights = cfg.ranker.weights();
    let keep_history = weights.needs_item_cf() || weights.needs_text();
    let mut history: Vec<(i64, &str)> = Vec::new();
    for b in interactions {
        let event = b.column(0).as_string::<i32>();
        let kind = b.column(1).as_string::<i32>();
        let ts = b.column(3).as_primitive::<TimestampMillisecondType>();
        let part = b.column(8).as_primitive::<Int32Type>();
        let offset = b.column(9).as_primitive::<Int64Type>();
        for r in 0..b.num_rows() {
            if keep_history && let Some(item) = opt_str(b.column(4), r) {
                history.push((ts.value(r), item));
            }
            let source = Some((part.value(r), offset.value(r)));
            let e = turn_vector.get(event.value(r)).copied();
            if let (Some(text), Some(e)) = (opt_str(b.column(7), r), e) {
                let (as_passage, as_turn) = (want(CorpusKind::Passage), want(CorpusKind::Dialogue));
                if !as_passage && !as_turn {
                    continue;
                }
                let role = opt_str(b.column(6), r).unwrap_or("user");
                let content = format!("{role}: {text}");
                let session = opt_str(b.column(5), r);
                if let Some(s) = session
                    && (as_passage || cfg.group_sessions)
                {
                    sessions.entry(s.to_owned()).or_default().push(Turn {
                        ts: ts.value(r),
                        event_id: event.value(r).to_owned(),
                        content: content.clone(),
                        vector: e.to_vec(),
                        source,
                    });
                }
                if !as_turn || (cfg.group_sessions && session.is_some()) {
                    continue;
                }
                rows.push(Row {
                    entry: Entry {
                        kind: EntryKind::Dialogue,
                        id: event.value(r).to_owned(),
                        content,
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                        windows: Vec::new(),
                        turn_ends: Vec::new(),
                    },
                    vector: e.to_vec(),
                    ts: ts.value(r),
                    windows: Vec::new(),
                });
            } else if let Some(item) = opt_str(b.column(4), r) {
                if !want(CorpusKind::Interaction) {
                    continue;
                }
                let Some(info) = catalogue.get(item) else {
                    unresolved = true;
                    continue;
                };
                rows.push(Row {
                    entry: Entry {
                        kind: EntryKind::Interaction,
                        id: event.value(r).to_owned(),
                        content: format!("{}: {}", kind.value(r), info.title),
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                        windows: Vec::new(),
                        turn_ends: Vec::new(),
                    },
                    vector: info.embedding.clone(),
                    ts: ts.value(r),
                    windows: Vec::new(),
                });
            }
        }
    }
    // The sessions' windows: session → (last turn, first turn, vector).
    type Windows<'a> = Vec<(&'a str, &'a str, &'a [f32])>;
    let mut by_session: HashMap<&str, Windows<'_>> = HashMap::new();
    for b in passages {
        let event = b.column(0).as_string::<i32>();
        let session = b.column(1).as_string::<i32>();
        let first = b.column(2).as_string::<i32>();
        for r in 0..b.num_rows() {
            if let Some(v) = vector(b.column(3), r) {
                by_session.entry(session.value(r)).or_default().push((
                    event.value(r),
                    first.value(r),
                    v,
                ));
            }
        }
    }
    for (session, mut turns) in sessions {
        turns.sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.event_id.cmp(&b.event_id)));
        let mut v = vec![0.0f32; EMBEDDING_DIM];
        for t in &turns {
            v.iter_mut().zip(&t.vector).for_each(|(a, b)| *a += b);
        }
        let at: HashMap<&str, u32> = turns
            .iter()
            .enumerate()
            .map(|(i, t)| (t.event_id.as_str(), i as u32))
            .collect();
        let mut windows: Vec<(Window, Vec<f32>)> = by_session
            .get(session.as_str())
            .into_iter()
            .flatten()
            .filter_map(|&(last, first, v)| {
                // A window whose turns are gone (forgotten) is left out.
                let (start, end) = (*at.get(first)?, *at.get(last)? + 1);
                (start < end).then(|| {
                    (
                        Window {
                            event_id: last.to_owned(),
                            start,
                            end,
                        },
                        v.to_vec(),
                    )
                })
            })
            .collect();
        windows.sort_by_key(|w| (w.0.end, w.0.start));
        let (windows, vectors): (Vec<Window>, Vec<Vec<f32>>) = windows.into_iter().unzip();
        let mut content = String::new();
        let mut turn_ends = Vec::with_capacity(turns.len());
        for t in &turns {
            if !turn_ends.is_empty() {
                content.push('\n');
            }
            content.push_str(&t.content);
            turn_ends.push(u32::try_from(content.len()).unwrap_or(u32::MAX));
        }
        rows.push(Row {
            entry: Entry {
                kind: EntryKind::Session,
                id: session,
                content,
                table: "interactions",
                source_event_ids: turns.iter().map(|t| t.event_id.clone()).collect(),
                source: turns.first().and_then(|t| t.source),
                windows,
                turn_ends,
            },
            vector: v,
            ts: turns.first().map_or(0, |t| t.ts),
            windows: vectors,
        });
    }
    let mut mems = UserMemories::new(user_id);
    for m in memories {
        if want(CorpusKind::Memory) {
            rows.push(Row {
                entry: Entry {
                    kind: EntryKind::Memory,
                    id: m.id.to_string(),
                    content: m.content.clone(),
                    table: "memories",
                    source_event_ids: m.interactions.clone(),
                    source: None,
                    windows: Vec::new(),
                    turn_ends: Vec::new(),
                },
                vector: m.embedding.clone(),
                ts: m.created_ms,
                windows: Vec::new(),
            });
        }
        mems.memories.push(m);
    }
    // Formation order, as the write path keeps them.
    mems.memories
        .sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
    // A stable row order: by time, then id.
    rows.sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.entry.id.cmp(&b.entry.id)));
    let mut flat = Vec::with_capacity(rows.len() * EMBEDDING_DIM);
    let mut window_flat = Vec::new();
    let mut owner = Vec::new();
    let mut entries = Vec::with_capacity(rows.len());
    // Dense candidates come from the window index once there is one, so a
    // row without windows (a click, a memory, a session from before passages
    // were written) is its own one window; `Entry::windows` stays empty, so
    // no passage is named for it.
    let any_windows = rows.iter().any(|r| !r.windows.is_empty());
    for (i, r) in rows.into_iter().enumerate() {
        flat.extend_from_slice(&r.vector);
        if any_windows && r.windows.is_empty() {
            window_flat.extend_from_slice(&r.vector);
            owner.push(i as u32);
        }
        for w in &r.windows {
            window_flat.extend_from_slice(w);
            owner.push(i as u32);
        }
        entries.push(r.entry);
    }
    // Row and window vectors both stay in memory (the index's own
    // `bytes()` leaves its stores to the caller).
    let vector_bytes = (flat.len() + window_flat.len()) * 4;
    let lexical = (cfg.hybrid.lexical_weight > 0.0).then(|| {
        Bm25Index::new(
            entries.iter().map(|e| e.content.as_str()),
            Bm25Params::default(),
        )
    });
    let index = PassageIndex::new(
        vector_store(cfg, flat, cfg.ivf_min_rows)?,
        vector_store(cfg, window_flat, cfg.ivf_min_windows)?,
        owner,
        lexical,
    )
    .map_err(internal)?;
    history.sort_by_key(|h| h.0);
    let history: Vec<String> = history.into_iter().map(|h| h.1.to_owned()).collect();
    let bytes = size_of::<UserData>()
        + user_id.len() * 2
        + history.iter().map(|h| h.len() + 24).sum::<usize>()
        + vector_bytes
        + index.bytes()
        + entries.iter().map(Entry::bytes).sum::<usize>()
        + mems.memories.iter().map(memory_bytes).sum::<usize>();
    Ok(UserData {
        corpus: UserCorpus { entries, index },
        memories: mems,
        unresolved,
        history,
        rows_cut: 0,
        bytes,
    })
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: format!("building a user's corpus: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use steamrf_schemas::tables::{turn_vectors, with_embeddings};

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
    /// on an unknown item, as the tables hold them: `interactions`,
    /// `turn_vectors`, `items`.
    fn tables() -> (RecordBatch, RecordBatch, RecordBatch) {
        let events = [
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t2","timestamp":2000,"user_id":"u","session_id":"s1","role":"assistant","text":"Try Blue Train."}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t1","timestamp":1000,"user_id":"u","session_id":"s1","role":"user","text":"More Coltrane?"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t3","timestamp":3000,"user_id":"u","session_id":"s2","role":"user","text":"My cat is Miles."}"#,
            r#"{"type":"click","schema_version":1,"event_id":"c1","timestamp":4000,"user_id":"u","item_id":"i1"}"#,
            r#"{"type":"click","schema_version":1,"event_id":"c2","timestamp":5000,"user_id":"u","item_id":"nope"}"#,
            r#"{"type":"item","schema_version":1,"event_id":"it","timestamp":10,"item_id":"i1","title":"Blue Train"}"#,
        ];
        let t = crate::sink::fixture(&events, 0);
        let mut vecs = axis(0);
        vecs.extend(axis(1));
        vecs.extend(axis(2));
        let inter = t.interactions.unwrap();
        let tv = turn_vectors(&inter, &[0, 1, 2], &vecs).unwrap();
        let items = with_embeddings(&t.items.unwrap(), &[0], &axis(3)).unwrap();
        (
            project(&inter, INTERACTION_COLUMNS),
            project(&tv, TURN_VECTOR_COLUMNS),
            project(&items, &["item_id", "title", "embedding"]),
        )
    }

    fn load(group_sessions: bool) -> (UserData, HashMap<String, ItemInfo>) {
        let mut cfg = Config::load_with_env(None, []).unwrap().serve;
        cfg.group_sessions = group_sessions;
        // A ranker that reads the history (it is not kept otherwise).
        cfg.ranker.item_cf = 0.5;
        cfg.kinds = vec![
            CorpusKind::Memory,
            CorpusKind::Dialogue,
            CorpusKind::Interaction,
        ];
        let (inter, tv, items) = tables();
        let items = catalogue(&[items]);
        let stored = UserRows {
            interactions: &[inter],
            turn_vectors: &[tv],
            passages: &[],
        };
        (
            build_user(&cfg, &items, "u", stored, Vec::new()).unwrap(),
            items,
        )
    }

    #[test]
    fn sessions_carry_their_passage_windows_by_turn_offsets() {
        use steamrf_operators::passage::{HybridParams, retrieve_until};
        use steamrf_operators::rfmem::{Mode, RfMemParams};
        // The default view: sessions with their windows, and interactions.
        let cfg = Config::load_with_env(None, []).unwrap().serve;
        assert!(cfg.kinds.contains(&CorpusKind::Passage));
        let (inter, tv, items) = tables();
        let items = catalogue(&[items]);
        let schema = Arc::new(arrow_schema::Schema::new(
            PASSAGE_COLUMNS
                .iter()
                .map(|c| {
                    steamrf_schemas::TableName::Passages
                        .schema()
                        .field_with_name(c)
                        .unwrap()
                        .clone()
                })
                .collect::<Vec<_>>(),
        ));
        // The window ending at t2 covers t1..t2; one names a forgotten turn.
        let mut v = axis(5);
        v.extend(axis(6));
        let passages = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(arrow_array::StringArray::from(vec!["t2", "gone"])),
                Arc::new(arrow_array::StringArray::from(vec!["s1", "s1"])),
                Arc::new(arrow_array::StringArray::from(vec!["t1", "t0"])),
                steamrf_schemas::tables::embedding_array(&v, 2).unwrap(),
            ],
        )
        .unwrap();
        let stored = UserRows {
            interactions: &[inter],
            turn_vectors: &[tv],
            passages: &[passages],
        };
        let u = build_user(&cfg, &items, "u", stored, Vec::new()).unwrap();
        let c = &u.corpus;
        let sessions: Vec<&str> = c
            .entries
            .iter()
            .filter(|e| e.kind == EntryKind::Session)
            .map(|e| e.id.as_str())
            .collect();
        assert_eq!(sessions, ["s1", "s2"]);
        assert!(c.entries.iter().all(|e| e.kind != EntryKind::Dialogue));
        let s1 = c.entries.iter().position(|e| e.id == "s1").unwrap();
        let s2 = c.entries.iter().position(|e| e.id == "s2").unwrap();
        assert_eq!(
            c.entries[s1].windows,
            [Window {
                event_id: "t2".into(),
                start: 0,
                end: 2
            }]
        );
        assert!(c.entries[s2].windows.is_empty());
        // s1's window, and every other row (s2, the click) as its own one.
        assert_eq!(c.index.windows(), c.entries.len());
        // The cache counts the window vectors as well as the rows'.
        assert!(
            u.bytes >= (c.entries.len() + c.index.windows()) * EMBEDDING_DIM * 4,
            "{} bytes",
            u.bytes
        );
        // A query along the window's vector finds s1 through it.
        let p = RfMemParams {
            mode: Mode::Familiarity,
            k: 1,
            ..RfMemParams::default()
        };
        let a = retrieve_until(
            &c.index,
            &axis(5),
            None,
            &p,
            &HybridParams::default(),
            &|| false,
        )
        .unwrap();
        assert_eq!(
            (a.hits[0].row as usize, a.hits[0].passage),
            (s1, c.index.first_window(s1 as u32)),
            "{a:?}"
        );
        // A row without windows of its own is still found densely.
        let a = retrieve_until(
            &c.index,
            c.index.rows().vector(s2),
            None,
            &p,
            &HybridParams::default(),
            &|| false,
        )
        .unwrap();
        assert_eq!(a.hits[0].row as usize, s2, "{a:?}");
        // And the lexical side reads the contents.
        let a = retrieve_until(
            &c.index,
            &axis(9),
            Some("cat Miles"),
            &p,
            &HybridParams::default(),
            &|| false,
        )
        .unwrap();
        assert_eq!(c.entries[a.hits[0].row as usize].id, "s2", "{a:?}");
    }

    #[test]
    fn turns_and_interactions_become_rows_with_provenance() {
        let (u, items) = load(false);
        let u = &u.corpus;
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
        assert_eq!(u.index.rows().vector(0)[1], 1.0);
        assert_eq!(u.index.rows().vector(3)[3], 1.0);
        assert!(items.contains_key("i1"));
        // The ranker's history holds every clicked item, oldest first.
        assert_eq!(load(false).0.history, ["i1", "nope"]);
    }

    #[test]
    fn sessions_group_their_turns_in_order() {
        let (u, _) = load(true);
        assert!(u.unresolved, "the click on an unknown item was left out");
        let u = &u.corpus;
        let s1 = u.entries.iter().position(|e| e.id == "s1").unwrap();
        let e = &u.entries[s1];
        assert_eq!(e.kind, EntryKind::Session);
        assert_eq!(
            e.content,
            "user: More Coltrane?\nassistant: Try Blue Train."
        );
        assert_eq!(e.source_event_ids, ["t1", "t2"]);
        // The session's vector is the normalised mean of its turns'.
        let v = u.index.rows().vector(s1);
        let h = std::f32::consts::FRAC_1_SQRT_2;
        assert!((v[0] - h).abs() < 1e-6 && (v[1] - h).abs() < 1e-6);
        assert_eq!(u.entries.len(), 3, "two sessions and a click");
    }

    /// Writes one dialogue turn with its vector.
    async fn write_turn(sink: &crate::sink::LanceSink, user: &str, id: &str, offset: i64) {
        let json = format!(
            r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":{offset},"user_id":"{user}","session_id":"s","role":"user","text":"turn {id}"}}"#
        );
        let inter = crate::sink::fixture(&[json], offset).interactions.unwrap();
        let tv = turn_vectors(&inter, &[0], &axis(offset as usize % 8)).unwrap();
        let t = steamrf_schemas::TableName::Interactions;
        sink.write(t, &inter).await.unwrap();
        let t = steamrf_schemas::TableName::TurnVectors;
        sink.write(t, &tv).await.unwrap();
    }

    fn users(batches: &[RecordBatch]) -> Vec<String> {
        let mut out: Vec<String> = batches
            .iter()
            .flat_map(|b| {
                b.column(0)
                    .as_string::<i32>()
                    .iter()
                    .flatten()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// The rows `tables` give `user`.
    async fn rows(tables: &Tables, cfg: &ServeConfig, snap: &Snapshot, user: &str) -> usize {
        tables
            .user(cfg, snap, user)
            .await
            .unwrap()
            .corpus
            .entries
            .len()
    }

    /// The users of the `interactions` rows changed since version `from`.
    async fn changed_users(tables: &Tables, from: u64) -> Vec<String> {
        users(
            &tables
                .changed_rows("interactions", from, &["user_id"])
                .await
                .unwrap()
                .unwrap(),
        )
    }

    /// Through real LanceDB tables: past `serve.max_user_rows` a user's
    /// corpus holds their most recent turns, by timestamp and then event
    /// id (so equal timestamps cannot make the cut let everything in), and
    /// says how many it left out.
    #[tokio::test]
    async fn a_user_is_served_their_most_recent_rows_only() {
        use crate::metrics::Metrics;
        use crate::sink::LanceSink;

        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::load_with_env(None, []).unwrap();
        config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
        config.serve.kinds = vec![CorpusKind::Dialogue];
        let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
            .await
            .unwrap();
        for (id, ts) in [("a1", 1), ("a2", 2), ("b3", 3), ("a3", 3), ("a4", 4)] {
            write_turn(&sink, "ann", id, ts).await;
        }
        write_turn(&sink, "ben", "b1", 9).await;
        let tables = Tables::new(
            crate::sink::connect(&config.lancedb).await.unwrap(),
            SignalSources::default(),
        );
        tables.versions().await.unwrap();
        let snap = tables.load_shared().await.unwrap();
        for (max, kept, cut) in [
            (10, &["a1", "a2", "a3", "b3", "a4"][..], 0),
            (3, &["a3", "b3", "a4"], 2),
            (2, &["b3", "a4"], 3),
            (1, &["a4"], 4),
        ] {
            config.serve.max_user_rows = max;
            let u = tables.user(&config.serve, &snap, "ann").await.unwrap();
            let ids: Vec<&str> = u.corpus.entries.iter().map(|e| e.id.as_str()).collect();
            assert_eq!(ids, kept, "max_user_rows = {max}");
            assert_eq!(u.rows_cut, cut, "max_user_rows = {max}");
            // Each kept turn found its vector under the same cut.
            assert_eq!(u.corpus.index.rows().len(), kept.len());
        }
    }

    /// A session answers with the turns of the window that matched, and
    /// any text is cut at the byte limit on a character boundary.
    #[test]
    fn an_answer_hands_over_the_matched_window_within_its_byte_limit() {
        let (u, _) = load(true);
        let s1 = u.corpus.entries.iter().position(|e| e.id == "s1").unwrap();
        let e = &u.corpus.entries[s1];
        let w = |start, end| Window {
            event_id: String::new(),
            start,
            end,
        };
        let text = |win: Option<&Window>, max| {
            let a = e.answer_text(win, max);
            (a.content, a.truncated, a.source_event_ids)
        };
        let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            text(Some(&w(0, 1)), 1000),
            ("user: More Coltrane?".to_owned(), false, ids(&["t1"]))
        );
        assert_eq!(text(Some(&w(1, 2)), 1000).0, "assistant: Try Blue Train.");
        assert_eq!(text(Some(&w(1, 2)), 1000).2, ids(&["t2"]));
        assert_eq!(text(Some(&w(0, 2)), 1000).0, e.content);
        assert_eq!(
            text(None, 1000),
            (e.content.clone(), false, ids(&["t1", "t2"]))
        );
        // A window past the turns (a stale one) hands over the whole row.
        assert_eq!(text(Some(&w(1, 9)), 1000).0, e.content);
        assert_eq!(
            text(Some(&w(0, 1)), 8),
            ("user: Mo".to_owned(), true, ids(&["t1"]))
        );
        // Cut inside the first turn: the second is not handed over.
        assert_eq!(text(None, 8), ("user: Mo".to_owned(), true, ids(&["t1"])));
        let wide = Entry {
            content: "ééé".to_owned(),
            turn_ends: Vec::new(),
            ..e.clone()
        };
        let a = wide.answer_text(None, 3);
        assert_eq!((a.content.as_str(), a.truncated), ("é", true));
    }

    /// Through real LanceDB tables: a user is read by id; appends, deletes
    /// and rewrites are told apart, so that exactly the users whose rows
    /// changed are evicted and a compaction evicts nobody.
    #[tokio::test]
    async fn users_are_read_by_id_and_changes_name_exactly_their_users() {
        use steamrf_schemas::TableName;

        use crate::metrics::Metrics;
        use crate::sink::LanceSink;

        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::load_with_env(None, []).unwrap();
        config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
        config.lancedb.reindex_rows = 1;
        // Turns as rows: the ids are the events'.
        config.serve.kinds = vec![
            CorpusKind::Memory,
            CorpusKind::Dialogue,
            CorpusKind::Interaction,
        ];
        let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
            .await
            .unwrap();
        let t = TableName::Interactions;
        write_turn(&sink, "ann", "a1", 1).await;
        write_turn(&sink, "o'brien", "o1", 2).await;
        write_turn(&sink, "ben", "b1", 3).await;
        let tables = Tables::new(
            crate::sink::connect(&config.lancedb).await.unwrap(),
            SignalSources::default(),
        );
        let v1 = tables.versions().await.unwrap()["interactions"];
        let snap = tables.load_shared().await.unwrap();
        let cfg = &config.serve;
        let u = tables.user(cfg, &snap, "o'brien").await.unwrap();
        let ids: Vec<&str> = u.corpus.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, ["o1"], "a quote in the id is a literal, not SQL");
        assert!(u.bytes >= EMBEDDING_DIM * 4);
        assert_eq!(rows(&tables, cfg, &snap, "nobody").await, 0);

        // An append names its user only.
        write_turn(&sink, "ann", "a2", 4).await;
        let v2 = tables.versions().await.unwrap()["interactions"];
        assert!(v2 > v1);
        assert_eq!(changed_users(&tables, v1).await, ["ann"]);
        assert_eq!(rows(&tables, cfg, &snap, "ann").await, 2);

        // A delete (forget) names the deleted rows' user.
        let table = sink.table(t).clone();
        table.delete("user_id = 'ben'").await.unwrap();
        let v3 = tables.versions().await.unwrap()["interactions"];
        assert_eq!(changed_users(&tables, v2).await, ["ben"]);

        // A compaction moves rows without changing them: nobody.
        table
            .optimize(lancedb::table::OptimizeAction::Compact {
                options: Default::default(),
                remap_options: None,
            })
            .await
            .unwrap();
        let v4 = tables.versions().await.unwrap()["interactions"];
        assert!(v4 > v3, "the compaction made a version");
        assert_eq!(changed_users(&tables, v3).await, Vec::<String>::new());
        // Still readable by id after the rewrite.
        assert_eq!(rows(&tables, cfg, &snap, "ann").await, 2);
        // From before the table existed: cannot tell, drop everything.
        assert!(
            tables
                .changed_rows("interactions", 0, &["user_id"])
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn the_rankers_statistics_come_from_the_tables() {
        use crate::metrics::Metrics;
        use crate::sink::LanceSink;
        use steamrf_schemas::TableName;

        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::load_with_env(None, []).unwrap();
        config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
        let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
            .await
            .unwrap();
        let click = |id: &str, user: &str, item: &str| {
            format!(
                r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"{user}","item_id":"{item}"}}"#
            )
        };
        let events = [
            click("c1", "ann", "kind-of-blue"),
            click("c2", "ann", "blue-train"),
            click("c3", "ben", "kind-of-blue"),
            click("c4", "ben", "blue-train"),
            click("c5", "ben", "blue-train"),
            click("c6", "cat", "nevermind"),
            r#"{"type":"item","schema_version":1,"event_id":"i1","timestamp":10,"item_id":"kind-of-blue","title":"Kind of Blue","categories":["Jazz"]}"#.to_owned(),
            r#"{"type":"item","schema_version":1,"event_id":"i2","timestamp":10,"item_id":"blue-train","title":"Blue Train","categories":["Jazz"]}"#.to_owned(),
            r#"{"type":"item","schema_version":1,"event_id":"i3","timestamp":10,"item_id":"nevermind","title":"Nevermind","categories":["Rock"]}"#.to_owned(),
        ];
        let t = crate::sink::fixture(&events, 0);
        sink.write(TableName::Interactions, &t.interactions.unwrap())
            .await
            .unwrap();
        let items = t.items.unwrap();
        let vecs: Vec<f32> = (0..items.num_rows()).flat_map(axis).collect();
        let items = with_embeddings(&items, &[0, 1, 2], &vecs).unwrap();
        sink.write(TableName::Items, &items).await.unwrap();

        let tables = Tables::new(
            crate::sink::connect(&config.lancedb).await.unwrap(),
            SignalSources {
                item_template: Some(config.embed.item_template.clone()),
                item_cf: Some(Duration::from_secs(60)),
                tenant_separator: None,
            },
        );
        tables.versions().await.unwrap();
        let cf = tables.item_cf().await.unwrap();
        let cf = cf.of("anyone").expect("one tenant");
        // Distinct users: ben's second click on blue-train counts once.
        assert_eq!(cf.popularity("blue-train"), 2.0);
        assert_eq!(cf.popularity("nevermind"), 1.0);
        assert!((cf.cosine("kind-of-blue", "blue-train") - 1.0).abs() < 1e-12);
        assert_eq!(cf.cosine("kind-of-blue", "nevermind"), 0.0);
        let snap = tables.load_shared().await.unwrap();
        let text = snap.text.as_deref().expect("BM25 is built when asked for");
        let s = text.scores(&["kind-of-blue"], &["blue-train", "nevermind"]);
        assert!(s[0] > s[1], "the jazz album shares words: {s:?}");
        // Without the ranker asking, neither is kept.
        let plain = Tables::new(
            crate::sink::connect(&config.lancedb).await.unwrap(),
            SignalSources::default(),
        );
        plain.versions().await.unwrap();
        assert!(plain.load_shared().await.unwrap().text.is_none());
        assert!(plain.item_cf_interval().is_none());
    }

    fn sized(bytes: usize, unresolved: bool) -> Arc<UserData> {
        let cfg = Config::load_with_env(None, []).unwrap().serve;
        let mut u =
            build_user(&cfg, &HashMap::new(), "x", UserRows::default(), Vec::new()).unwrap();
        u.bytes = bytes;
        u.unresolved = unresolved;
        Arc::new(u)
    }

    #[test]
    fn the_cache_stays_within_its_budget_least_recently_used_out_first() {
        let c = Cache::new(1000);
        let g = c.generation();
        assert_eq!(c.insert_user("a", sized(200, false), g), 0);
        assert_eq!(c.insert_user("b", sized(200, false), g), 0);
        assert_eq!(c.insert_user("c", sized(200, true), g), 0);
        assert!(c.user("a").is_some(), "a is now the most recently used");
        assert_eq!(c.insert_user("d", sized(200, false), g), 0);
        assert_eq!(c.insert_user("e", sized(200, false), g), 0);
        assert_eq!(c.stats().bytes, 1000);
        // Full: the least recently used (b) makes room.
        assert_eq!(c.insert_user("f", sized(200, false), g), 1);
        assert!(c.user("b").is_none() && c.user("a").is_some());
        assert!(c.stats().bytes <= 1000);
        // One entry over half the budget is served, not kept.
        assert_eq!(c.insert_user("huge", sized(501, false), g), 0);
        assert!(c.user("huge").is_none());
        // Invalidation drops the named users and the unresolved ones, and
        // a fill that began before it is not kept.
        let n = c.invalidate(&Changes {
            users: HashSet::from(["a".to_owned(), "zed".to_owned()]),
            unresolved: true,
            ..Changes::default()
        });
        assert_eq!(n, 2, "a and c");
        assert!(c.user("a").is_none() && c.user("c").is_none() && c.user("d").is_some());
        assert_eq!(c.insert_user("a", sized(10, false), g), 0);
        assert!(c.user("a").is_none(), "read before the invalidation: stale");
        c.insert_user("a", sized(10, false), c.generation());
        assert!(c.user("a").is_some());
        c.insert_members(MemoryId(7), Arc::new(Members::default()), c.generation());
        assert_eq!(c.stats().prototypes, 1);
        // A change of one user refuses only the fills of that user: one
        // user written to on every refresh keeps nobody else from being
        // kept (issue 44, item 3), and is kept itself between its writes.
        let g = c.generation();
        c.invalidate(&Changes {
            users: HashSet::from(["busy".to_owned()]),
            ..Changes::default()
        });
        c.insert_user("calm", sized(10, false), g);
        assert!(c.user("calm").is_some(), "another user's change");
        c.insert_user("busy", sized(10, false), g);
        assert!(c.user("busy").is_none(), "its own change");
        c.insert_members(MemoryId(8), Arc::new(Members::default()), g);
        assert_eq!(c.stats().prototypes, 2);
        c.insert_user("busy", sized(10, false), c.generation());
        assert!(c.user("busy").is_some());
        // Everything changed: every fill that began before is refused.
        let g = c.generation();
        c.invalidate(&Changes {
            all: true,
            ..Changes::default()
        });
        assert_eq!(c.stats(), CacheStats::default());
        c.insert_user("calm", sized(10, false), g);
        assert!(c.user("calm").is_none());
    }
}
