//! What a community's prototype is built from, kept per community as its
//! members join, leave and change, so that a batch costs what it changed
//! and not the size of the communities it touched.
//!
//! A [`Tally`] holds everything [`super::SteamState::digest`] reads: the
//! members' embedding sum, the members per user and, per item, the members
//! per user that chose it. The sum is fixed point (2^-32 per unit, `i64`,
//! wrapping arithmetic), so adding and subtracting a member are exact and
//! order-free: a tally kept through any sequence of joins, leaves and
//! changes equals, bit for bit, the one built from its final members. That
//! is what lets [`Tallies`] keep tallies only for communities of at least
//! [`Tallies::KEEP_FROM`] members and build the small ones' digests from
//! their members: both give the same prototype (a property test checks the
//! kept tallies against digests built from scratch).

use std::borrow::Cow;
use std::collections::HashMap;

use super::memory::Memory;
use super::{Digest, ItemFacts, MemoryId};

/// A member as a tally reads it: its owner and items from the memory, its
/// embedding from wherever the state keeps it (the memory, or only the
/// relation index: [`super::SteamState::lean`]).
#[derive(Debug, Clone)]
pub(super) struct Member<'a> {
    pub(super) memory: &'a Memory,
    pub(super) embedding: Cow<'a, [f32]>,
}

/// Fixed-point units per 1.0 of an embedding value.
const SCALE: f64 = 4_294_967_296.0;

fn fixed(v: f32) -> i64 {
    // Saturating for values far outside a unit vector's range; the tally
    // stays consistent either way because additions wrap.
    (f64::from(v) * SCALE).round() as i64
}

/// One community's aggregates (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct Tally {
    members: u32,
    /// Fixed-point embedding sum; empty while no member has the tally's
    /// dimension.
    sum: Vec<i64>,
    /// Members per user.
    users: HashMap<String, u32>,
    /// Members per (item, user) that chose the item, keyed by [`pair_key`].
    pairs: HashMap<String, u32>,
    /// Distinct users per item.
    item_users: HashMap<String, u32>,
}

impl Tally {
    /// The tally of `members`.
    pub(super) fn of<'a>(dim: usize, members: impl IntoIterator<Item = Member<'a>>) -> Self {
        let mut t = Self::default();
        for m in members {
            t.join(dim, m);
        }
        t
    }

    pub(super) fn join(&mut self, dim: usize, m: Member<'_>) {
        self.apply(dim, m, true);
    }

    pub(super) fn leave(&mut self, dim: usize, m: Member<'_>) {
        self.apply(dim, m, false);
    }

    fn apply(&mut self, dim: usize, member: Member<'_>, join: bool) {
        let m = member.memory;
        self.members = if join {
            self.members + 1
        } else {
            self.members.saturating_sub(1)
        };
        // A member of another length (a profile memory is not checked
        // against the index) adds nothing to the sum, as in the digest.
        if member.embedding.len() == dim {
            if self.sum.is_empty() {
                self.sum = vec![0; dim];
            }
            for (s, &v) in self.sum.iter_mut().zip(member.embedding.iter()) {
                *s = if join {
                    s.wrapping_add(fixed(v))
                } else {
                    s.wrapping_sub(fixed(v))
                };
            }
        }
        count(&mut self.users, &m.user_id, join);
        // A memory's items are distinct when formed; a restored one may
        // repeat one, which counts once, as in `shared_items`.
        let mut items: Vec<&str> = m.items.iter().map(String::as_str).collect();
        items.sort_unstable();
        items.dedup();
        let mut key = String::new();
        for item in items {
            pair_key(&mut key, item, &m.user_id);
            let before = self.pairs.contains_key(key.as_str());
            count(&mut self.pairs, key.as_str(), join);
            let after = self.pairs.contains_key(key.as_str());
            if before != after {
                count(&mut self.item_users, item, after);
            }
        }
        if self.members == 0 {
            // Nothing left: the sum's allocation goes, and the tally reads
            // as one built from no members (an empty sum, not zeros).
            *self = Self::default();
        }
    }

    /// Members counted.
    pub(super) fn members(&self) -> usize {
        self.members as usize
    }

    /// The digest (see [`super::SteamState::digest`]): items at least
    /// `floor` distinct users chose, named from `catalogue`.
    pub(super) fn digest(
        &self,
        catalogue: &HashMap<String, ItemFacts>,
        floor: usize,
        max_titles: usize,
    ) -> Digest {
        let mut d = Digest {
            users: self.users.len(),
            sum: self
                .sum
                .iter()
                .map(|&s| (s as f64 / SCALE) as f32)
                .collect(),
            ..Digest::default()
        };
        let mut shared: Vec<(u32, &ItemFacts)> = self
            .item_users
            .iter()
            .filter(|&(_, &n)| n as usize >= floor.max(1))
            .filter_map(|(i, &n)| Some((n, catalogue.get(i)?)))
            .collect();
        shared.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.title.cmp(&b.1.title)));
        for &(n, facts) in &shared {
            for c in &facts.categories {
                *d.facets.entry(c.clone()).or_default() += n;
            }
            if d.titles.len() < max_titles && !d.titles.contains(&facts.title) {
                d.titles.push(facts.title.clone());
            }
        }
        d
    }
}

/// The (item, user) pair as one string, unambiguous whatever either holds
/// (the item's length first), written into `key` (reused: a lookup
/// allocates nothing).
fn pair_key(key: &mut String, item: &str, user: &str) {
    use std::fmt::Write;
    key.clear();
    write!(key, "{}:", item.len()).expect("writing to a String cannot fail");
    key.push_str(item);
    key.push_str(user);
}

/// Adds or removes one from `key`'s count, dropping it at zero.
fn count<K, Q>(map: &mut HashMap<K, u32>, key: &Q, up: bool)
where
    K: std::borrow::Borrow<Q> + std::hash::Hash + Eq,
    Q: ToOwned<Owned = K> + std::hash::Hash + Eq + ?Sized,
{
    if up {
        match map.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                map.insert(key.to_owned(), 1);
            }
        }
    } else if let Some(n) = map.get_mut(key) {
        *n -= 1;
        if *n == 0 {
            map.remove(key);
        }
    }
}

/// The tallies of the communities large enough to keep one.
#[derive(Debug, Clone)]
pub(super) struct Tallies {
    dim: usize,
    keep_from: usize,
    by_community: HashMap<MemoryId, Tally>,
}

impl Tallies {
    /// A community of at least this many members keeps its tally; one that
    /// shrinks below half of it drops it. Smaller digests are built from
    /// the members: cheap, and a tally per singleton would cost more memory
    /// (`8 × dim` bytes) than the memory itself.
    pub(super) const KEEP_FROM: usize = 16;

    pub(super) fn new(dim: usize) -> Self {
        Self::keeping_from(dim, Self::KEEP_FROM)
    }

    /// Tallies kept from `keep_from` members (tests keep every one with 1).
    pub(super) fn keeping_from(dim: usize, keep_from: usize) -> Self {
        Self {
            dim,
            keep_from: keep_from.max(1),
            by_community: HashMap::new(),
        }
    }

    pub(super) fn dim(&self) -> usize {
        self.dim
    }

    pub(super) fn get(&self, c: MemoryId) -> Option<&Tally> {
        self.by_community.get(&c)
    }

    /// `m` joins community `c`'s tally, if `c` keeps one.
    pub(super) fn join(&mut self, c: MemoryId, m: Member<'_>) {
        if let Some(t) = self.by_community.get_mut(&c) {
            t.join(self.dim, m);
        }
    }

    /// `m` leaves community `c`'s tally, if `c` keeps one. An emptied tally
    /// stays until the community is gone ([`Tallies::remove`]): a member
    /// changed in place leaves and joins again.
    pub(super) fn leave(&mut self, c: MemoryId, m: Member<'_>) {
        if let Some(t) = self.by_community.get_mut(&c) {
            t.leave(self.dim, m);
        }
    }

    /// After `c`'s membership changed to `size` members: builds its tally
    /// from `members` once it is large enough, drops it once it is small.
    pub(super) fn resize<'a>(
        &mut self,
        c: MemoryId,
        size: usize,
        members: impl FnOnce() -> Vec<Member<'a>>,
    ) {
        let kept = self.by_community.contains_key(&c);
        if !kept && size >= self.keep_from {
            self.by_community.insert(c, Tally::of(self.dim, members()));
        } else if kept && size < self.keep_from / 2 {
            self.by_community.remove(&c);
        }
    }

    /// Forgets `c`'s tally (the community is gone).
    pub(super) fn remove(&mut self, c: MemoryId) {
        self.by_community.remove(&c);
    }

    /// Drops every tally.
    pub(super) fn clear(&mut self) {
        self.by_community.clear();
    }

    /// Communities keeping a tally.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by_community.len()
    }
}
