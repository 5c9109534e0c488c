//! Memory communities, maintained incrementally.
//!
//! The paper defines a community around a memory as everything within two
//! hops, C_i = {m_j | d(m_i, m_j) ≤ 2}, explores 2 hops from each new batch,
//! and propagates membership changes to first-order neighbours through an
//! update queue until nothing changes ("a single new edge may trigger the
//! merging of multiple communities"). The fixpoint of that rule is the
//! connected components of the undirected link graph, which is what this
//! module maintains (the choice is documented in docs/steam.md):
//!
//! - an added edge between two communities merges them: the smaller one's
//!   members are relabelled through a queue (small-to-large, so each memory
//!   is relabelled O(log n) times over any sequence of merges);
//! - a removed edge or memory re-examines only its old community, by BFS over
//!   that community's members, which may split it;
//! - nothing else is touched, so a batch costs what its edges reach, not the
//!   size of the graph.
//!
//! Connected components percolate: with enough links one component swallows
//! most memories (the w/o-MC ablation grew one of 92k), its prototype says
//! nothing, and every batch that touches it rebuilds it. So a community may
//! be capped ([`Communities::with_cap`], `steam.max_community`): a new link
//! between two communities whose sizes together exceed the cap stays a link
//! (neighbours still see it) but merges nothing. A community is then a
//! connected part of its component, at most `cap` members, grown by links
//! in the order they came; after a split, links that were refused are not
//! re-examined until one of their memories is linked again. From the final
//! graph alone, [`Communities::from_graph_capped`] takes the links in id
//! order instead, so a restart may cut a component elsewhere (same cap).
//!
//! A community's id is a member's memory id: the id of the larger side
//! survives a merge (ties: the smaller id), and after a split each part takes
//! its smallest member id. Given the same sequence of batches the ids are the
//! same (determinism); [`partition_from_scratch`] gives the same partition
//! from the final graph alone (a property test checks it).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use super::MemoryId;

/// Changes to the link graph, applied together.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GraphBatch {
    /// New memories (no edges yet; edges come in `add_edges`).
    pub add_nodes: Vec<MemoryId>,
    /// New undirected links.
    pub add_edges: Vec<(MemoryId, MemoryId)>,
    /// Links that disappear (a re-linked memory dropped them).
    pub remove_edges: Vec<(MemoryId, MemoryId)>,
    /// Memories deleted with all their links (a user forgotten).
    pub remove_nodes: Vec<MemoryId>,
}

/// What a batch did to the communities.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommunityDelta {
    /// Communities (by id, after the batch) whose membership changed or that are new.
    pub changed: BTreeSet<MemoryId>,
    /// Community ids that no longer exist.
    pub removed: BTreeSet<MemoryId>,
    /// Merges of two communities into one.
    pub merges: u64,
    /// Communities that fell apart into more than one.
    pub splits: u64,
    /// Memories whose community id changed.
    pub relabelled: u64,
    /// The memories whose community id changed or that are new (to persist).
    pub moved: BTreeSet<MemoryId>,
    /// For each memory whose community id changed or that was removed: the
    /// community it was in before the batch (what a per-community
    /// aggregate must take it out of).
    pub left: BTreeMap<MemoryId, MemoryId>,
    /// New links that joined two communities whose sizes together exceed
    /// the cap: kept as links, not merged.
    pub refused: u64,
}

/// A label no node has (a free node's).
const NONE: u32 = u32::MAX;

/// The link graph and its communities.
///
/// Each memory in the graph is a dense node number, so what every memory
/// carries is a `Vec` slot, not a hash-map entry keyed by its 16-byte id:
/// one map from id to node, then the neighbours (4-byte nodes, sorted by
/// memory id) and the community label (the node of the member that names
/// it) by node. A removed memory's node is reused by a later one.
#[derive(Debug, Clone, Default)]
pub struct Communities {
    /// Each memory's node.
    node: HashMap<MemoryId, u32>,
    /// Each node's memory (a free node keeps its last one until reused).
    id: Vec<MemoryId>,
    /// Free nodes.
    free: Vec<u32>,
    /// Each node's neighbours, sorted by memory id.
    adj: Vec<Vec<u32>>,
    /// Each node's community, as the node of the member whose id names it
    /// ([`NONE`] for a free node).
    label: Vec<u32>,
    members: HashMap<MemoryId, BTreeSet<MemoryId>>,
    /// Largest community a merge may make (0: unbounded).
    cap: usize,
}

impl Communities {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty graph whose communities never grow past `cap` members by a
    /// merge (0: unbounded, the connected components). See the module docs.
    pub fn with_cap(cap: usize) -> Self {
        Self {
            cap,
            ..Self::default()
        }
    }

    /// The size cap (0: unbounded).
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The community of `m`.
    pub fn community_of(&self, m: MemoryId) -> Option<MemoryId> {
        self.node.get(&m).map(|&n| self.named(n))
    }

    /// The id of node `n`'s community.
    fn named(&self, n: u32) -> MemoryId {
        self.id[self.label[n as usize] as usize]
    }

    /// The members of community `c`.
    pub fn members(&self, c: MemoryId) -> Option<&BTreeSet<MemoryId>> {
        self.members.get(&c)
    }

    /// The direct links of `m`.
    pub fn neighbours(&self, m: MemoryId) -> impl Iterator<Item = MemoryId> + '_ {
        self.node
            .get(&m)
            .into_iter()
            .flat_map(|&n| self.adj[n as usize].iter().map(|&x| self.id[x as usize]))
    }

    /// Number of memories.
    pub fn len(&self) -> usize {
        self.node.len()
    }

    /// Whether there are no memories.
    pub fn is_empty(&self) -> bool {
        self.node.is_empty()
    }

    /// Number of communities (singletons included).
    pub fn count(&self) -> usize {
        self.members.len()
    }

    /// Every community id with its members.
    pub fn iter(&self) -> impl Iterator<Item = (MemoryId, &BTreeSet<MemoryId>)> {
        self.members.iter().map(|(c, m)| (*c, m))
    }

    /// The current partition, as sorted member sets (for comparisons).
    pub fn partition(&self) -> BTreeSet<BTreeSet<MemoryId>> {
        self.members.values().cloned().collect()
    }

    /// The undirected edges, each once as (smaller, larger).
    pub fn edges(&self) -> Vec<(MemoryId, MemoryId)> {
        let mut out = Vec::new();
        for (&a, &n) in &self.node {
            out.extend(
                self.adj[n as usize]
                    .iter()
                    .map(|&x| self.id[x as usize])
                    .filter(|&b| a < b)
                    .map(|b| (a, b)),
            );
        }
        out.sort_unstable();
        out
    }

    /// Builds the communities of a whole graph at once (BFS; each community
    /// named by its smallest member): recovery after a restart, and the
    /// from-scratch side of `steamrf bench communities`.
    pub fn from_graph(
        nodes: impl IntoIterator<Item = MemoryId>,
        edges: impl IntoIterator<Item = (MemoryId, MemoryId)>,
    ) -> Self {
        Self::from_graph_capped(nodes, edges, 0)
    }

    /// [`Communities::from_graph`] under a size cap (0: unbounded). With a
    /// cap, the edges are taken in order (smaller endpoint first) and each
    /// joins its two communities unless together they exceed the cap; each
    /// community is named by its smallest member.
    pub fn from_graph_capped(
        nodes: impl IntoIterator<Item = MemoryId>,
        edges: impl IntoIterator<Item = (MemoryId, MemoryId)>,
        cap: usize,
    ) -> Self {
        let mut c = Self::with_cap(cap);
        for m in nodes {
            c.add_node(m);
        }
        for (a, b) in edges {
            if a != b {
                let (na, nb) = (c.add_node(a), c.add_node(b));
                c.link(na, nb);
            }
        }
        // Every node (none is free yet), by memory id.
        let mut order: Vec<u32> = c.node.values().copied().collect();
        order.sort_unstable_by_key(|&n| c.id[n as usize]);
        if cap > 0 {
            c.capped_partition(&order);
            return c;
        }
        for &start in &order {
            if c.label[start as usize] != NONE {
                continue;
            }
            let mut part = BTreeSet::new();
            let mut queue = VecDeque::from([start]);
            c.label[start as usize] = start;
            while let Some(n) = queue.pop_front() {
                part.insert(c.id[n as usize]);
                for &x in &c.adj[n as usize] {
                    if c.label[x as usize] == NONE {
                        c.label[x as usize] = start;
                        queue.push_back(x);
                    }
                }
            }
            c.members.insert(c.id[start as usize], part);
        }
        c
    }

    /// Size-capped union-find over the sorted edges (see
    /// [`Communities::from_graph_capped`]); `order` holds every node, by
    /// memory id.
    fn capped_partition(&mut self, order: &[u32]) {
        fn root(parent: &mut [usize], mut i: usize) -> usize {
            while parent[i] != i {
                parent[i] = parent[parent[i]];
                i = parent[i];
            }
            i
        }
        // Each node's position in `order`.
        let mut position = vec![0usize; self.id.len()];
        for (i, &n) in order.iter().enumerate() {
            position[n as usize] = i;
        }
        let mut parent: Vec<usize> = (0..order.len()).collect();
        let mut size = vec![1usize; order.len()];
        for (i, &a) in order.iter().enumerate() {
            for &b in &self.adj[a as usize] {
                let j = position[b as usize];
                if j <= i {
                    continue;
                }
                let (ra, rb) = (root(&mut parent, i), root(&mut parent, j));
                if ra == rb || size[ra] + size[rb] > self.cap {
                    continue;
                }
                // The smaller root index (the smaller member id) survives.
                let (keep, fold) = (ra.min(rb), ra.max(rb));
                parent[fold] = keep;
                size[keep] += size[fold];
            }
        }
        for (i, &n) in order.iter().enumerate() {
            let r = order[root(&mut parent, i)];
            self.label[n as usize] = r;
            self.members
                .entry(self.id[r as usize])
                .or_default()
                .insert(self.id[n as usize]);
        }
    }

    /// `m`'s node, given a free one (unlabelled, no neighbours) if it had none.
    fn add_node(&mut self, m: MemoryId) -> u32 {
        if let Some(&n) = self.node.get(&m) {
            return n;
        }
        let n = match self.free.pop() {
            Some(n) => {
                self.id[n as usize] = m;
                n
            }
            None => {
                let n = u32::try_from(self.id.len())
                    .ok()
                    .filter(|&n| n != NONE)
                    .expect("a link graph holds fewer than 2^32 - 1 memories");
                self.id.push(m);
                self.adj.push(Vec::new());
                self.label.push(NONE);
                n
            }
        };
        self.node.insert(m, n);
        n
    }

    /// Where `x` belongs in neighbours sorted by memory id.
    fn slot(&self, of: u32, x: u32) -> Result<usize, usize> {
        let key = self.id[x as usize];
        self.adj[of as usize].binary_search_by(|&y| self.id[y as usize].cmp(&key))
    }

    /// Links nodes `a` and `b`; true if they were not linked.
    fn link(&mut self, a: u32, b: u32) -> bool {
        let Err(at) = self.slot(a, b) else {
            return false;
        };
        self.adj[a as usize].insert(at, b);
        if let Err(at) = self.slot(b, a) {
            self.adj[b as usize].insert(at, a);
        }
        true
    }

    /// Unlinks nodes `a` and `b`; true if they were linked.
    fn unlink(&mut self, a: u32, b: u32) -> bool {
        let Ok(at) = self.slot(a, b) else {
            return false;
        };
        self.adj[a as usize].remove(at);
        if let Ok(at) = self.slot(b, a) {
            self.adj[b as usize].remove(at);
        }
        true
    }

    /// Adds `m` as a community of its own unless it is a node; true if it
    /// was added.
    fn ensure_node(&mut self, m: MemoryId, delta: &mut CommunityDelta) -> bool {
        if self.node.contains_key(&m) {
            return false;
        }
        let n = self.add_node(m);
        self.label[n as usize] = n;
        self.members.insert(m, BTreeSet::from([m]));
        delta.changed.insert(m);
        delta.moved.insert(m);
        true
    }

    /// Applies one batch: removals first (splits), then additions (merges).
    pub fn apply(&mut self, batch: &GraphBatch) -> CommunityDelta {
        let mut delta = CommunityDelta::default();
        // Removals: collect the old communities they touch, then re-examine
        // each. A removed memory's node is freed only after every split, so
        // no label still names it when it is reused.
        let mut dirty: BTreeSet<MemoryId> = BTreeSet::new();
        for &(a, b) in &batch.remove_edges {
            let (Some(&na), Some(&nb)) = (self.node.get(&a), self.node.get(&b)) else {
                continue;
            };
            if na != nb && self.unlink(na, nb) {
                dirty.insert(self.named(na));
            }
        }
        let mut freed = Vec::new();
        for &m in &batch.remove_nodes {
            let Some(n) = self.node.remove(&m) else {
                continue;
            };
            for x in std::mem::take(&mut self.adj[n as usize]) {
                if let Ok(at) = self.slot(x, n) {
                    self.adj[x as usize].remove(at);
                }
            }
            let c = self.named(n);
            delta.left.entry(m).or_insert(c);
            if let Some(set) = self.members.get_mut(&c) {
                set.remove(&m);
            }
            dirty.insert(c);
            freed.push(n);
        }
        for c in dirty {
            self.resplit(c, &mut delta);
        }
        for n in freed {
            self.label[n as usize] = NONE;
            self.free.push(n);
        }
        // Additions. A node new in this batch was in no community before it,
        // whatever it passed through: it leaves none (`left`).
        let mut fresh: BTreeSet<MemoryId> = BTreeSet::new();
        let mut add = |c: &mut Self, m: MemoryId, delta: &mut CommunityDelta| {
            if c.ensure_node(m, delta) && !delta.left.contains_key(&m) {
                fresh.insert(m);
            }
        };
        for &m in &batch.add_nodes {
            add(self, m, &mut delta);
        }
        for &(a, b) in &batch.add_edges {
            if a == b {
                continue;
            }
            add(self, a, &mut delta);
            add(self, b, &mut delta);
            if self.link(self.node[&a], self.node[&b]) {
                self.merge(a, b, &mut delta);
            }
        }
        // A community removed and then re-created under the same id is changed, not removed.
        delta.removed.retain(|c| !self.members.contains_key(c));
        delta.changed.retain(|c| self.members.contains_key(c));
        delta.moved.retain(|m| self.node.contains_key(m));
        delta.left.retain(|m, _| !fresh.contains(m));
        delta
    }

    /// Merges the communities of `a` and `b` (just linked), if they differ.
    fn merge(&mut self, a: MemoryId, b: MemoryId, delta: &mut CommunityDelta) {
        let (ca, cb) = (self.named(self.node[&a]), self.named(self.node[&b]));
        if ca == cb {
            return;
        }
        let (sa, sb) = (self.members[&ca].len(), self.members[&cb].len());
        if self.cap > 0 && sa + sb > self.cap {
            delta.refused += 1;
            return;
        }
        // The larger community keeps its id (ties: the smaller id); the
        // other's members are relabelled through a queue.
        let (keep, fold) = if sa > sb || (sa == sb && ca < cb) {
            (ca, cb)
        } else {
            (cb, ca)
        };
        let keep_node = self.node[&keep];
        let moved = self.members.remove(&fold).unwrap_or_default();
        let mut queue: VecDeque<MemoryId> = moved.iter().copied().collect();
        while let Some(m) = queue.pop_front() {
            let n = self.node[&m] as usize;
            let old = self.id[self.label[n] as usize];
            self.label[n] = keep_node;
            delta.left.entry(m).or_insert(old);
            delta.relabelled += 1;
            delta.moved.insert(m);
        }
        self.members.entry(keep).or_default().extend(moved);
        delta.merges += 1;
        delta.changed.insert(keep);
        delta.changed.remove(&fold);
        delta.removed.insert(fold);
    }

    /// Re-examines old community `c` after removals: BFS over its remaining
    /// members; each connected part becomes a community named by its
    /// smallest member.
    fn resplit(&mut self, c: MemoryId, delta: &mut CommunityDelta) {
        let Some(old) = self.members.remove(&c) else {
            return;
        };
        let mut parts = 0u64;
        let mut seen: BTreeSet<MemoryId> = BTreeSet::new();
        for &start in &old {
            let Some(&first) = self.node.get(&start) else {
                continue;
            };
            if seen.contains(&start) {
                continue;
            }
            let mut part = BTreeSet::new();
            let mut queue = VecDeque::from([first]);
            seen.insert(start);
            while let Some(n) = queue.pop_front() {
                part.insert(self.id[n as usize]);
                // Only links inside the old community: with a cap, a member
                // may also link to members of other communities.
                for &x in &self.adj[n as usize] {
                    let m = self.id[x as usize];
                    if old.contains(&m) && seen.insert(m) {
                        queue.push_back(x);
                    }
                }
            }
            let id = *part.first().unwrap_or(&start);
            let id_node = self.node[&id];
            for &m in &part {
                let n = self.node[&m] as usize;
                let was = self.label[n];
                if was != id_node {
                    // `was` may be a memory removed in this batch (its node
                    // is not freed yet): the community `m` left all the same.
                    delta.left.entry(m).or_insert(self.id[was as usize]);
                    self.label[n] = id_node;
                    delta.relabelled += 1;
                    delta.moved.insert(m);
                }
            }
            self.members.insert(id, part);
            delta.changed.insert(id);
            parts += 1;
        }
        if parts > 1 {
            delta.splits += 1;
        }
        if !self.members.contains_key(&c) {
            delta.removed.insert(c);
        }
    }
}

/// Connected components of the undirected graph `edges` over `nodes`,
/// computed from nothing (the reference the incremental structure must equal).
pub fn partition_from_scratch(
    nodes: impl IntoIterator<Item = MemoryId>,
    edges: &[(MemoryId, MemoryId)],
) -> BTreeSet<BTreeSet<MemoryId>> {
    let mut adj: BTreeMap<MemoryId, Vec<MemoryId>> = BTreeMap::new();
    for n in nodes {
        adj.entry(n).or_default();
    }
    for &(a, b) in edges {
        if a != b {
            adj.entry(a).or_default().push(b);
            adj.entry(b).or_default().push(a);
        }
    }
    let mut seen = BTreeSet::new();
    let mut out = BTreeSet::new();
    for &start in adj.keys() {
        if !seen.insert(start) {
            continue;
        }
        let mut part = BTreeSet::new();
        let mut queue = VecDeque::from([start]);
        while let Some(m) = queue.pop_front() {
            part.insert(m);
            for &n in &adj[&m] {
                if seen.insert(n) {
                    queue.push_back(n);
                }
            }
        }
        out.insert(part);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    impl Communities {
        /// Each memory's community.
        fn labels(&self) -> BTreeMap<MemoryId, MemoryId> {
            self.node
                .iter()
                .map(|(&m, &n)| (m, self.named(n)))
                .collect()
        }
    }

    fn mid(n: u8) -> MemoryId {
        MemoryId(u128::from(n))
    }

    const fn m(n: u128) -> MemoryId {
        MemoryId(n)
    }

    #[test]
    fn a_removed_memorys_node_is_reused_and_names_nothing_it_did() {
        let mut c = Communities::new();
        c.apply(&GraphBatch {
            add_edges: vec![(m(1), m(2)), (m(2), m(3))],
            ..GraphBatch::default()
        });
        assert_eq!(c.community_of(m(3)), Some(m(1)));
        // The community's name goes, and a new memory takes its node in
        // the same batch.
        let d = c.apply(&GraphBatch {
            remove_nodes: vec![m(1)],
            add_edges: vec![(m(9), m(3))],
            ..GraphBatch::default()
        });
        assert_eq!(c.id.len(), 3, "node reused");
        assert_eq!(c.community_of(m(1)), None);
        assert_eq!(c.community_of(m(2)), Some(m(2)));
        assert_eq!(c.community_of(m(9)), Some(m(2)));
        assert_eq!(c.neighbours(m(9)).collect::<Vec<_>>(), vec![m(3)]);
        assert_eq!(c.neighbours(m(2)).collect::<Vec<_>>(), vec![m(3)]);
        assert_eq!(d.left.get(&m(1)), Some(&m(1)));
        assert_eq!(d.left.get(&m(2)), Some(&m(1)));
        assert!(d.removed.contains(&m(1)));
        assert_eq!(c.edges(), vec![(m(2), m(3)), (m(3), m(9))]);
    }

    #[test]
    fn an_edge_merges_and_its_removal_splits() {
        let mut c = Communities::new();
        let d = c.apply(&GraphBatch {
            add_edges: vec![(m(1), m(2)), (m(3), m(4))],
            ..GraphBatch::default()
        });
        assert_eq!(c.count(), 2);
        assert_eq!(d.merges, 2);
        let d = c.apply(&GraphBatch {
            add_edges: vec![(m(2), m(3))],
            ..GraphBatch::default()
        });
        assert_eq!(d.merges, 1);
        assert_eq!(c.count(), 1);
        let id = c.community_of(m(4)).unwrap();
        assert_eq!(d.changed, BTreeSet::from([id]));
        let d = c.apply(&GraphBatch {
            remove_edges: vec![(m(3), m(2))],
            ..GraphBatch::default()
        });
        assert_eq!(d.splits, 1);
        assert_eq!(c.community_of(m(1)), Some(m(1)));
        assert_eq!(c.community_of(m(4)), Some(m(3)));
        // Deleting a bridge node splits too; the deleted node is gone.
        c.apply(&GraphBatch {
            add_edges: vec![(m(2), m(5)), (m(5), m(3))],
            ..GraphBatch::default()
        });
        assert_eq!(c.count(), 1);
        let d = c.apply(&GraphBatch {
            remove_nodes: vec![m(5)],
            ..GraphBatch::default()
        });
        assert_eq!(d.splits, 1);
        assert_eq!(c.community_of(m(5)), None);
        assert_eq!(c.count(), 2);
    }

    #[test]
    fn a_chain_of_merges_cascades_through_one_edge() {
        let mut c = Communities::new();
        c.apply(&GraphBatch {
            add_edges: vec![(m(1), m(2)), (m(3), m(4)), (m(5), m(6))],
            ..GraphBatch::default()
        });
        c.apply(&GraphBatch {
            add_edges: vec![(m(2), m(3)), (m(4), m(5))],
            ..GraphBatch::default()
        });
        assert_eq!(c.count(), 1);
        assert_eq!(c.members(c.community_of(m(1)).unwrap()).unwrap().len(), 6);
    }

    #[test]
    fn a_cap_keeps_links_but_refuses_merges_past_it() {
        let mut c = Communities::with_cap(3);
        c.apply(&GraphBatch {
            add_edges: vec![(m(1), m(2)), (m(2), m(3)), (m(4), m(5))],
            ..GraphBatch::default()
        });
        assert_eq!(c.count(), 2);
        let d = c.apply(&GraphBatch {
            add_edges: vec![(m(3), m(4))],
            ..GraphBatch::default()
        });
        assert_eq!((d.merges, d.refused), (0, 1));
        assert_eq!(c.neighbours(m(3)).collect::<Vec<_>>(), vec![m(2), m(4)]);
        assert_ne!(c.community_of(m(3)), c.community_of(m(4)));
        // A split walks only its own community's links.
        let d = c.apply(&GraphBatch {
            remove_edges: vec![(m(2), m(3))],
            ..GraphBatch::default()
        });
        assert_eq!(d.splits, 1);
        assert_eq!(c.members(m(3)).unwrap().len(), 1);
        assert_eq!(c.members(m(4)).unwrap().len(), 2);
        // From scratch: links in id order, the smallest member names each.
        let f = Communities::from_graph_capped([], c.edges(), 3);
        assert_eq!(
            f.partition(),
            BTreeSet::from([
                BTreeSet::from([m(1), m(2)]),
                BTreeSet::from([m(3), m(4), m(5)]),
            ])
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(Vec<(u8, u8)>, Vec<u8>),
        Remove(Vec<(u8, u8)>, Vec<u8>),
    }

    fn op() -> impl Strategy<Value = Op> {
        let edges = prop::collection::vec((0u8..40, 0u8..40), 0..12);
        let nodes = prop::collection::vec(0u8..40, 0..4);
        prop_oneof![
            3 => (edges.clone(), nodes.clone()).prop_map(|(e, n)| Op::Add(e, n)),
            1 => (edges, nodes).prop_map(|(e, n)| Op::Remove(e, n)),
        ]
    }

    /// `op` as a batch; a removal also drops the edges `also_remove`.
    fn batch(op: &Op, also_remove: Vec<(MemoryId, MemoryId)>) -> GraphBatch {
        let edges = |e: &[(u8, u8)]| e.iter().map(|&(a, b)| (mid(a), mid(b))).collect::<Vec<_>>();
        let nodes = |n: &[u8]| n.iter().map(|&x| mid(x)).collect();
        match op {
            Op::Add(e, n) => GraphBatch {
                add_edges: edges(e),
                add_nodes: nodes(n),
                ..GraphBatch::default()
            },
            Op::Remove(e, n) => GraphBatch {
                remove_edges: [edges(e), also_remove].concat(),
                remove_nodes: nodes(n),
                ..GraphBatch::default()
            },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// After any sequence of batches (deletions included), the incremental
        /// communities equal connected components computed from scratch.
        #[test]
        fn incremental_equals_from_scratch(ops in prop::collection::vec(op(), 1..25)) {
            let mut c = Communities::new();
            for op in &ops {
                // Remove some existing edges too, so splits happen often.
                let batch = batch(op, c.edges().into_iter().step_by(3).collect());
                let before = c.labels();
                let delta = c.apply(&batch);
                // `left` names exactly the memories whose community changed
                // or that are gone, with their community before the batch.
                for (m, was) in &before {
                    if c.community_of(*m) == Some(*was) {
                        // Relabelled and back again counts as moved both ways.
                        prop_assert!(delta.left.get(m).is_none_or(|l| l == was && delta.moved.contains(m)));
                    } else {
                        prop_assert_eq!(delta.left.get(m), Some(was));
                    }
                }
                for m in delta.left.keys() {
                    prop_assert!(before.contains_key(m));
                }
                // Every memory with a new community is reported moved.
                for (m, now) in &c.labels() {
                    if before.get(m) != Some(now) {
                        prop_assert!(delta.moved.contains(m));
                    }
                }
                // Every reported community exists, every removed one does not.
                for id in &delta.changed {
                    prop_assert!(c.members(*id).is_some());
                }
                for id in &delta.removed {
                    prop_assert!(c.members(*id).is_none());
                }
                // Every memory whose label is reported moved has that label now.
                for m in &delta.moved {
                    prop_assert!(c.community_of(*m).is_some());
                }
                // Labels and member sets agree.
                for (id, ms) in c.iter() {
                    for m in ms {
                        prop_assert_eq!(c.community_of(*m), Some(id));
                    }
                }
                let nodes: Vec<MemoryId> = c.node.keys().copied().collect();
                prop_assert_eq!(c.partition(), partition_from_scratch(nodes.clone(), &c.edges()));
                prop_assert_eq!(c.partition(), Communities::from_graph(nodes, c.edges()).partition());
            }
        }

        /// Under a cap, after any batches: no community is larger than the
        /// cap, each is connected by its own links, and (with additions
        /// only) every link between two communities was refused because
        /// they would exceed it together. The same holds from scratch.
        #[test]
        fn capped_communities_stay_small_and_connected(
            ops in prop::collection::vec(op(), 1..25),
            cap in 1usize..8,
        ) {
            let mut c = Communities::with_cap(cap);
            let mut removed = false;
            for op in &ops {
                removed |= matches!(op, Op::Remove(..));
                c.apply(&batch(op, Vec::new()));
                let nodes: Vec<MemoryId> = c.node.keys().copied().collect();
                let scratch = Communities::from_graph_capped(nodes, c.edges(), cap);
                for g in [&c, &scratch] {
                    for (id, ms) in g.iter() {
                        prop_assert!(ms.len() <= cap);
                        prop_assert!(ms.contains(&id));
                        for m in ms {
                            prop_assert_eq!(g.community_of(*m), Some(id));
                        }
                        let inner: Vec<_> = g.edges().into_iter()
                            .filter(|(a, b)| ms.contains(a) && ms.contains(b)).collect();
                        prop_assert_eq!(partition_from_scratch(ms.iter().copied(), &inner).len(), 1);
                    }
                }
                if !removed {
                    for (a, b) in c.edges() {
                        let (ca, cb) = (c.community_of(a).unwrap(), c.community_of(b).unwrap());
                        if ca != cb {
                            prop_assert!(c.members(ca).unwrap().len() + c.members(cb).unwrap().len() > cap);
                        }
                    }
                }
            }
        }

        /// The same batches give the same community ids (determinism).
        #[test]
        fn replays_give_the_same_ids(ops in prop::collection::vec(prop::collection::vec((0u128..30, 0u128..30).prop_map(|(a, b)| (m(a), m(b))), 0..10), 1..10)) {
            let run = || {
                let mut c = Communities::new();
                for e in &ops {
                    c.apply(&GraphBatch { add_edges: e.clone(), ..GraphBatch::default() });
                }
                c.labels()
            };
            prop_assert_eq!(run(), run());
        }
    }
}
