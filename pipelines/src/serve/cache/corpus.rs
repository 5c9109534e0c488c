//! What the cache holds per user and per prototype: the corpus entries
//! (turns, sessions with their passage windows, items), the user's
//! memories, the members of a prototype, each with its size in bytes, and
//! the bounded answer text an entry hands over.

use std::collections::{HashMap, HashSet};

use arrow_array::Array;
use arrow_array::cast::AsArray;
use serde::Serialize;
use steamrf_operators::passage::PassageIndex;
use steamrf_operators::steam::MemoryId;
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_schemas::tables::EMBEDDING_DIM;

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
    /// The text of turns `from..to` of a session (the whole content for a
    /// row without turns, or offsets it does not hold).
    pub fn turns_text(&self, from: usize, to: usize) -> &str {
        let n = self.turn_ends.len();
        if n == 0 || from >= to || to > n {
            return &self.content;
        }
        self.content
            .get(self.turn_start(from)..self.turn_ends[to - 1] as usize)
            .unwrap_or(&self.content)
    }

    /// Where turn `i` starts in `content` (a newline ends each before).
    fn turn_start(&self, i: usize) -> usize {
        match i.checked_sub(1) {
            None => 0,
            Some(prev) => self.turn_ends[prev] as usize + 1,
        }
    }

    /// What an answer hands over for this row: the turns of `window` for
    /// a session hit through one, else the whole content; either cut to at
    /// most `max` bytes at a character boundary.
    pub fn answer_text(&self, window: Option<&Window>, max: usize) -> AnswerText {
        let n = self.turn_ends.len();
        let start_of = |i: usize| self.turn_start(i);
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

    pub(super) fn bytes(&self) -> usize {
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

pub(super) fn memory_bytes(m: &Memory) -> usize {
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

pub(super) fn opt_str(col: &dyn Array, row: usize) -> Option<&str> {
    let s = col.as_string::<i32>();
    (!s.is_null(row)).then(|| s.value(row))
}
