//! What every request shares: the [`Snapshot`] of the item catalogue and
//! the published prototypes, loaded whole when their tables change, and the
//! per-request [`View`] that joins it with one user's memories and the
//! members the request read.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::Int32Type;
use steamrf_operators::lexical::Bm25Params;
use steamrf_operators::rank::{ItemText, Signals, TenantItemCf};
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_operators::steam::retrieve::MemoryView;
use steamrf_operators::steam::{MemoryId, Prototype};

use super::corpus::opt_str;
use super::corpus::{ItemInfo, Members, UserData};
use crate::error::Result;
use crate::sink::ids::{is_legacy, read_id_lists, read_ids};
use crate::steam::vector;

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
pub(super) fn prototypes(batches: &[RecordBatch]) -> Result<HashMap<MemoryId, Prototype>> {
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
