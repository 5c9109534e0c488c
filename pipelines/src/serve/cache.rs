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

use futures::future::BoxFuture;
use steamrf_operators::steam::MemoryId;
use steamrf_operators::steam::memory::Memory;

use crate::config::ServeConfig;
use crate::error::Result;

mod build;
mod corpus;
mod snapshot;
mod tables;

pub use self::build::{UserRows, build_user, vector_store};
pub use self::corpus::{
    AnswerText, Entry, EntryKind, ItemInfo, Members, UserCorpus, UserData, Window,
};
pub use self::snapshot::{Snapshot, View, catalogue, item_texts};
pub use self::tables::{SignalSources, TABLES, Tables};

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

#[cfg(test)]
mod tests;
