//! The STEAM write path ("From Atom to Community", arXiv 2601.16872) as two
//! batch operators over in-memory state, with no I/O:
//!
//! 1. [`SteamState::observe`] (the ingest path, per user partition): memory
//!    formation and consolidation for a micro-batch of observations, per user
//!    in event-time order ([`memory`]).
//! 2. [`SteamState::link`] (the community stage, a single writer): relation
//!    extraction for the memories that changed, in one kernel call
//!    ([`relations`]); incremental community maintenance ([`community`]);
//!    prototypes for the communities that changed.
//!
//! The pipeline persists what each step returns (tables `memories`,
//! `memory_links`, `prototypes`). Choices the paper leaves open are
//! configuration (`SteamParams`) and are written down in docs/steam.md.

pub mod community;
pub mod geometry;
pub mod ids;
pub mod memory;
pub mod relations;
pub mod retrieve;
mod tally;

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use steamrf_kernels::{RowPrecision, SimilarityKernel};

use self::community::{Communities, CommunityDelta, GraphBatch};
use self::memory::{EvolveParams, Memory, Observation, Step, UserMemories, summarise};
use self::relations::{Link, MemoryIndex, OutLink};
use self::tally::{Member, Tallies, Tally};

pub use self::ids::{IdKey, MemoryId};

/// Parameters of the write path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SteamParams {
    /// Formation and consolidation (τ, the ablation switch, the per-user cap).
    pub evolve: EvolveParams,
    /// k1: links per memory to other users' memories (paper: 2).
    pub k1: usize,
    /// τ for links (the paper uses one τ = 0.5 for both).
    pub link_tau: f32,
    /// A prototype is published only when its community spans at least this
    /// many distinct users (a privacy floor beyond the paper).
    pub min_users: usize,
    /// Tenants: the part of a user id before this character
    /// ([`relations::tenant_of`]); memories of different tenants are never
    /// linked, so communities and prototypes stay within one. `None`: one tenant.
    pub tenant_separator: Option<char>,
    /// Largest community a merge may make (0: unbounded, the connected
    /// components of the link graph); see [`community`].
    pub max_community: usize,
    /// How the relation index keeps each memory's embedding: bf16 (the
    /// default: 768 bytes less per memory at 384 dimensions; links are found
    /// and scored on the rounded vectors, within ~2⁻⁸ of their f32
    /// cosines, so neighbours that close may swap), or f32. A full state's
    /// memories keep their f32 embeddings either way; a
    /// [lean](SteamState::lean) one has only the index's.
    pub index_precision: RowPrecision,
}

impl Default for SteamParams {
    fn default() -> Self {
        Self {
            evolve: EvolveParams::default(),
            k1: 2,
            link_tau: 0.5,
            min_users: 3,
            tenant_separator: None,
            max_community: 1000,
            index_precision: RowPrecision::Bf16,
        }
    }
}

/// A prototype memory p_k = {c_k, e_k, L_k} of one community.
#[derive(Debug, Clone, PartialEq)]
pub struct Prototype {
    /// The community's id.
    pub id: MemoryId,
    /// c_k: a summary of the members.
    pub content: String,
    /// e_k: the normalised mean of the members' embeddings.
    pub embedding: Vec<f32>,
    /// L_k: the members.
    pub members: Vec<MemoryId>,
    /// Distinct users among the members.
    pub users: usize,
}

/// What a prototype may say about an item: catalogue facts (the `item`
/// events' title and categories), never anything a user wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ItemFacts {
    /// The item's title.
    pub title: String,
    /// Its categories or genres.
    pub categories: Vec<String>,
}

/// See [`SteamState::digest`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Digest {
    /// Category counts over the shared items, each item weighted by the
    /// distinct members' users who chose it.
    pub facets: BTreeMap<String, u32>,
    /// The shared items' titles, most widely chosen first (ties by title).
    pub titles: Vec<String>,
    /// Distinct users among the members.
    pub users: usize,
    /// Sum of the members' embeddings.
    pub sum: Vec<f32>,
}

/// What [`SteamState::observe`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObserveOutcome {
    /// Memories formed or consolidated, in the order first changed.
    pub changed: Vec<MemoryId>,
    /// New memories.
    pub formed: u64,
    /// Consolidations.
    pub consolidated: u64,
    /// Replayed observations that changed nothing.
    pub unchanged: u64,
    /// Observations whose new memory's id another memory holds already
    /// (another user's, or one of the user's own, as an `event_id` of
    /// "profile" would give the profile memory's): refused, so no id ever
    /// changes owner (docs/security.md).
    pub refused: u64,
}

/// What [`SteamState::link`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LinkOutcome {
    /// Links now held by the re-linked memories (replacing their old ones).
    pub links: Vec<Link>,
    /// Links dropped from the re-linked memories.
    pub links_removed: Vec<(MemoryId, MemoryId)>,
    /// Community changes.
    pub delta: CommunityDelta,
    /// Prototypes created or changed.
    pub prototypes: Vec<Prototype>,
    /// Prototypes withdrawn (community gone, or below the user floor).
    pub prototypes_removed: Vec<MemoryId>,
    /// Time in the relation-extraction kernel call.
    pub extract_time: std::time::Duration,
    /// Time in community maintenance.
    pub community_time: std::time::Duration,
    /// Time rebuilding prototypes (and members' community labels).
    pub prototype_time: std::time::Duration,
}

/// The whole write-path state.
#[derive(Debug, Clone)]
pub struct SteamState {
    params: SteamParams,
    users: BTreeMap<String, UserMemories>,
    /// Each memory's user; the ids are shared with `names`, so a memory
    /// costs a pointer, not a copy of its user's id.
    owner: HashMap<MemoryId, Arc<str>>,
    /// Every user id `owner` holds, once.
    names: HashSet<Arc<str>>,
    index: MemoryIndex,
    communities: Communities,
    /// Each memory's links, by its id.
    out_links: HashMap<MemoryId, Vec<OutLink>>,
    prototypes: HashMap<MemoryId, Prototype>,
    /// What the prototypes of the larger communities are built from, kept
    /// as members join, leave and change ([`tally`]).
    tallies: Tallies,
    /// Titles and categories of the items observed or learned: the only
    /// text a prototype is built from.
    catalogue: HashMap<String, ItemFacts>,
    /// The community writer's state ([`SteamState::lean`]).
    lean: bool,
}

impl SteamState {
    /// Empty state for `dim`-dimensional embeddings.
    pub fn new(params: SteamParams, dim: usize) -> Self {
        Self {
            params,
            users: BTreeMap::new(),
            owner: HashMap::new(),
            names: HashSet::new(),
            index: MemoryIndex::with_precision(dim, params.index_precision)
                .with_tenant_separator(params.tenant_separator),
            communities: Communities::with_cap(params.max_community),
            out_links: HashMap::new(),
            prototypes: HashMap::new(),
            tallies: Tallies::new(dim),
            catalogue: HashMap::new(),
            lean: false,
        }
    }

    /// The state a community writer keeps (`steamrf communities`), which
    /// restores memories ([`SteamState::restore_memory`]), links them and
    /// keeps communities and prototypes, but never forms, consolidates,
    /// writes or recommends memories. Each memory's embedding is kept once,
    /// in the relation index, instead of also on the [`Memory`]; and what
    /// only formation and the `memories` table read (content, interaction
    /// ids, facets, recent snippets) is not kept. So [`SteamState::memory`]
    /// returns memories without those (an empty `embedding`: read it with
    /// [`SteamState::embedding`]). Links, communities and prototypes are the
    /// same as a full state's (a test). 1,536 bytes less per memory at 384
    /// dimensions, plus whatever the text fields held. Its prototypes are
    /// kept without their embeddings (rebuilt from the community by
    /// [`SteamState::published`], and handed out in full by
    /// [`SteamState::link`]): another 1,536 bytes per prototype.
    pub fn lean(mut self) -> Self {
        self.lean = true;
        self
    }

    /// Refuses to form memories in a lean state (their embeddings and text
    /// are not kept there to consolidate into).
    fn forms(&self) -> Result<(), steamrf_kernels::Error> {
        if self.lean {
            return Err(steamrf_kernels::Error::InvalidInput {
                message: "a community writer's lean state restores memories; it does not form them"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// Keeps a tally for every community of at least `members` members
    /// (the default is [`Tallies::KEEP_FROM`]); what is published does not
    /// depend on it. Tests set 1 to check the tallies on every community.
    #[cfg(test)]
    fn keeping_tallies_from(mut self, members: usize) -> Self {
        self.tallies = Tallies::keeping_from(self.index.dim(), members);
        self
    }

    /// An empty state with the same parameters and item catalogue (a
    /// reload from the tables starts from it).
    pub fn emptied(&self) -> Self {
        Self {
            catalogue: self.catalogue.clone(),
            lean: self.lean,
            ..Self::new(self.params, self.index.dim())
        }
    }

    /// Records an item's catalogue facts (a newer version replaces them).
    /// Observations with an item and a title teach them too.
    pub fn learn_item(&mut self, item_id: &str, facts: ItemFacts) {
        match self.catalogue.get_mut(item_id) {
            Some(f) if *f == facts => {}
            Some(f) => *f = facts,
            None => {
                self.catalogue.insert(item_id.to_owned(), facts);
            }
        }
    }

    /// An item's catalogue facts, if known.
    pub fn item(&self, item_id: &str) -> Option<&ItemFacts> {
        self.catalogue.get(item_id)
    }

    /// The parameters.
    pub fn params(&self) -> &SteamParams {
        &self.params
    }

    /// A user's memories.
    pub fn user(&self, user_id: &str) -> Option<&UserMemories> {
        self.users.get(user_id)
    }

    /// Every user with memories, in id order.
    pub fn user_ids(&self) -> impl Iterator<Item = &str> {
        self.users.keys().map(String::as_str)
    }

    /// A memory by id (in a [lean](SteamState::lean) state, without its
    /// embedding and text fields).
    pub fn memory(&self, id: MemoryId) -> Option<&Memory> {
        find(&self.users, &self.owner, id)
    }

    /// A memory's embedding, wherever the state keeps it.
    pub fn embedding(&self, id: MemoryId) -> Option<Cow<'_, [f32]>> {
        let m = self.memory(id)?;
        Some(member(&self.index, m).embedding)
    }

    /// Published prototypes (a [lean](SteamState::lean) state's without
    /// their embeddings: [`SteamState::published`]).
    pub fn prototypes(&self) -> impl Iterator<Item = &Prototype> {
        self.prototypes.values()
    }

    /// A published prototype (a [lean](SteamState::lean) state's without its
    /// embedding: [`SteamState::published`]).
    pub fn prototype(&self, id: MemoryId) -> Option<&Prototype> {
        self.prototypes.get(&id)
    }

    /// A published prototype in full, as [`SteamState::link`] published it:
    /// a lean state rebuilds the embedding from the community it keeps
    /// (the same digest, so the same vector).
    pub fn published(&self, id: MemoryId) -> Option<Prototype> {
        let p = self.prototypes.get(&id)?;
        if !p.embedding.is_empty() || !self.lean {
            return Some(p.clone());
        }
        // Its members are its community's now: every change to a community
        // refreshed its prototype.
        let digest = self.community_digest(id, &p.members);
        Some(Prototype {
            embedding: memory::normalized(digest.sum),
            ..p.clone()
        })
    }

    /// The communities.
    pub fn communities(&self) -> &Communities {
        &self.communities
    }

    /// Number of memories.
    pub fn len(&self) -> usize {
        self.owner.len()
    }

    /// Whether there are no memories.
    pub fn is_empty(&self) -> bool {
        self.owner.is_empty()
    }

    fn touch(&mut self, user_id: &str, id: MemoryId) -> Result<(), steamrf_kernels::Error> {
        let name = match self.names.get(user_id) {
            Some(n) => n.clone(),
            None => {
                let n: Arc<str> = Arc::from(user_id);
                self.names.insert(n.clone());
                n
            }
        };
        self.owner.insert(id, name);
        // A profile memory stays local: profiles share a template, so their
        // embeddings are close across users whatever their interests, and
        // linking them would join everyone's profile into one community
        // (and publish a summary of personal attributes).
        if id == self.params.evolve.id_key.profile(user_id) {
            return Ok(());
        }
        // `users` and `index` are disjoint fields: no copy of the embedding.
        let m = self
            .users
            .get_mut(user_id)
            .and_then(|u| u.memories.iter_mut().find(|m| m.id == id));
        let Some(m) = m else {
            return self.index.upsert(id, user_id, &[]);
        };
        self.index.upsert(id, user_id, &m.embedding)?;
        if self.lean {
            // The index's row is the one copy.
            m.embedding = Vec::new();
        }
        Ok(())
    }

    /// t = 0: a user's memory from their profile; `None` when the profile is
    /// not newer than the one already applied (a replay).
    ///
    /// # Errors
    /// A wrong-length or non-finite embedding.
    pub fn init_profile(
        &mut self,
        user_id: &str,
        event_id: &str,
        ts_ms: i64,
        content: String,
        embedding: Vec<f32>,
    ) -> Result<Option<MemoryId>, steamrf_kernels::Error> {
        self.forms()?;
        // The profile memory is replaced in place: out of its community's
        // tally before, back in after (changed or not).
        let profile = self.params.evolve.id_key.profile(user_id);
        self.untally(profile);
        let id = self
            .users
            .entry(user_id.to_owned())
            .or_insert_with(|| UserMemories::new(user_id))
            .init_from_profile(
                &self.params.evolve.id_key,
                event_id,
                ts_ms,
                content,
                embedding,
            );
        self.retally(profile);
        if let Some(id) = id {
            self.touch(user_id, id)?;
        }
        Ok(id)
    }

    /// Formation and consolidation for a micro-batch. Observations are
    /// applied per user in event-time order (ties by event id), whatever
    /// order they arrive in, so replays give the same memories.
    ///
    /// # Errors
    /// A wrong-length or non-finite embedding (neither it nor anything after
    /// it is applied).
    pub fn observe(
        &mut self,
        mut batch: Vec<(String, Observation)>,
    ) -> Result<ObserveOutcome, steamrf_kernels::Error> {
        self.forms()?;
        batch.sort_by(|a, b| {
            (a.0.as_str(), a.1.timestamp_ms, a.1.event_id.as_str()).cmp(&(
                b.0.as_str(),
                b.1.timestamp_ms,
                b.1.event_id.as_str(),
            ))
        });
        let mut out = ObserveOutcome::default();
        for (_, obs) in &batch {
            if let (Some(item), Some(title)) = (&obs.item_id, &obs.title) {
                self.learn_item(
                    item,
                    ItemFacts {
                        title: title.clone(),
                        categories: obs.categories.clone(),
                    },
                );
            }
        }
        // A memory consolidated in this batch leaves its community's tally
        // before its first change and joins again once, after the batch
        // (also when an error ends it early).
        let mut out_of_tally: BTreeSet<MemoryId> = BTreeSet::new();
        let applied = self.observe_sorted(&batch, &mut out, &mut out_of_tally);
        for id in out_of_tally {
            self.retally(id);
        }
        applied.map(|()| out)
    }

    /// [`SteamState::observe`]'s loop over a sorted batch.
    fn observe_sorted(
        &mut self,
        batch: &[(String, Observation)],
        out: &mut ObserveOutcome,
        out_of_tally: &mut BTreeSet<MemoryId>,
    ) -> Result<(), steamrf_kernels::Error> {
        let mut seen = BTreeSet::new();
        let dim = self.index.dim();
        for (user_id, obs) in batch {
            // Checked before anything changes: a consolidation with a vector
            // of another length would rewrite the memory's embedding first.
            if obs.embedding.len() != dim || obs.embedding.iter().any(|v| !v.is_finite()) {
                return Err(steamrf_kernels::Error::InvalidInput {
                    message: format!(
                        "observation {:?} of user {user_id:?}: an embedding of {} values, expected {dim} finite ones",
                        obs.event_id,
                        obs.embedding.len()
                    ),
                });
            }
            let (tallies, communities, index) = (&mut self.tallies, &self.communities, &self.index);
            let step = self
                .users
                .entry(user_id.clone())
                .or_insert_with(|| UserMemories::new(user_id.as_str()))
                .observe_with(obs, &self.params.evolve, |m| {
                    if let Some(c) = communities.community_of(m.id)
                        && out_of_tally.insert(m.id)
                    {
                        tallies.leave(c, member(index, m));
                    }
                });
            let id = match step {
                Step::Formed(id) => {
                    let user = self.users.get_mut(user_id).expect("observed above");
                    let held_by_user = user.memories.iter().filter(|m| m.id == id).count() > 1;
                    let held_by_other = self.owner.get(&id).is_some_and(|o| &**o != user_id);
                    if held_by_user || held_by_other {
                        // The new memory is the user's last; the one that
                        // holds the id stays as it was.
                        let last = user.memories.iter().rposition(|m| m.id == id);
                        if let Some(i) = last {
                            user.memories.remove(i);
                        }
                        tracing::warn!(user_id = %user_id, memory_id = %id, "A new memory's id is taken; the observation is refused.");
                        out.refused += 1;
                        continue;
                    }
                    out.formed += 1;
                    id
                }
                Step::Consolidated(id) => {
                    out.consolidated += 1;
                    id
                }
                Step::Unchanged(_) => {
                    out.unchanged += 1;
                    continue;
                }
            };
            self.touch(user_id, id)?;
            if seen.insert(id) {
                out.changed.push(id);
            }
        }
        Ok(())
    }

    /// Relation extraction, community maintenance and prototypes for the
    /// memories in `changed` (the stream of memory changes).
    ///
    /// # Errors
    /// Kernel errors.
    pub fn link(
        &mut self,
        kernel: &dyn SimilarityKernel,
        changed: &[MemoryId],
    ) -> Result<LinkOutcome, steamrf_kernels::Error> {
        let mut out = LinkOutcome::default();
        let started = std::time::Instant::now();
        let found = self
            .index
            .extract(kernel, changed, self.params.k1, self.params.link_tau)?;
        out.extract_time = started.elapsed();
        let mut new_links: BTreeMap<MemoryId, Vec<Link>> =
            changed.iter().map(|&id| (id, Vec::new())).collect();
        for l in found {
            new_links.entry(l.from).or_default().push(l);
        }
        let mut batch = GraphBatch::default();
        for (&from, links) in &new_links {
            if !self.owner.contains_key(&from) {
                continue;
            }
            batch.add_nodes.push(from);
            let old = self
                .out_links
                .insert(from, OutLink::of(links))
                .unwrap_or_default();
            let new_targets: BTreeSet<MemoryId> = links.iter().map(|l| l.to).collect();
            for to in old.iter().map(OutLink::to) {
                if new_targets.contains(&to) {
                    continue;
                }
                out.links_removed.push((from, to));
                // The undirected edge stays if the other side still links back.
                let back = self
                    .out_links
                    .get(&to)
                    .is_some_and(|ls| ls.iter().any(|l| l.to() == from));
                if !back {
                    batch.remove_edges.push((from, to));
                }
            }
            for l in links {
                batch.add_edges.push((from, l.to));
            }
            out.links.extend(links.iter().copied());
        }
        let started = std::time::Instant::now();
        out.delta = self.apply_graph(&batch);
        // A prototype is built from its members' items and embeddings: a
        // member that changed changes it, even when no link did.
        for &m in changed {
            if let Some(c) = self.communities.community_of(m) {
                out.delta.changed.insert(c);
            }
        }
        out.community_time = started.elapsed();
        let started = std::time::Instant::now();
        // A restored memory arrives without its label.
        let moved: Vec<MemoryId> = out.delta.moved.iter().copied().collect();
        self.relabel(changed.iter().chain(&moved).copied());
        self.refresh_prototypes(&mut out);
        out.prototype_time = started.elapsed();
        Ok(out)
    }

    /// Deletes every memory of `user_id` and their links (both directions),
    /// splits the communities they held together, re-links the other users'
    /// memories that pointed at them (their top-k1 must be found again), and
    /// rebuilds or withdraws the affected prototypes. Returns the deleted
    /// memory ids and what the re-linking did.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn forget_user(
        &mut self,
        kernel: &dyn SimilarityKernel,
        user_id: &str,
    ) -> Result<(Vec<MemoryId>, LinkOutcome), steamrf_kernels::Error> {
        let removed = self.users.remove(user_id);
        self.names.remove(user_id);
        let gone: BTreeSet<MemoryId> = removed
            .iter()
            .flat_map(|u| u.memories.iter().map(|m| m.id))
            .collect();
        // Out of their communities' tallies while their content is at hand.
        for m in removed.iter().flat_map(|u| &u.memories) {
            if let Some(c) = self.communities.community_of(m.id) {
                self.tallies.leave(c, member(&self.index, m));
            }
        }
        let batch = GraphBatch {
            remove_nodes: gone.iter().copied().collect(),
            ..GraphBatch::default()
        };
        for id in &gone {
            self.owner.remove(id);
            self.index.remove(*id);
            self.out_links.remove(id);
        }
        // Other memories that linked to the forgotten ones lose those links,
        // and so do links to memories that no longer exist at all (a state
        // restored after the user's memories were deleted elsewhere, as in
        // the scaled-out write path, still has them).
        let mut affected = Vec::new();
        let owner = &self.owner;
        let before = self.out_links.len();
        self.out_links.retain(|from, _| owner.contains_key(from));
        let mut dangling = self.out_links.len() != before;
        for (from, links) in self.out_links.iter_mut() {
            let before = links.len();
            links.retain(|l| !gone.contains(&l.to()) && owner.contains_key(&l.to()));
            if links.len() != before && owner.contains_key(from) {
                affected.push(*from);
            }
        }
        dangling |= !affected.is_empty();
        if gone.is_empty() && !dangling {
            return Ok((Vec::new(), LinkOutcome::default()));
        }
        affected.sort_unstable();
        let delta = self.apply_graph(&batch);
        self.relabel(delta.moved.iter().copied());
        let mut out = self.link(kernel, &affected)?;
        // Merge the removal's community changes into the outcome.
        out.delta.removed.extend(delta.removed.iter().copied());
        out.delta.splits += delta.splits;
        out.delta.moved.extend(delta.moved.iter().copied());
        let mut extra = LinkOutcome {
            delta: CommunityDelta {
                changed: delta
                    .changed
                    .iter()
                    .copied()
                    .filter(|c| !out.delta.changed.contains(c))
                    .collect(),
                removed: delta.removed.clone(),
                ..CommunityDelta::default()
            },
            ..LinkOutcome::default()
        };
        self.refresh_prototypes(&mut extra);
        out.prototypes.extend(extra.prototypes);
        out.prototypes_removed.extend(extra.prototypes_removed);
        out.prototypes_removed.sort_unstable();
        out.prototypes_removed.dedup();
        // A prototype never lists a forgotten memory.
        debug_assert!(
            self.prototypes
                .values()
                .all(|p| p.members.iter().all(|m| !gone.contains(m)))
        );
        Ok((gone.into_iter().collect(), out))
    }

    /// Replaces a memory's content (an LLM's summary instead of the
    /// deterministic one); false if there is no such memory.
    pub fn set_memory_content(&mut self, id: MemoryId, content: String) -> bool {
        self.memory_mut(id).map(|m| m.content = content).is_some()
    }

    /// Replaces a published prototype's content; false if there is none.
    pub fn set_prototype_content(&mut self, id: MemoryId, content: String) -> bool {
        match self.prototypes.get_mut(&id) {
            Some(p) => {
                p.content = content;
                true
            }
            None => false,
        }
    }

    /// The relation-extraction half of [`SteamState::link`] for `memories`,
    /// without changing anything (benchmarks, and checks).
    ///
    /// # Errors
    /// Kernel errors.
    pub fn link_dry_run(
        &self,
        kernel: &dyn SimilarityKernel,
        memories: &[MemoryId],
    ) -> Result<Vec<Link>, steamrf_kernels::Error> {
        self.index
            .extract(kernel, memories, self.params.k1, self.params.link_tau)
    }

    /// Restores a memory as persisted (recovery, or bulk loading), without
    /// evolution or linking.
    ///
    /// # Errors
    /// A wrong-length or non-finite embedding.
    pub fn restore_memory(&mut self, mut m: Memory) -> Result<(), steamrf_kernels::Error> {
        let (user, id) = (m.user_id.clone(), m.id);
        if self.lean {
            m.content = String::new();
            m.interactions = Vec::new();
            m.facets = BTreeMap::new();
            m.recent = Vec::new();
            m.items.shrink_to_fit();
        }
        if let Some(owner) = self.owner.get(&id)
            && **owner != *user
        {
            // Never moves an id to another owner, whatever a table or the
            // changes topic says.
            tracing::warn!(memory_id = %id, owner = %owner, claimed_by = %user, "A restored memory's id belongs to another user; ignored.");
            return Ok(());
        }
        let u = self
            .users
            .entry(user.clone())
            .or_insert_with(|| UserMemories::new(user.as_str()));
        match u.memories.iter_mut().find(|x| x.id == id) {
            Some(x) => {
                // Replaced in place: its community's tally follows.
                if let Some(c) = self.communities.community_of(id) {
                    self.tallies.leave(c, member(&self.index, x));
                    self.tallies.join(c, member(&self.index, &m));
                }
                *x = m;
            }
            None => u.memories.push(m),
        }
        self.touch(&user, id)
    }

    /// Restores a memory's links as persisted, without extraction; call
    /// [`SteamState::rebuild`] after the last one.
    pub fn restore_links(&mut self, from: MemoryId, links: Vec<Link>) {
        self.out_links.insert(from, OutLink::of(&links));
    }

    /// The links memory `from` keeps, as [`SteamState::restore_links`]
    /// takes them (a copy of the state's graph, for benchmarks and checks).
    pub fn links_from(&self, from: MemoryId) -> Vec<Link> {
        self.out_links
            .get(&from)
            .map(|v| v.iter().map(|l| l.link(from)).collect())
            .unwrap_or_default()
    }

    /// Recomputes every community and prototype from the memories and links
    /// (from scratch).
    pub fn rebuild(&mut self) -> LinkOutcome {
        if self.lean {
            // A writer rebuilds once its memories are restored: their
            // vectors, grown by doubling, give back what they over-hold
            // (a third of the memories' own bytes at ten per user).
            for u in self.users.values_mut() {
                u.memories.shrink_to_fit();
            }
        }
        // The old graph goes first, and the edges stream from the links
        // into the new one: neither is held twice at once.
        self.communities = Communities::new();
        let (owner, out_links) = (&self.owner, &self.out_links);
        let edges = out_links
            .iter()
            .filter(|(from, _)| owner.contains_key(from))
            .flat_map(|(&from, links)| links.iter().map(move |l| (from, l.to())))
            .filter(|(_, to)| owner.contains_key(to));
        self.communities =
            Communities::from_graph_capped(owner.keys().copied(), edges, self.params.max_community);
        self.prototypes.clear();
        self.tallies.clear();
        for (c, members) in self.communities.iter() {
            let (users, owner, index) = (&self.users, &self.owner, &self.index);
            self.tallies.resize(c, members.len(), || {
                members
                    .iter()
                    .filter_map(|&m| Some(member(index, find(users, owner, m)?)))
                    .collect()
            });
        }
        let all: Vec<MemoryId> = self.owner.keys().copied().collect();
        self.relabel(all.into_iter());
        let mut out = LinkOutcome::default();
        out.delta.changed = self.communities.iter().map(|(c, _)| c).collect();
        self.refresh_prototypes(&mut out);
        out
    }

    fn memory_mut(&mut self, id: MemoryId) -> Option<&mut Memory> {
        let user = self.owner.get(&id)?;
        self.users
            .get_mut(&**user)?
            .memories
            .iter_mut()
            .find(|m| m.id == id)
    }

    /// What a set of memories may say together to each of their users
    /// (k-anonymous by items): only the items that at least
    /// `params.min_users` distinct users among the members chose, with
    /// their catalogue titles (at most `max_titles`, most widely chosen
    /// first) and categories. Nothing a user wrote (dialogue snippets,
    /// profile attributes, a memory's own content) is ever in it, and an
    /// item only one or two members chose is not named. Also the distinct
    /// users, and the sum of the embeddings. Prototypes are built from it,
    /// and so are their LLM prompts.
    pub fn digest(&self, members: &[MemoryId], max_titles: usize) -> Digest {
        let found = members
            .iter()
            .filter_map(|&id| Some(member(&self.index, self.memory(id)?)));
        Tally::of(self.tallies.dim(), found).digest(
            &self.catalogue,
            self.params.min_users,
            max_titles,
        )
    }

    /// Community `c`'s digest: from its tally where it keeps one, else from
    /// its members (the same result: [`tally`]).
    fn community_digest(&self, c: MemoryId, members: &[MemoryId]) -> Digest {
        match self.tallies.get(c) {
            Some(t) => t.digest(&self.catalogue, self.params.min_users, memory::RECENT),
            None => self.digest(members, memory::RECENT),
        }
    }

    /// Applies a batch to the link graph and moves the members whose
    /// community changed between the tallies.
    fn apply_graph(&mut self, batch: &GraphBatch) -> CommunityDelta {
        let delta = self.communities.apply(batch);
        let (users, owner, index) = (&self.users, &self.owner, &self.index);
        for (&m, &c) in &delta.left {
            // A forgotten memory left its tally before it went.
            if let Some(mem) = find(users, owner, m) {
                self.tallies.leave(c, member(index, mem));
            }
        }
        for &m in &delta.moved {
            if let (Some(c), Some(mem)) = (self.communities.community_of(m), find(users, owner, m))
            {
                self.tallies.join(c, member(index, mem));
            }
        }
        for &c in &delta.removed {
            self.tallies.remove(c);
        }
        for &c in &delta.changed {
            let Some(members) = self.communities.members(c) else {
                continue;
            };
            self.tallies.resize(c, members.len(), || {
                members
                    .iter()
                    .filter_map(|&m| Some(member(index, find(users, owner, m)?)))
                    .collect()
            });
            debug_assert!(
                self.tallies
                    .get(c)
                    .is_none_or(|t| t.members() == members.len()),
                "community {c}'s tally counts {} members, it has {}",
                self.tallies.get(c).map_or(0, Tally::members),
                members.len()
            );
        }
        delta
    }

    /// Takes `id`'s current content out of its community's tally (before
    /// an in-place change).
    fn untally(&mut self, id: MemoryId) {
        if let (Some(c), Some(m)) = (
            self.communities.community_of(id),
            find(&self.users, &self.owner, id),
        ) {
            self.tallies.leave(c, member(&self.index, m));
        }
    }

    /// Puts `id`'s current content back into its community's tally.
    fn retally(&mut self, id: MemoryId) {
        if let (Some(c), Some(m)) = (
            self.communities.community_of(id),
            find(&self.users, &self.owner, id),
        ) {
            self.tallies.join(c, member(&self.index, m));
        }
    }

    /// Sets each of `ids`' community label to its community now (none if
    /// it is in none).
    fn relabel(&mut self, ids: impl Iterator<Item = MemoryId>) {
        for id in ids {
            let c = self.communities.community_of(id);
            if let Some(m) = self.memory_mut(id) {
                m.community = c;
            }
        }
    }

    /// Rebuilds the prototypes of changed communities, withdraws removed
    /// ones, and updates members' community links (L).
    fn refresh_prototypes(&mut self, out: &mut LinkOutcome) {
        for id in &out.delta.removed {
            if self.prototypes.remove(id).is_some() {
                out.prototypes_removed.push(*id);
            }
        }
        let changed: Vec<MemoryId> = out.delta.changed.iter().copied().collect();
        for c in changed {
            let Some(members) = self.communities.members(c) else {
                continue;
            };
            let members: Vec<MemoryId> = members.iter().copied().collect();
            // Fewer members than the user floor cannot publish.
            let digest = if members.len() < self.params.min_users {
                Digest::default()
            } else {
                self.community_digest(c, &members)
            };
            if digest.users < self.params.min_users {
                if self.prototypes.remove(&c).is_some() {
                    out.prototypes_removed.push(c);
                }
                continue;
            }
            let p = Prototype {
                id: c,
                content: prototype_content(&digest),
                embedding: memory::normalized(digest.sum),
                members,
                users: digest.users,
            };
            // A writer's prototype is published once and rebuilt from its
            // community when asked again (`published`): its embedding is
            // not kept.
            let kept = if self.lean {
                Prototype {
                    id: p.id,
                    content: p.content.clone(),
                    embedding: Vec::new(),
                    members: p.members.clone(),
                    users: p.users,
                }
            } else {
                p.clone()
            };
            self.prototypes.insert(c, kept);
            out.prototypes.push(p);
        }
    }
}

/// Memory `id` of `users`, found through `owner` (a free function so that
/// callers can borrow the other fields of the state at the same time).
fn find<'a>(
    users: &'a BTreeMap<String, UserMemories>,
    owner: &HashMap<MemoryId, Arc<str>>,
    id: MemoryId,
) -> Option<&'a Memory> {
    let u = users.get(&**owner.get(&id)?)?;
    u.memories.iter().find(|m| m.id == id)
}

/// `m` as its community's tally reads it: its embedding from the memory, or
/// from the relation index where a lean state keeps it alone.
fn member<'a>(index: &'a MemoryIndex, m: &'a Memory) -> Member<'a> {
    let embedding = if m.embedding.is_empty() {
        index.embedding(m.id).unwrap_or_default()
    } else {
        Cow::Borrowed(m.embedding.as_slice())
    };
    Member {
        memory: m,
        embedding,
    }
}

/// The items at least `floor` (and at least one) distinct users chose among
/// `members`, with how many users chose each, by item id. What a community
/// may say about its members' choices to each of them: an item fewer
/// users chose would single them out (docs/security.md).
pub fn shared_items<'a>(
    members: impl IntoIterator<Item = &'a Memory>,
    floor: usize,
) -> BTreeMap<&'a str, usize> {
    // (item, user) pairs, sorted and deduplicated: each item's run is its
    // distinct users.
    let mut chosen: Vec<(&str, &str)> = Vec::new();
    for m in members {
        chosen.extend(m.items.iter().map(|i| (i.as_str(), m.user_id.as_str())));
    }
    chosen.sort_unstable();
    chosen.dedup();
    let mut out = BTreeMap::new();
    for run in chosen.chunk_by(|a, b| a.0 == b.0) {
        if run.len() >= floor.max(1) {
            out.insert(run[0].0, run.len());
        }
    }
    out
}

/// A prototype's content from its digest: the shared items' top categories
/// and titles (most widely chosen first), or nothing when no item is shared
/// by enough users.
pub fn prototype_content(d: &Digest) -> String {
    // `summarise` lists its examples newest last; the titles are best first.
    let titles: Vec<String> = d.titles.iter().rev().cloned().collect();
    summarise(&d.facets, &titles)
}

#[cfg(test)]
mod tests;
