//! Relation extraction (STEAM §3.2.2): each new or changed memory links to
//! its global top-k1 most similar memories *of other users* with cosine ≥ τ,
//! found in one batch call to the similarity kernel per tenant.
//!
//! [`MemoryIndex`] is the shared embedding space, one [`Corpus`] per tenant
//! (links never cross tenants, so a tenant's memories are searched apart:
//! an approximate index then probes only lists of that tenant, and a small
//! tenant is searched exactly). One row per memory, updated in place when a
//! memory changes, tombstoned when one is deleted (rows are reused by later
//! memories).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};

use steamrf_kernels::{Corpus, RowPrecision, SearchParams, SimilarityKernel};

use super::MemoryId;

/// Every memory's embedding and owner, for global search.
#[derive(Debug, Clone)]
pub struct MemoryIndex {
    dim: usize,
    precision: RowPrecision,
    /// By tenant id.
    parts: Vec<Part>,
    /// (tenant, row) of each memory: 32 bits each, so a map slot with its
    /// 16-byte id takes 24 bytes (a tenant's part would need 2^32 rows,
    /// 1.5 TiB of vectors at 384 dimensions, to outgrow it).
    row_of: HashMap<MemoryId, (u32, u32)>,
    user_ids: HashMap<String, u32>,
    /// Tenant of each owner (indexed by owner id).
    owner_tenant: Vec<u32>,
    tenant_ids: HashMap<String, u32>,
    tenant_separator: Option<char>,
}

/// One tenant's memories.
#[derive(Debug, Clone)]
struct Part {
    corpus: Corpus,
    ids: Vec<MemoryId>,
    owners: Vec<u32>,
    live: Vec<bool>,
    free: Vec<usize>,
}

impl Part {
    fn new(dim: usize, precision: RowPrecision) -> Self {
        Self {
            corpus: Corpus::with_precision(dim, precision),
            ids: Vec::new(),
            owners: Vec::new(),
            live: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Puts memory `id` of `owner` in a free row or a new one; its row.
    fn insert(
        &mut self,
        id: MemoryId,
        owner: u32,
        embedding: &[f32],
    ) -> steamrf_kernels::Result<usize> {
        match self.free.pop() {
            Some(row) => {
                if let Err(e) = self.corpus.set_row(row, embedding) {
                    self.free.push(row);
                    return Err(e);
                }
                self.ids[row] = id;
                self.owners[row] = owner;
                self.live[row] = true;
                Ok(row)
            }
            None => {
                self.corpus.push_rows(embedding)?;
                self.ids.push(id);
                self.owners.push(owner);
                self.live.push(true);
                Ok(self.ids.len() - 1)
            }
        }
    }

    fn remove(&mut self, row: usize) {
        self.live[row] = false;
        self.free.push(row);
    }
}

pub use steamrf_schemas::tenancy::tenant_of;

/// One link found: `from` → `to` with cosine `score`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// The new or changed memory.
    pub from: MemoryId,
    /// A memory of another user.
    pub to: MemoryId,
    /// Cosine similarity.
    pub score: f32,
}

/// A link as a state keeps it, under its source's id: the target and the
/// cosine in 24 bytes, where a [`Link`] takes 40 (the source is already
/// the key). A writer holds about k1 of them per memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct OutLink {
    to: MemoryId,
    score: f32,
}

impl OutLink {
    /// `l` without its source.
    pub(crate) fn new(l: &Link) -> Self {
        Self {
            to: l.to,
            score: l.score,
        }
    }

    /// The target.
    pub(crate) fn to(&self) -> MemoryId {
        self.to
    }

    /// The link from `from` it keeps.
    pub(crate) fn link(&self, from: MemoryId) -> Link {
        Link {
            from,
            to: self.to(),
            score: self.score,
        }
    }

    /// The links of `from`, as kept.
    pub(crate) fn of(links: &[Link]) -> Vec<Self> {
        links.iter().map(Self::new).collect()
    }
}

impl MemoryIndex {
    /// An empty index of `dim`-dimensional embeddings.
    pub fn new(dim: usize) -> Self {
        Self::with_precision(dim, RowPrecision::F32)
    }

    /// An empty index keeping its embeddings in `precision`.
    pub fn with_precision(dim: usize, precision: RowPrecision) -> Self {
        Self {
            dim,
            precision,
            parts: Vec::new(),
            row_of: HashMap::new(),
            user_ids: HashMap::new(),
            owner_tenant: Vec::new(),
            tenant_ids: HashMap::new(),
            tenant_separator: None,
        }
    }

    /// Users whose ids differ in tenant ([`tenant_of`]) are never linked.
    pub fn with_tenant_separator(mut self, separator: Option<char>) -> Self {
        self.tenant_separator = separator;
        self
    }

    /// The embeddings' dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Live memories.
    pub fn len(&self) -> usize {
        self.row_of.len()
    }

    /// Whether there are no live memories.
    pub fn is_empty(&self) -> bool {
        self.row_of.is_empty()
    }

    /// Tenants with a corpus of their own.
    pub fn tenants(&self) -> usize {
        self.parts.len()
    }

    /// Inserts or replaces memory `id` of `user`.
    ///
    /// # Errors
    /// A wrong-length or non-finite embedding.
    pub fn upsert(
        &mut self,
        id: MemoryId,
        user: &str,
        embedding: &[f32],
    ) -> steamrf_kernels::Result<()> {
        let owner = match self.user_ids.get(user) {
            Some(&o) => o,
            None => {
                let o = self.user_ids.len() as u32;
                self.user_ids.insert(user.to_owned(), o);
                let tenant = tenant_of(user, self.tenant_separator);
                let next = self.tenant_ids.len() as u32;
                let t = *self.tenant_ids.entry(tenant.to_owned()).or_insert(next);
                if t as usize == self.parts.len() {
                    self.parts.push(Part::new(self.dim, self.precision));
                }
                self.owner_tenant.push(t);
                o
            }
        };
        let tenant = self.owner_tenant[owner as usize];
        if let Some(&(t, row)) = self.row_of.get(&id) {
            let (part, row) = (&mut self.parts[t as usize], row as usize);
            if t == tenant {
                part.corpus.set_row(row, embedding)?;
                part.owners[row] = owner;
                return Ok(());
            }
            // Another tenant's user now (an id never changes owner in
            // `SteamState`; kept correct here all the same).
            part.remove(row);
            self.row_of.remove(&id);
        }
        let part = &mut self.parts[tenant as usize];
        let row = part.insert(id, owner, embedding)?;
        let Ok(slot) = u32::try_from(row) else {
            part.remove(row);
            return Err(steamrf_kernels::Error::InvalidInput {
                message: format!(
                    "a tenant's relation index holds at most {} memories",
                    u32::MAX
                ),
            });
        };
        self.row_of.insert(id, (tenant, slot));
        Ok(())
    }

    /// Memory `id`'s embedding, if it is indexed.
    pub fn embedding(&self, id: MemoryId) -> Option<Cow<'_, [f32]>> {
        let &(t, row) = self.row_of.get(&id)?;
        Some(self.parts[t as usize].corpus.row(row as usize))
    }

    /// Removes memory `id` (its row is reused later).
    pub fn remove(&mut self, id: MemoryId) {
        if let Some((t, row)) = self.row_of.remove(&id) {
            self.parts[t as usize].remove(row as usize);
        }
    }

    /// For each of `memories` (ids already in the index), its top-`k1`
    /// memories of other users of its tenant with cosine ≥ `tau`: one kernel
    /// call per tenant among them, over that tenant's corpus.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn extract(
        &self,
        kernel: &dyn SimilarityKernel,
        memories: &[MemoryId],
        k1: usize,
        tau: f32,
    ) -> steamrf_kernels::Result<Vec<Link>> {
        let mut by_tenant: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for id in memories {
            if let Some(&(t, row)) = self.row_of.get(id) {
                by_tenant.entry(t).or_default().push(row as usize);
            }
        }
        let mut out = Vec::new();
        if k1 == 0 {
            return Ok(out);
        }
        for (t, rows) in by_tenant {
            let part = &self.parts[t as usize];
            let mut queries = Vec::with_capacity(rows.len() * self.dim);
            for &r in &rows {
                queries.extend_from_slice(&part.corpus.row(r));
            }
            let exclude =
                |q: usize, c: usize| !part.live[c] || part.owners[c] == part.owners[rows[q]];
            let params = SearchParams {
                k: k1,
                min_score: tau,
                exclude: Some(&exclude),
            };
            let hits = kernel.top_k(&queries, &part.corpus, &params)?;
            for (q, hs) in hits.into_iter().enumerate() {
                for h in hs {
                    out.push(Link {
                        from: part.ids[rows[q]],
                        to: part.ids[h.index as usize],
                        score: h.score,
                    });
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use steamrf_kernels::cpu::CpuKernel;

    #[test]
    fn an_out_link_keeps_every_bit_of_its_target_in_24_bytes() {
        assert_eq!(size_of::<OutLink>(), 24);
        assert_eq!(size_of::<Link>(), 40);
        for to in [
            0,
            1,
            u128::from(u64::MAX),
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            let l = Link {
                from: MemoryId(7),
                to: MemoryId(to),
                score: 0.5,
            };
            let kept = OutLink::new(&l);
            assert_eq!(kept.to(), MemoryId(to));
            assert_eq!(kept.score, 0.5);
        }
    }

    #[test]
    fn links_never_cross_tenants() {
        let mut idx = MemoryIndex::new(2).with_tenant_separator(Some(':'));
        idx.upsert(MemoryId(1), "acme:alice", &[1.0, 0.0]).unwrap();
        idx.upsert(MemoryId(2), "globex:bob", &[1.0, 0.0]).unwrap();
        idx.upsert(MemoryId(3), "acme:carol", &[0.9, 0.1]).unwrap();
        let links = idx
            .extract(&CpuKernel::default(), &[MemoryId(1)], 5, 0.0)
            .unwrap();
        assert_eq!(
            links.iter().map(|l| l.to).collect::<Vec<_>>(),
            vec![MemoryId(3)]
        );
        // Each tenant is searched in a corpus of its own.
        assert_eq!(idx.tenants(), 2);
        assert_eq!(tenant_of("acme:alice", Some(':')), "acme");
        assert_eq!(tenant_of("alice", Some(':')), "default");
        assert_eq!(tenant_of("acme:alice", None), "default");
    }

    #[test]
    fn links_go_to_other_users_above_tau_only() {
        let mut idx = MemoryIndex::new(2);
        idx.upsert(MemoryId(1), "alice", &[1.0, 0.0]).unwrap();
        idx.upsert(MemoryId(2), "alice", &[0.99, 0.1]).unwrap(); // same user: never linked
        idx.upsert(MemoryId(3), "bob", &[0.9, 0.3]).unwrap();
        idx.upsert(MemoryId(4), "carol", &[0.0, 1.0]).unwrap(); // orthogonal: below tau
        idx.upsert(MemoryId(5), "dave", &[0.8, 0.5]).unwrap();
        let links = idx
            .extract(&CpuKernel::default(), &[MemoryId(1)], 2, 0.5)
            .unwrap();
        let to: Vec<MemoryId> = links.iter().map(|l| l.to).collect();
        assert_eq!(to, vec![MemoryId(3), MemoryId(5)]);
        assert!(
            links
                .iter()
                .all(|l| l.from == MemoryId(1) && l.score >= 0.5)
        );
        // Deleted memories are never linked, and their rows are reused.
        idx.remove(MemoryId(3));
        let to: Vec<MemoryId> = idx
            .extract(&CpuKernel::default(), &[MemoryId(1)], 2, 0.5)
            .unwrap()
            .iter()
            .map(|l| l.to)
            .collect();
        assert_eq!(to, vec![MemoryId(5)]);
        idx.upsert(MemoryId(6), "erin", &[1.0, 0.0]).unwrap();
        assert_eq!(idx.len(), 5);
        let first = idx
            .extract(&CpuKernel::default(), &[MemoryId(1)], 1, 0.5)
            .unwrap();
        assert_eq!(first[0].to, MemoryId(6));
    }
}
