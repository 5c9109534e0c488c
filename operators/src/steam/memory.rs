//! Atomic memory units and their evolution (STEAM §3.2.1 and §3.4).
//!
//! A memory m = {c, e, I, L}: content, embedding, linked interactions, and a
//! link to its community. Each observation of a user (an item they clicked
//! or bought, or a dialogue turn), in event-time order, is compared with the
//! user's memories: if the best one has cosine ≥ τ it is *consolidated*
//! (the interaction is linked, content and embedding refreshed), otherwise a
//! new memory is *formed* for an emerging interest.
//!
//! Choices the paper leaves open (docs/steam.md): a memory's embedding is the
//! normalised mean of its interactions' embeddings (its interest centroid),
//! so consolidation needs no model call; its content comes from a summariser
//! (deterministic by default: the most frequent categories and the latest
//! titles or dialogue snippets); a memory's id is a keyed hash of its user
//! and the event that formed it ([`super::ids`]), so replays give the same
//! ids and no client can steer one.

use std::collections::BTreeMap;

use super::ids::{IdKey, MemoryId};

/// What the user did, ready for memory evolution.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// The interaction's event id (linked into the memory's I).
    pub event_id: String,
    /// Event time, ms since the epoch.
    pub timestamp_ms: i64,
    /// Embedding of the item (click, purchase) or of the dialogue turn.
    pub embedding: Vec<f32>,
    /// The item (clicks, purchases).
    pub item_id: Option<String>,
    /// The item's title, if any.
    pub title: Option<String>,
    /// The item's categories or genres.
    pub categories: Vec<String>,
    /// A dialogue turn's text.
    pub text: Option<String>,
}

/// One atomic memory unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Memory {
    /// Global id.
    pub id: MemoryId,
    /// Owner.
    pub user_id: String,
    /// c: what the memory says.
    pub content: String,
    /// e: unit-length embedding.
    pub embedding: Vec<f32>,
    /// I: linked interaction event ids, in event-time order.
    pub interactions: Vec<String>,
    /// The items of those interactions (clicks, purchases), distinct, in
    /// first-seen order: what collaborative retrieval recommends from.
    pub items: Vec<String>,
    /// L: the community (set by community maintenance).
    pub community: Option<MemoryId>,
    /// Event time of the first interaction, ms.
    pub created_ms: i64,
    /// Event time of the latest interaction, ms.
    pub updated_ms: i64,
    /// Incremented on every change.
    pub version: u64,
    /// Facets (categories) seen, with counts: the summariser's state.
    pub facets: BTreeMap<String, u32>,
    /// Latest titles or dialogue snippets, newest last (at most [`RECENT`]).
    pub recent: Vec<String>,
}

/// Titles or snippets kept per memory for its content.
pub const RECENT: usize = 5;

impl Memory {
    /// Interactions linked (the paper's support of a memory).
    pub fn support(&self) -> usize {
        self.interactions.len()
    }
}

/// Which evolution step an observation caused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Linked into an existing memory (its id).
    Consolidated(MemoryId),
    /// A new memory (its id).
    Formed(MemoryId),
    /// Already linked (a replayed event): nothing changed.
    Unchanged(MemoryId),
}

/// Evolution thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvolveParams {
    /// τ: the least cosine for consolidation (paper: 0.5).
    pub tau: f32,
    /// Consolidate at all (false reproduces the paper's "w/o MC" ablation:
    /// every observation forms a new memory).
    pub consolidate: bool,
    /// At most this many memories per user; past it, an observation is
    /// consolidated into its best match whatever the score.
    pub max_memories_per_user: usize,
    /// The key memory ids are hashed under (`steam.id_key`).
    pub id_key: IdKey,
}

impl Default for EvolveParams {
    fn default() -> Self {
        Self {
            tau: 0.5,
            consolidate: true,
            max_memories_per_user: 256,
            id_key: IdKey::default(),
        }
    }
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    steamrf_kernels::dot(a, b)
}

pub(crate) fn normalized(mut v: Vec<f32>) -> Vec<f32> {
    crate::embed::normalize(&mut v);
    v
}

/// The deterministic summariser: top facets and the latest titles/snippets.
pub fn summarise(facets: &BTreeMap<String, u32>, recent: &[String]) -> String {
    let mut top: Vec<(&String, &u32)> = facets.iter().collect();
    top.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let names: Vec<&str> = top.iter().take(3).map(|(f, _)| f.as_str()).collect();
    let mut out = String::new();
    if !names.is_empty() {
        out.push_str("Interested in ");
        out.push_str(&names.join(", "));
    }
    if !recent.is_empty() {
        if !out.is_empty() {
            out.push_str(". ");
        }
        out.push_str("For example: ");
        let items: Vec<&str> = recent.iter().rev().map(String::as_str).collect();
        out.push_str(&items.join("; "));
    }
    out
}

/// The memories of one user.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UserMemories {
    /// Owner.
    pub user_id: String,
    /// Memories, in formation order.
    pub memories: Vec<Memory>,
}

impl UserMemories {
    /// No memories yet.
    pub fn new(user_id: impl Into<String>) -> Self {
        Self {
            user_id: user_id.into(),
            memories: Vec::new(),
        }
    }

    /// t = 0: a memory from the user's static profile (content and its
    /// embedding come from the caller). A newer profile replaces it; the
    /// same or an older one changes nothing (`None`).
    pub fn init_from_profile(
        &mut self,
        key: &IdKey,
        event_id: &str,
        ts_ms: i64,
        content: String,
        embedding: Vec<f32>,
    ) -> Option<MemoryId> {
        let id = key.profile(&self.user_id);
        if let Some(m) = self.memories.iter().find(|m| m.id == id) {
            let stored = (m.updated_ms, m.interactions.first().map(String::as_str));
            if stored >= (ts_ms, Some(event_id)) {
                return None;
            }
        }
        let mem = Memory {
            id,
            user_id: self.user_id.clone(),
            content,
            embedding: normalized(embedding),
            interactions: vec![event_id.to_owned()],
            items: Vec::new(),
            community: None,
            created_ms: ts_ms,
            updated_ms: ts_ms,
            version: 1,
            facets: BTreeMap::new(),
            recent: Vec::new(),
        };
        match self.memories.iter_mut().find(|m| m.id == id) {
            Some(m) => {
                let version = m.version + 1;
                *m = Memory {
                    version,
                    community: m.community,
                    ..mem
                };
            }
            None => self.memories.push(mem),
        }
        Some(id)
    }

    /// The user's top-`k` memories by cosine with `query` (unit length),
    /// with score ≥ `min_score`, best first (ties: older memory first).
    pub fn top_k(&self, query: &[f32], k: usize, min_score: f32) -> Vec<(usize, f32)> {
        let mut scored: Vec<(usize, f32)> = self
            .memories
            .iter()
            .enumerate()
            .map(|(i, m)| (i, dot(&m.embedding, query)))
            .filter(|(_, s)| *s >= min_score)
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.truncate(k);
        scored
    }

    /// Evolves the memories with one observation (consolidation or formation).
    pub fn observe(&mut self, obs: &Observation, params: &EvolveParams) -> Step {
        self.observe_with(obs, params, |_| {})
    }

    /// [`UserMemories::observe`], calling `before_change` with the memory a
    /// consolidation is about to change, as it was (what an aggregate over
    /// it must take out).
    pub fn observe_with(
        &mut self,
        obs: &Observation,
        params: &EvolveParams,
        before_change: impl FnOnce(&Memory),
    ) -> Step {
        if let Some(m) = self
            .memories
            .iter()
            .find(|m| m.interactions.iter().any(|e| e == &obs.event_id))
        {
            return Step::Unchanged(m.id);
        }
        let e = normalized(obs.embedding.clone());
        // The profile memory holds static attributes, not an interest: it is
        // never a consolidation target.
        let profile = params.id_key.profile(&self.user_id);
        let best = self
            .memories
            .iter()
            .enumerate()
            .filter(|(_, m)| m.id != profile)
            .map(|(i, m)| (i, dot(&m.embedding, &e)))
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        let interests = self.memories.iter().filter(|m| m.id != profile).count();
        let full = interests >= params.max_memories_per_user;
        let target = match best {
            Some((i, s)) if params.consolidate && (s >= params.tau || full) => Some(i),
            Some((i, _)) if full => Some(i),
            _ => None,
        };
        let snippet = obs
            .title
            .clone()
            .or_else(|| obs.text.as_ref().map(|t| t.chars().take(120).collect()));
        match target {
            Some(i) => {
                before_change(&self.memories[i]);
                let m = &mut self.memories[i];
                let n = m.interactions.len() as f32;
                let centroid: Vec<f32> = m
                    .embedding
                    .iter()
                    .zip(&e)
                    .map(|(a, b)| (a * n + b) / (n + 1.0))
                    .collect();
                m.embedding = normalized(centroid);
                m.interactions.push(obs.event_id.clone());
                if let Some(item) = &obs.item_id
                    && !m.items.contains(item)
                {
                    m.items.push(item.clone());
                }
                for c in &obs.categories {
                    *m.facets.entry(c.clone()).or_default() += 1;
                }
                if let Some(s) = snippet {
                    // A repeat moves to the newest place instead of repeating.
                    m.recent.retain(|r| r != &s);
                    m.recent.push(s);
                    if m.recent.len() > RECENT {
                        m.recent.remove(0);
                    }
                }
                m.content = summarise(&m.facets, &m.recent);
                m.updated_ms = m.updated_ms.max(obs.timestamp_ms);
                m.version += 1;
                Step::Consolidated(m.id)
            }
            None => {
                let id = params.id_key.memory(&self.user_id, &obs.event_id);
                let facets: BTreeMap<String, u32> =
                    obs.categories.iter().map(|c| (c.clone(), 1)).collect();
                let recent: Vec<String> = snippet.into_iter().collect();
                self.memories.push(Memory {
                    id,
                    user_id: self.user_id.clone(),
                    content: summarise(&facets, &recent),
                    embedding: e,
                    interactions: vec![obs.event_id.clone()],
                    items: obs.item_id.iter().cloned().collect(),
                    community: None,
                    created_ms: obs.timestamp_ms,
                    updated_ms: obs.timestamp_ms,
                    version: 1,
                    facets,
                    recent,
                });
                Step::Formed(id)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(id: &str, v: [f32; 3], title: &str, cat: &str) -> Observation {
        Observation {
            event_id: id.into(),
            timestamp_ms: 0,
            embedding: v.to_vec(),
            item_id: Some(format!("item-{id}")),
            title: Some(title.into()),
            categories: vec![cat.into()],
            text: None,
        }
    }

    #[test]
    fn similar_observations_consolidate_and_new_interests_form() {
        let mut u = UserMemories::new("u1");
        let p = EvolveParams::default();
        let a = u.observe(&obs("e1", [1.0, 0.0, 0.0], "Kind of Blue", "Jazz"), &p);
        assert!(matches!(a, Step::Formed(_)));
        // cos = 0.8 >= 0.5: consolidated into the jazz memory.
        let b = u.observe(&obs("e2", [0.8, 0.6, 0.0], "Blue Train", "Jazz"), &p);
        // The same title again is not listed twice.
        u.observe(&obs("e2b", [0.8, 0.6, 0.0], "Blue Train", "Jazz"), &p);
        assert_eq!(b, Step::Consolidated(p.id_key.memory("u1", "e1")));
        // Orthogonal: a new memory for an emerging interest.
        let c = u.observe(&obs("e3", [0.0, 0.0, 1.0], "Alien", "Sci-Fi"), &p);
        assert_eq!(c, Step::Formed(p.id_key.memory("u1", "e3")));
        assert_eq!(u.memories.len(), 2);
        let jazz = &u.memories[0];
        assert_eq!(jazz.interactions, vec!["e1", "e2", "e2b"]);
        assert_eq!(jazz.version, 3);
        assert_eq!(
            jazz.content,
            "Interested in Jazz. For example: Blue Train; Kind of Blue"
        );
        let norm: f32 = jazz.embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6);
        // A replayed event changes nothing.
        let again = u.observe(&obs("e2", [0.8, 0.6, 0.0], "Blue Train", "Jazz"), &p);
        assert_eq!(again, Step::Unchanged(p.id_key.memory("u1", "e1")));
        assert_eq!(u.memories[0].version, 3);
    }

    #[test]
    fn the_threshold_is_inclusive_and_the_ablation_never_consolidates() {
        let p = EvolveParams::default();
        let mut u = UserMemories::new("u");
        u.observe(&obs("a", [1.0, 0.0, 0.0], "A", "x"), &p);
        // cos exactly 0.5 (60 degrees) consolidates; just below forms.
        let half = [0.5, 0.75f32.sqrt(), 0.0];
        assert!(matches!(
            u.observe(&obs("b", half, "B", "x"), &p),
            Step::Consolidated(_)
        ));
        let mut v = UserMemories::new("v");
        v.observe(&obs("a", [1.0, 0.0, 0.0], "A", "x"), &p);
        let below = [0.49, (1.0f32 - 0.49 * 0.49).sqrt(), 0.0];
        assert!(matches!(
            v.observe(&obs("b", below, "B", "x"), &p),
            Step::Formed(_)
        ));
        let no_mc = EvolveParams {
            consolidate: false,
            ..p
        };
        let mut w = UserMemories::new("w");
        w.observe(&obs("a", [1.0, 0.0, 0.0], "A", "x"), &no_mc);
        assert!(matches!(
            w.observe(&obs("b", [1.0, 0.0, 0.0], "A", "x"), &no_mc),
            Step::Formed(_)
        ));
    }

    #[test]
    fn the_memory_cap_forces_consolidation() {
        let p = EvolveParams {
            max_memories_per_user: 2,
            ..EvolveParams::default()
        };
        let mut u = UserMemories::new("u");
        for (i, v) in [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
            .iter()
            .enumerate()
        {
            u.observe(&obs(&format!("e{i}"), *v, "t", "c"), &p);
        }
        assert_eq!(u.memories.len(), 2);
    }

    #[test]
    fn profiles_initialise_one_memory_that_later_profiles_replace() {
        let mut u = UserMemories::new("u");
        let id = u.init_from_profile(
            &IdKey::default(),
            "p1",
            0,
            "age 31, likes jazz".into(),
            vec![1.0, 0.0],
        );
        let again =
            u.init_from_profile(&IdKey::default(), "p2", 5, "age 32".into(), vec![0.0, 2.0]);
        assert_eq!(id, again);
        assert_eq!(u.memories.len(), 1);
        assert_eq!(u.memories[0].version, 2);
        assert_eq!(u.memories[0].embedding, vec![0.0, 1.0]);
        // Replayed or older profiles change nothing.
        assert_eq!(
            u.init_from_profile(&IdKey::default(), "p2", 5, "age 32".into(), vec![0.0, 2.0]),
            None
        );
        assert_eq!(
            u.init_from_profile(&IdKey::default(), "p0", 1, "old".into(), vec![1.0, 0.0]),
            None
        );
        assert_eq!(u.memories[0].version, 2);
    }
}
