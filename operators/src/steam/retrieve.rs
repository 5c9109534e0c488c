//! Local-to-global retrieval (STEAM §3.3) and the ranking of candidate items
//! built on it (the paper's inference phase, without an LLM).
//!
//! Retrieval for a user and a query embedding: the user's top-k2 memories
//! with cosine ≥ τ (local); then, through the *published* prototypes of
//! those memories' communities, the most similar memories of other users in
//! the same communities (collaborative) with the items they interacted with.
//! Another user's memory is only ever reached through a published prototype,
//! so nothing of a community below the user floor leaves its owner.
//!
//! Ranking a candidate item c (unit embedding e_c) for a user:
//!
//! score(c) = local(c) + β · collab(c) + γ · seen(c) + δ · neighbours(c)
//!
//! - local(c): the best cosine between e_c and the user's memories retrieved for it;
//! - collab(c): the best cosine between e_c and the collaborative memories;
//! - seen(c): the share of those collaborative memories whose users
//!   interacted with c itself (the paper's case study: "identifies an
//!   interaction behavior consistent with the candidate").
//!
//! - neighbours(c): a user-kNN through the community (issue 17's "memory-level
//!   neighbour items weighted by link score"): the k_n other users' memories
//!   of the matched memory's published prototype most similar to that
//!   memory (cosine > 0, the similarity links are drawn by), and the share
//!   of their summed similarity held by those that interacted with c.
//!   Unlike seen(c), whose memories are the ones nearest the *candidate*,
//!   these are the ones nearest the *user's memory*: users like this one,
//!   not items like this one. The write path's links (k1 = 2 per memory)
//!   are too few to vote, so the neighbours are re-drawn from the members at
//!   query time, with today's embeddings.
//!
//! β, γ and δ are configuration (`RecommendParams`); β = γ = δ = 0 is the
//! paper's "w/o CC" ablation.

use std::collections::{BTreeMap, HashMap, HashSet};

use steamrf_kernels::{Corpus, SearchParams, SimilarityKernel};

use super::memory::{Memory, UserMemories, dot};
use super::{MemoryId, Prototype, SteamState};

/// What local-to-global retrieval reads: the whole [`SteamState`] (the write
/// path, the evaluation), or a partial view assembled for one user (the
/// retrieval service's cache: the user's memories, the published
/// prototypes, and the members of the prototypes the user's memories are in).
pub trait MemoryView {
    /// A user's memories.
    fn user(&self, user_id: &str) -> Option<&UserMemories>;
    /// The community of a memory.
    fn community_of(&self, m: MemoryId) -> Option<MemoryId>;
    /// A published prototype (by community id).
    fn prototype(&self, c: MemoryId) -> Option<&Prototype>;
    /// A memory by id.
    fn memory(&self, id: MemoryId) -> Option<&Memory>;
    /// `tenancy.separator`: another user's memory informs an answer only
    /// when both users are of one tenant ([`peer`]), whatever the stored
    /// communities say (a changed separator, or tables another
    /// configuration wrote, must not let votes or memories cross tenants).
    fn tenant_separator(&self) -> Option<char>;
    /// An item's unit embedding, where the view has the catalogue (for
    /// [`RecommendParams::item_weight`]); `None` by default.
    fn item_vector(&self, _item: &str) -> Option<&[f32]> {
        None
    }
}

impl MemoryView for SteamState {
    fn user(&self, user_id: &str) -> Option<&UserMemories> {
        SteamState::user(self, user_id)
    }
    fn community_of(&self, m: MemoryId) -> Option<MemoryId> {
        self.communities().community_of(m)
    }
    fn prototype(&self, c: MemoryId) -> Option<&Prototype> {
        SteamState::prototype(self, c)
    }
    fn memory(&self, id: MemoryId) -> Option<&Memory> {
        SteamState::memory(self, id)
    }
    fn tenant_separator(&self) -> Option<char> {
        self.params().tenant_separator
    }
}

/// Whether `other`'s memory may inform `user_id`'s answers: another user
/// of the same tenant (`steamrf_schemas::tenancy::is_peer`).
pub fn peer(view: &impl MemoryView, user_id: &str, other: &Memory) -> bool {
    steamrf_schemas::tenancy::is_peer(user_id, &other.user_id, view.tenant_separator())
}

/// Retrieval and ranking parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecommendParams {
    /// k2: local memories per query (paper: 1).
    pub k2: usize,
    /// τ: the least cosine for a local memory (paper: 0.5). When none
    /// reaches it, the single best memory is used, so every user gets a score.
    pub tau: f32,
    /// Collaborative memories kept per query.
    pub k_collab: usize,
    /// β: weight of the collaborative similarity.
    pub collab_weight: f32,
    /// γ: weight of collaborative users having interacted with the candidate.
    pub seen_weight: f32,
    /// w: how much of local(c) is the best single item behind the matched
    /// memory rather than the memory's centroid:
    /// `(1 − w) · cos(c, centroid) + w · max over its items cos(c, item)`,
    /// over the items the view has vectors for. 0 is the paper's centroid.
    pub item_weight: f32,
    /// δ: weight of neighbours(c), the user-kNN through the community (see
    /// the module docs). 0 is the paper's score. The default, 10, was chosen
    /// on the validation splits (docs/steam.md): the neighbours' vote
    /// decides, and the cosine terms order what it leaves tied.
    pub neighbour_weight: f32,
    /// k_n: neighbour memories that vote in neighbours(c) (default 20,
    /// chosen with δ).
    pub k_neighbours: usize,
}

impl Default for RecommendParams {
    fn default() -> Self {
        Self {
            k2: 1,
            tau: 0.5,
            k_collab: 5,
            collab_weight: 0.5,
            seen_weight: 0.3,
            item_weight: 0.0,
            neighbour_weight: 10.0,
            k_neighbours: 20,
        }
    }
}

impl RecommendParams {
    /// Whether neighbours(c) counts (δ ≠ 0 and k_n > 0), so is drawn at all.
    fn draws_neighbours(&self) -> bool {
        self.neighbour_weight != 0.0 && self.k_neighbours > 0
    }
}

/// One retrieved memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    /// The memory.
    pub memory_id: MemoryId,
    /// Its owner.
    pub user_id: String,
    /// Cosine with the query.
    pub score: f32,
    /// The prototype it was reached through (collaborative hits only).
    pub via_prototype: Option<MemoryId>,
}

/// What local-to-global retrieval found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Retrieved {
    /// The user's own memories, best first.
    pub local: Vec<Hit>,
    /// Other users' memories reached through published prototypes, best first.
    pub collaborative: Vec<Hit>,
}

/// A ranked candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranked {
    /// The candidate's id, as given.
    pub item_id: String,
    /// The score (higher is better).
    pub score: f32,
    /// local(c).
    pub local: f32,
    /// collab(c).
    pub collab: f32,
    /// seen(c).
    pub seen: f32,
    /// neighbours(c).
    pub neighbours: f32,
    /// The user's memory that matched best.
    pub memory_id: Option<MemoryId>,
}

impl SteamState {
    /// Local-to-global retrieval for `user_id` with a unit-length `query`.
    pub fn retrieve(&self, user_id: &str, query: &[f32], p: &RecommendParams) -> Retrieved {
        retrieve(self, user_id, query, p)
    }

    /// Ranks `candidates` (item id, unit embedding) for `user_id`, best
    /// first (ties: input order).
    pub fn recommend(
        &self,
        user_id: &str,
        candidates: &[(String, Vec<f32>)],
        p: &RecommendParams,
    ) -> Vec<Ranked> {
        recommend(self, user_id, candidates, p)
    }
}

/// Local-to-global retrieval for `user_id` with a unit-length `query`.
pub fn retrieve(
    view: &impl MemoryView,
    user_id: &str,
    query: &[f32],
    p: &RecommendParams,
) -> Retrieved {
    let mut out = Retrieved::default();
    let Some(user) = view.user(user_id) else {
        return out;
    };
    let mut local = user.top_k(query, p.k2, p.tau);
    if local.is_empty() {
        local = user.top_k(query, 1, f32::NEG_INFINITY);
    }
    // (score, prototype) per reached memory; owners are filled in for
    // the k_collab kept only (this runs once per recommend candidate).
    let mut collab: BTreeMap<MemoryId, (f32, MemoryId)> = BTreeMap::new();
    for &(i, score) in &local {
        let m = &user.memories[i];
        out.local.push(Hit {
            memory_id: m.id,
            user_id: user_id.to_owned(),
            score,
            via_prototype: None,
        });
        let Some(c) = view.community_of(m.id) else {
            continue;
        };
        let Some(proto) = view.prototype(c) else {
            continue;
        };
        for &other in &proto.members {
            let Some(om) = view.memory(other) else {
                continue;
            };
            if !peer(view, user_id, om) {
                continue;
            }
            collab
                .entry(other)
                .or_insert_with(|| (dot(query, &om.embedding), proto.id));
        }
    }
    let mut collab: Vec<(MemoryId, (f32, MemoryId))> = collab.into_iter().collect();
    collab.sort_by(|a, b| b.1.0.total_cmp(&a.1.0).then(a.0.cmp(&b.0)));
    collab.truncate(p.k_collab);
    out.collaborative = collab
        .into_iter()
        .map(|(memory_id, (score, proto))| Hit {
            memory_id,
            user_id: view
                .memory(memory_id)
                .map_or_else(String::new, |m| m.user_id.clone()),
            score,
            via_prototype: Some(proto),
        })
        .collect();
    out
}

/// Ranks `candidates` (item id, unit embedding) for `user_id`, best first
/// (ties: input order).
///
/// Batched: the candidates are scored against the user's memories in one
/// kernel call, then against the members of the published prototypes they
/// reach in one call per reached set of communities (with k2 = 1, one per
/// community), instead of one local-to-global retrieval per candidate; the
/// matched memories' neighbours(c) are drawn from the same members in one
/// more call. The result is [`recommend_each`]'s, up to float rounding in
/// the scores.
pub fn recommend(
    view: &impl MemoryView,
    user_id: &str,
    candidates: &[(String, Vec<f32>)],
    p: &RecommendParams,
) -> Vec<Ranked> {
    recommend_batched(view, user_id, candidates, p)
        .unwrap_or_else(|_| recommend_each(view, user_id, candidates, p))
}

fn recommend_batched(
    view: &impl MemoryView,
    user_id: &str,
    candidates: &[(String, Vec<f32>)],
    p: &RecommendParams,
) -> Result<Vec<Ranked>, steamrf_kernels::Error> {
    use steamrf_kernels::cpu::CpuKernel;

    let Some(user) = view.user(user_id).filter(|u| !u.memories.is_empty()) else {
        return Ok(recommend_each(view, user_id, candidates, p));
    };
    if candidates.is_empty() || p.k2 == 0 {
        return Ok(recommend_each(view, user_id, candidates, p));
    }
    let dim = user.memories[0].embedding.len();
    // One request, one core (as the service's searches).
    let kernel = CpuKernel {
        threads: 1,
        ..CpuKernel::default()
    };
    let queries: Vec<f32> = candidates
        .iter()
        .flat_map(|(_, e)| e.iter().copied())
        .collect();
    let mine: Vec<f32> = user
        .memories
        .iter()
        .flat_map(|m| m.embedding.iter().copied())
        .collect();
    let mine = Corpus::from_vec(mine, dim)?;
    // Local: the top k2 with cosine ≥ τ, else the single best.
    let local: Vec<Vec<(usize, f32)>> = kernel
        .top_k(&queries, &mine, &SearchParams::top(p.k2))?
        .into_iter()
        .map(|hits| {
            let above: Vec<(usize, f32)> = hits
                .iter()
                .filter(|h| h.score >= p.tau)
                .map(|h| (h.index as usize, h.score))
                .collect();
            if above.is_empty() {
                hits.first()
                    .map(|h| vec![(h.index as usize, h.score)])
                    .unwrap_or_default()
            } else {
                above
            }
        })
        .collect();
    // Each candidate's reached prototypes (community → prototype), grouped.
    let mut groups: BTreeMap<Vec<MemoryId>, Vec<usize>> = BTreeMap::new();
    for (c, hits) in local.iter().enumerate() {
        let mut reached: Vec<MemoryId> = hits
            .iter()
            .filter_map(|&(i, _)| view.community_of(user.memories[i].id))
            .filter(|&c| view.prototype(c).is_some())
            .collect();
        reached.sort_unstable();
        reached.dedup();
        if !reached.is_empty() {
            groups.entry(reached).or_default().push(c);
        }
    }
    let mut collab: Vec<Vec<Hit>> = vec![Vec::new(); candidates.len()];
    let mut voters = Neighbours::default();
    for (reached, members_of) in &groups {
        // The other users' memories of those prototypes, by id (the
        // tie-break of `recommend_each`), each through the first prototype
        // (in community order) that lists it.
        let mut members: BTreeMap<MemoryId, (&Memory, MemoryId)> = BTreeMap::new();
        for &c in reached {
            let Some(proto) = view.prototype(c) else {
                continue;
            };
            for &other in &proto.members {
                if let Some(om) = view.memory(other)
                    && peer(view, user_id, om)
                {
                    members.entry(other).or_insert((om, proto.id));
                }
            }
        }
        if members.is_empty() {
            continue;
        }
        let members: Vec<Member<'_>> = members.into_iter().collect();
        let corpus = Corpus::from_vec(
            members
                .iter()
                .flat_map(|(_, (m, _))| m.embedding.iter().copied())
                .collect(),
            dim,
        )?;
        let q: Vec<f32> = members_of
            .iter()
            .flat_map(|&c| candidates[c].1.iter().copied())
            .collect();
        let found = kernel.top_k(&q, &corpus, &SearchParams::top(p.k_collab))?;
        // neighbours(c) of the group's matched memories on the same corpus,
        // in one call, where it is exactly their community's other users'
        // memories: the group reaches one community, theirs (k2 = 1 always).
        // Anything else is drawn one memory at a time by `voters`.
        if let [community] = reached.as_slice()
            && p.draws_neighbours()
        {
            let matched = members_of
                .iter()
                .filter_map(|&c| local[c].first().map(|&(m, _)| &user.memories[m]))
                .filter(|m| view.community_of(m.id) == Some(*community));
            voters.draw(&kernel, (&corpus, &members), matched, p.k_neighbours)?;
        }
        for (&c, hits) in members_of.iter().zip(found) {
            collab[c] = hits
                .into_iter()
                .map(|h| {
                    let (id, (m, proto)) = &members[h.index as usize];
                    Hit {
                        memory_id: *id,
                        user_id: m.user_id.clone(),
                        score: h.score,
                        via_prototype: Some(*proto),
                    }
                })
                .collect();
        }
    }
    let mut items_of: HashMap<MemoryId, HashSet<&str>> = HashMap::new();
    let mut out: Vec<(usize, Ranked)> = Vec::with_capacity(candidates.len());
    for (i, (item, _)) in candidates.iter().enumerate() {
        let l = local[i].first();
        let local_score = l.map_or(0.0, |&(m, s)| {
            per_item(view, &user.memories[m], &candidates[i].1, s, p.item_weight)
        });
        let matched = l.map(|&(m, _)| &user.memories[m]);
        let neighbours = voters.of(view, matched, item, p);
        let ranked = rank(
            view,
            item,
            (local_score, neighbours),
            matched.map(|m| m.id),
            &collab[i],
            p,
            &mut items_of,
        );
        out.push((i, ranked));
    }
    out.sort_by(|a, b| b.1.score.total_cmp(&a.1.score).then(a.0.cmp(&b.0)));
    Ok(out.into_iter().map(|(_, r)| r).collect())
}

/// local(c) with [`RecommendParams::item_weight`] of the best item behind
/// memory `m` mixed into its centroid score.
fn per_item(view: &impl MemoryView, m: &Memory, c: &[f32], centroid: f32, w: f32) -> f32 {
    if w == 0.0 {
        return centroid;
    }
    let best = m
        .items
        .iter()
        .filter_map(|i| view.item_vector(i))
        .map(|v| dot(c, v))
        .fold(None, |b: Option<f32>, s| Some(b.map_or(s, |b| b.max(s))));
    match best {
        Some(b) => (1.0 - w) * centroid + w * b,
        None => centroid,
    }
}

/// A community member other than the asking user's: its id, the memory,
/// and the prototype it was reached through.
type Member<'a> = (MemoryId, (&'a Memory, MemoryId));

/// neighbours(c) of the memories matched so far, each drawn once per
/// request: matched memory → (item → its share of the neighbours' votes).
#[derive(Default)]
struct Neighbours<'a> {
    votes: HashMap<MemoryId, HashMap<&'a str, f32>>,
}

impl<'a> Neighbours<'a> {
    /// Draws the votes of the `matched` memories not drawn yet in one kernel
    /// call over `corpus`, whose rows are `members` (by id: the tie-break of
    /// [`neighbour_votes`]): every other user's memory of their community.
    fn draw<'m>(
        &mut self,
        kernel: &impl SimilarityKernel,
        (corpus, members): (&Corpus, &[Member<'a>]),
        matched: impl Iterator<Item = &'m Memory>,
        k: usize,
    ) -> Result<(), steamrf_kernels::Error> {
        let mut matched: Vec<&Memory> = matched
            .filter(|m| !self.votes.contains_key(&m.id))
            .collect();
        matched.sort_unstable_by_key(|m| m.id);
        matched.dedup_by_key(|m| m.id);
        if matched.is_empty() {
            return Ok(());
        }
        let q: Vec<f32> = matched
            .iter()
            .flat_map(|m| m.embedding.iter().copied())
            .collect();
        let params = SearchParams {
            k,
            min_score: f32::MIN_POSITIVE,
            exclude: None,
        };
        for (m, hits) in matched.iter().zip(kernel.top_k(&q, corpus, &params)?) {
            let near = hits
                .iter()
                .filter(|h| h.score > 0.0)
                .map(|h| (h.score, members[h.index as usize].1.0));
            self.votes.insert(m.id, votes_of(near));
        }
        Ok(())
    }

    /// neighbours(`item`) through `matched` (0 without one, or with δ = 0).
    fn of(
        &mut self,
        view: &'a impl MemoryView,
        matched: Option<&'a Memory>,
        item: &str,
        p: &RecommendParams,
    ) -> f32 {
        let Some(m) = matched.filter(|_| p.draws_neighbours()) else {
            return 0.0;
        };
        self.votes
            .entry(m.id)
            .or_insert_with(|| neighbour_votes(view, m, p.k_neighbours))
            .get(item)
            .copied()
            .unwrap_or(0.0)
    }
}

/// The k most similar other users' memories of `m`'s published prototype
/// (cosine > 0; ties by id) and, per item they hold, its share of their
/// summed similarity.
fn neighbour_votes<'a>(view: &'a impl MemoryView, m: &Memory, k: usize) -> HashMap<&'a str, f32> {
    let Some(proto) = view.community_of(m.id).and_then(|c| view.prototype(c)) else {
        return HashMap::new();
    };
    let mut near: Vec<(f32, MemoryId, &Memory)> = proto
        .members
        .iter()
        .filter_map(|&id| view.memory(id).map(|o| (id, o)))
        .filter(|(_, o)| peer(view, &m.user_id, o))
        .map(|(id, o)| (dot(&m.embedding, &o.embedding), id, o))
        .filter(|(s, _, _)| *s > 0.0)
        .collect();
    near.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    near.truncate(k);
    votes_of(near.into_iter().map(|(s, _, o)| (s, o)))
}

/// Per item held by the `near` memories (cosine, memory), its share of
/// their summed cosine.
fn votes_of<'a>(near: impl Iterator<Item = (f32, &'a Memory)> + Clone) -> HashMap<&'a str, f32> {
    let total: f32 = near.clone().map(|(s, _)| s).sum();
    let mut votes = HashMap::new();
    for (s, o) in near {
        for item in &o.items {
            *votes.entry(item.as_str()).or_insert(0.0) += s / total;
        }
    }
    votes
}

/// [`Ranked`] from a candidate's local score and neighbours(c), and its
/// collaborative hits.
fn rank<'a>(
    view: &'a impl MemoryView,
    item: &str,
    (local, neighbours): (f32, f32),
    memory_id: Option<MemoryId>,
    collaborative: &[Hit],
    p: &RecommendParams,
    items_of: &mut HashMap<MemoryId, HashSet<&'a str>>,
) -> Ranked {
    let collab = collaborative.first().map_or(0.0, |h| h.score);
    let seen = if collaborative.is_empty() {
        0.0
    } else {
        let n = collaborative
            .iter()
            .filter(|h| {
                items_of
                    .entry(h.memory_id)
                    .or_insert_with(|| {
                        view.memory(h.memory_id).map_or_else(HashSet::new, |m| {
                            m.items.iter().map(String::as_str).collect()
                        })
                    })
                    .contains(item)
            })
            .count();
        n as f32 / collaborative.len() as f32
    };
    Ranked {
        item_id: item.to_owned(),
        score: local
            + p.collab_weight * collab
            + p.seen_weight * seen
            + p.neighbour_weight * neighbours,
        local,
        collab,
        seen,
        neighbours,
        memory_id,
    }
}

/// [`recommend`] one local-to-global retrieval per candidate: the
/// reference the batched path is tested against, and its fallback.
pub fn recommend_each(
    view: &impl MemoryView,
    user_id: &str,
    candidates: &[(String, Vec<f32>)],
    p: &RecommendParams,
) -> Vec<Ranked> {
    // Item sets of the collaborative memories met so far: a memory of a
    // long history holds hundreds of items, and every candidate asks.
    let mut items_of: HashMap<MemoryId, HashSet<&str>> = HashMap::new();
    let mut voters = Neighbours::default();
    let mut out: Vec<(usize, Ranked)> = Vec::with_capacity(candidates.len());
    for (i, (item, e)) in candidates.iter().enumerate() {
        let r = retrieve(view, user_id, e, p);
        let matched = r.local.first().and_then(|h| view.memory(h.memory_id));
        let local = r.local.first().map_or(0.0, |h| match matched {
            Some(m) => per_item(view, m, e, h.score, p.item_weight),
            None => h.score,
        });
        let neighbours = voters.of(view, matched, item, p);
        let memory_id = r.local.first().map(|h| h.memory_id);
        let ranked = rank(
            view,
            item,
            (local, neighbours),
            memory_id,
            &r.collaborative,
            p,
            &mut items_of,
        );
        out.push((i, ranked));
    }
    out.sort_by(|a, b| b.1.score.total_cmp(&a.1.score).then(a.0.cmp(&b.0)));
    out.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use steamrf_kernels::cpu::CpuKernel;

    use super::*;
    use crate::steam::SteamParams;
    use crate::steam::memory::Observation;

    fn obs(event: &str, item: &str, v: [f32; 3]) -> Observation {
        Observation {
            event_id: event.into(),
            timestamp_ms: 0,
            embedding: v.to_vec(),
            item_id: Some(item.into()),
            title: Some(item.into()),
            categories: vec![],
            text: None,
        }
    }

    fn state() -> SteamState {
        let mut s = SteamState::new(SteamParams::default(), 3);
        let o = s
            .observe(vec![
                ("ann".into(), obs("a1", "blue-train", [1.0, 0.1, 0.0])),
                ("ben".into(), obs("b1", "giant-steps", [0.9, 0.2, 0.0])),
                ("ben".into(), obs("b2", "dave", [0.95, 0.15, 0.05])),
                ("cat".into(), obs("c1", "so-what", [0.95, 0.0, 0.1])),
                ("cat".into(), obs("c2", "dave", [0.97, 0.05, 0.1])),
                ("dan".into(), obs("d1", "alien", [0.0, 0.0, 1.0])),
            ])
            .unwrap();
        s.link(&CpuKernel::default(), &o.changed).unwrap();
        s
    }

    #[test]
    fn retrieval_goes_local_then_through_the_prototype() {
        let s = state();
        let r = s.retrieve("ann", &[1.0, 0.0, 0.0], &RecommendParams::default());
        assert_eq!(r.local.len(), 1);
        assert_eq!(r.local[0].user_id, "ann");
        let users: Vec<&str> = r.collaborative.iter().map(|h| h.user_id.as_str()).collect();
        assert!(
            users.contains(&"ben") && users.contains(&"cat"),
            "{users:?}"
        );
        assert!(r.collaborative.iter().all(|h| h.via_prototype.is_some()));
        // dan's sci-fi memory is in no published community with ann's.
        assert!(!users.contains(&"dan"));
    }

    #[test]
    fn collaborative_interactions_lift_a_candidate() {
        let s = state();
        // Two candidates equally close to ann's memory: "dave", which her
        // community's users chose, and an unseen one.
        let e = vec![0.98, 0.1, 0.05];
        let cands = vec![("unseen".to_owned(), e.clone()), ("dave".to_owned(), e)];
        let ranked = s.recommend("ann", &cands, &RecommendParams::default());
        assert_eq!(ranked[0].item_id, "dave");
        assert!(ranked[0].seen > 0.0);
        assert_eq!(ranked[1].seen, 0.0);
        // Without the collaborative step (w/o CC) the tie stays in input order.
        let no_cc = RecommendParams {
            collab_weight: 0.0,
            seen_weight: 0.0,
            neighbour_weight: 0.0,
            ..RecommendParams::default()
        };
        let ranked = s.recommend("ann", &cands, &no_cc);
        assert_eq!(ranked[0].item_id, "unseen");
    }

    #[test]
    fn the_users_most_like_this_one_vote_for_their_items() {
        let s = state();
        // Candidates equally close to everything: only neighbours(c) differs.
        let e = vec![0.98, 0.1, 0.05];
        let cands: Vec<(String, Vec<f32>)> = ["alien", "so-what", "giant-steps", "dave"]
            .iter()
            .map(|i| ((*i).to_owned(), e.clone()))
            .collect();
        let only = |k_neighbours| RecommendParams {
            collab_weight: 0.0,
            seen_weight: 0.0,
            neighbour_weight: 1.0,
            k_neighbours,
            ..RecommendParams::default()
        };
        let votes = |k| -> Vec<(String, f32)> {
            s.recommend("ann", &cands, &only(k))
                .into_iter()
                .map(|r| (r.item_id, r.neighbours))
                .collect()
        };
        // Ben and cat (ann's community) both hold "dave"; dan's "alien" is
        // in no community of ann's, so it gets no vote.
        let both = votes(20);
        assert_eq!(both[0], ("dave".to_owned(), 1.0));
        assert!(both[1].1 > 0.0 && both[2].1 > 0.0 && both[1].1 + both[2].1 > 0.99);
        assert_eq!(both[3], ("alien".to_owned(), 0.0));
        // With one neighbour, only the nearest (ben) votes.
        let one = votes(1);
        let of = |item: &str| one.iter().find(|v| v.0 == item).unwrap().1;
        assert_eq!(
            (of("giant-steps"), of("dave"), of("so-what")),
            (1.0, 1.0, 0.0)
        );
        // δ = 0 is the paper's score: nothing changes.
        let plain = s.recommend(
            "ann",
            &cands,
            &RecommendParams {
                neighbour_weight: 0.0,
                ..RecommendParams::default()
            },
        );
        let with = s.recommend("ann", &cands, &RecommendParams::default());
        for a in &plain {
            let b = with.iter().find(|b| b.item_id == a.item_id).unwrap();
            assert_eq!(a.neighbours, 0.0, "not drawn when δ = 0");
            assert!((b.score - a.score - 10.0 * b.neighbours).abs() < 1e-5);
        }
    }

    #[test]
    fn nothing_leaks_below_the_privacy_floor() {
        let mut s = SteamState::new(
            SteamParams {
                min_users: 4,
                ..SteamParams::default()
            },
            3,
        );
        let o = s
            .observe(vec![
                ("ann".into(), obs("a1", "x", [1.0, 0.0, 0.0])),
                ("ben".into(), obs("b1", "y", [0.9, 0.1, 0.0])),
                ("cat".into(), obs("c1", "z", [0.95, 0.0, 0.1])),
            ])
            .unwrap();
        s.link(&CpuKernel::default(), &o.changed).unwrap();
        let r = s.retrieve("ann", &[1.0, 0.0, 0.0], &RecommendParams::default());
        assert!(r.collaborative.is_empty());
        assert_eq!(
            s.retrieve("nobody", &[1.0, 0.0, 0.0], &RecommendParams::default()),
            Retrieved::default()
        );
    }

    /// The batched ranking equals one retrieval per candidate: same order,
    /// same reasons, scores within float rounding; for k2 = 1 and k2 = 3.
    #[test]
    fn batched_ranking_equals_one_retrieval_per_candidate() {
        // 30 users over 6 interest directions in 8 dimensions; candidates
        // spread over the same directions.
        let dim = 8;
        let mut seed = 7u64;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 10_000) as f32 / 10_000.0 - 0.5
        };
        let mut s = SteamState::new(SteamParams::default(), dim);
        let mut batch = Vec::new();
        for u in 0..30 {
            for k in 0..5 {
                let topic = (u + k * (u % 3)) % 6;
                let mut v: Vec<f32> = (0..dim).map(|_| 0.15 * rnd()).collect();
                v[topic] += 1.0;
                let item = format!("i{}", (u * 7 + k) % 40);
                let mut o = obs(&format!("u{u}-{k}"), &item, [0.0; 3]);
                o.embedding = v;
                batch.push((format!("u{u}"), o));
            }
        }
        let o = s.observe(batch).unwrap();
        s.link(&CpuKernel::default(), &o.changed).unwrap();
        let cands: Vec<(String, Vec<f32>)> = (0..40)
            .map(|i| {
                let mut v: Vec<f32> = (0..dim).map(|_| 0.3 * rnd()).collect();
                v[i % 6] += 1.0;
                crate::embed::normalize(&mut v);
                (format!("i{i}"), v)
            })
            .collect();
        let mut compared = 0;
        for k2 in [1, 3] {
            let p = RecommendParams {
                k2,
                ..RecommendParams::default()
            };
            for u in 0..30 {
                let user = format!("u{u}");
                let a = s.recommend(&user, &cands, &p);
                let b = recommend_each(&s, &user, &cands, &p);
                assert_eq!(a.len(), b.len());
                for (x, y) in a.iter().zip(&b) {
                    assert!((x.score - y.score).abs() < 1e-4, "{user}: {x:?} vs {y:?}");
                    assert!((x.seen - y.seen).abs() < 1e-6, "{user}: {x:?} vs {y:?}");
                    assert!(
                        (x.neighbours - y.neighbours).abs() < 1e-6,
                        "{user}: {x:?} vs {y:?}"
                    );
                    compared += usize::from(x.collab > 0.0);
                }
                let order = |r: &[Ranked]| r.iter().map(|x| x.item_id.clone()).collect::<Vec<_>>();
                // Orders agree except where two scores are within rounding.
                for (x, y) in order(&a).iter().zip(order(&b)) {
                    if *x != y {
                        let sx = a.iter().find(|r| &r.item_id == x).unwrap().score;
                        let sy = a.iter().find(|r| r.item_id == y).unwrap().score;
                        assert!((sx - sy).abs() < 1e-4, "{user}: {x} vs {y}");
                    }
                }
            }
        }
        assert!(
            compared > 100,
            "the collaborative term was exercised: {compared}"
        );
    }

    /// With `item_weight` 1 the local score is the best item behind the
    /// matched memory, read from the view's catalogue; without a catalogue
    /// it stays the centroid's.
    #[test]
    fn item_weight_scores_by_the_best_item_behind_the_memory() {
        struct WithItems<'a>(&'a SteamState, Vec<(String, Vec<f32>)>);
        impl MemoryView for WithItems<'_> {
            fn user(&self, u: &str) -> Option<&UserMemories> {
                self.0.user(u)
            }
            fn community_of(&self, m: MemoryId) -> Option<MemoryId> {
                MemoryView::community_of(self.0, m)
            }
            fn prototype(&self, c: MemoryId) -> Option<&Prototype> {
                self.0.prototype(c)
            }
            fn memory(&self, id: MemoryId) -> Option<&Memory> {
                self.0.memory(id)
            }
            fn tenant_separator(&self) -> Option<char> {
                self.0.params().tenant_separator
            }
            fn item_vector(&self, item: &str) -> Option<&[f32]> {
                self.1
                    .iter()
                    .find(|(i, _)| i == item)
                    .map(|(_, v)| v.as_slice())
            }
        }
        let s = state();
        let view = WithItems(&s, vec![("blue-train".into(), vec![1.0, 0.0, 0.0])]);
        let cand = vec![("c".to_owned(), vec![1.0, 0.0, 0.0])];
        let p = RecommendParams {
            item_weight: 1.0,
            collab_weight: 0.0,
            seen_weight: 0.0,
            ..RecommendParams::default()
        };
        let r = recommend(&view, "ann", &cand, &p);
        assert!((r[0].local - 1.0).abs() < 1e-6, "{r:?}");
        let centroid = recommend(&s, "ann", &cand, &p);
        assert!(centroid[0].local < 0.999, "{centroid:?}");
        assert_eq!(
            recommend_each(&view, "ann", &cand, &p)[0].local,
            r[0].local,
            "both paths"
        );
    }
}
