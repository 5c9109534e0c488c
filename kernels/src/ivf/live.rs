//! [`IvfKernel`]: approximate batch top-k over a corpus that keeps changing,
//! for relation extraction at millions of memories.
//!
//! The exact kernels scan every row for every query, so a batch of changed
//! memories costs `batch × corpus` dot products and the community writer
//! saturates at a few hundred changed memories per second at 1M memories.
//! This kernel keeps an inverted file over the corpus it is asked to
//! search:
//!
//! - a coarse quantiser (spherical k-means over a strided sample, `sqrt(n)`
//!   lists unless configured) and, per list, the corpus rows assigned to it
//!   (row ids only: the vectors stay in the [`Corpus`], nothing is copied);
//! - kept up to date from the corpus's change log: each new or changed row
//!   is assigned to its nearest centroid (one small GEMM per call) and moved
//!   between lists in O(1);
//! - retrained (k-means again, every row reassigned) once as many rows have
//!   been assigned since the last training as it was trained on
//!   (`retrain_after`, 1.0: the corpus doubled or was rewritten once over),
//!   so the lists follow drift and growth at an amortised O(1) per row;
//! - below `min_rows` rows, and whenever `probes` covers every list, the
//!   exact kernel answers instead.
//!
//! A query scores the centroids, then its `probes` best lists. Queries that
//! probe the same list share one pass over it, on the kernel's threads, in
//! one of two ways:
//!
//! - **f32**: the list's rows are gathered from the corpus into a tile and
//!   multiplied with all of its queries (the exact kernel's GEMM and fused
//!   top-k). Scores are exact f32 cosines.
//! - **int8** (`IvfKernelParams::int8_rescore`, on AVX-512 VNNI or AMX-INT8):
//!   each list also keeps its rows' int8 codes contiguously, in the layout
//!   [`QuantLinear`] multiplies (a quarter of the f32 bytes, kept up to date
//!   row by row as rows move between lists), so a list costs one int8 GEMM
//!   and no gather. Each query keeps its best `k · rescore` candidates by
//!   the int8 score (floor `min_score` less [`quant::SLACK`]), rescored
//!   exactly against the f32 rows, as [`quant::QuantKernel`] does over the
//!   whole corpus.
//!
//! Either way the hits carry exact f32 cosines, so `min_score` and the
//! exclusion filter apply exactly; a true neighbour is missed when it sits in
//! a list the query did not probe (or, in int8, falls out of the
//! candidates). `steamrf bench communities --index ivf` measures that
//! recall against the exact kernel on the same batches.

use std::sync::{Arc, Mutex, PoisonError};

use crate::cpu::{CpuKernel, scan_mapped, scores, search_blocks};
use crate::quant::{self, Format, QuantLinear};
use crate::{
    Backend, Corpus, Hit, PerCorpus, Prepared, Result, SearchParams, SimilarityKernel, TopK,
    prepare_search,
};

use super::{assign, lists_for, train};

/// How an [`IvfKernel`] indexes and searches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IvfKernelParams {
    /// Lists (0: `sqrt(n)` at each training).
    pub lists: usize,
    /// Lists scanned per query.
    pub probes: usize,
    /// Below this many corpus rows the exact kernel answers.
    pub min_rows: usize,
    /// Retrain once rows assigned since the last training reach this share
    /// of the rows trained on.
    pub retrain_after: f32,
    /// Sample rows per list the quantiser trains on.
    pub train_per_list: usize,
    /// Lloyd iterations of the quantiser.
    pub iters: usize,
    /// Score the lists in int8 and rescore this many candidates per hit
    /// wanted exactly in f32 (see the module docs); `None`, or a CPU
    /// without AVX-512 VNNI: f32.
    pub int8_rescore: Option<usize>,
}

impl Default for IvfKernelParams {
    fn default() -> Self {
        Self {
            lists: 0,
            probes: 16,
            min_rows: 100_000,
            retrain_after: 1.0,
            train_per_list: 32,
            iters: 8,
            int8_rescore: None,
        }
    }
}

/// The index's shape, for logs, metrics and the benchmark.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IvfStats {
    /// Rows indexed (0 while the exact kernel answers).
    pub rows: usize,
    /// Lists.
    pub lists: usize,
    /// Rows in the largest list.
    pub largest_list: usize,
    /// Rows the quantiser was last trained on.
    pub trained_rows: usize,
    /// Rows (re)assigned since the last training.
    pub assigned_since_training: usize,
    /// Trainings so far (the first build included).
    pub trainings: u64,
    /// Bytes of the lists' int8 codes (0 when scoring in f32).
    pub code_bytes: usize,
}

/// Where a row sits: (list, position in it).
const UNASSIGNED: (u32, u32) = (u32::MAX, u32::MAX);

struct Index {
    version: u64,
    centroids: Corpus,
    lists: Vec<Vec<u32>>,
    /// Per list, its rows' int8 codes in list order (int8 scoring only).
    codes: Option<Vec<QuantLinear>>,
    slot: Vec<(u32, u32)>,
    trained_rows: usize,
    assigned_since_training: usize,
}

impl Index {
    /// Puts `row` (whose vector is `v`, now) into `list`; its int8 codes
    /// follow it, and are rewritten when it stays.
    fn place(&mut self, row: usize, list: u32, v: &[f32]) {
        if self.slot.len() <= row {
            self.slot.resize(row + 1, UNASSIGNED);
        }
        let (old, pos) = self.slot[row];
        if old == list {
            if let Some(codes) = &mut self.codes {
                codes[list as usize].set_row(pos as usize, v);
            }
            return;
        }
        if old != u32::MAX {
            let members = &mut self.lists[old as usize];
            members.swap_remove(pos as usize);
            if let Some(&moved) = members.get(pos as usize) {
                self.slot[moved as usize].1 = pos;
            }
            if let Some(codes) = &mut self.codes {
                codes[old as usize].swap_remove_row(pos as usize);
            }
        }
        let members = &mut self.lists[list as usize];
        self.slot[row] = (list, members.len() as u32);
        members.push(row as u32);
        if let Some(codes) = &mut self.codes {
            codes[list as usize].push_row(v, 0.0);
        }
    }

    /// Bytes of the int8 codes.
    fn code_bytes(&self) -> usize {
        self.codes.iter().flatten().map(QuantLinear::bytes).sum()
    }
}

/// Approximate top-k by an inverted file kept up to date with the corpus
/// (see the module docs), one per corpus searched (kept while the corpus lives).
pub struct IvfKernel {
    /// Index and search parameters.
    pub params: IvfKernelParams,
    /// Worker threads.
    pub threads: usize,
    /// Queries per list multiply.
    pub query_block: usize,
    exact: Arc<dyn SimilarityKernel>,
    index: Mutex<PerCorpus<Index>>,
    trainings: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for IvfKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IvfKernel")
            .field("params", &self.params)
            .field("threads", &self.threads)
            .field("exact", &self.exact.backend())
            .finish_non_exhaustive()
    }
}

impl IvfKernel {
    /// An IVF kernel falling back to `exact` below `params.min_rows`.
    pub fn new(params: IvfKernelParams, exact: Arc<dyn SimilarityKernel>) -> Self {
        Self {
            params,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            query_block: 256,
            exact,
            index: Mutex::default(),
            trainings: Default::default(),
        }
    }

    /// The indexes' current shape, summed over the corpora indexed (one
    /// per tenant where relation extraction partitions by tenant; the
    /// largest list is the largest of all).
    pub fn stats(&self) -> IvfStats {
        let guard = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let mut s = IvfStats {
            trainings: self.trainings.load(std::sync::atomic::Ordering::Relaxed),
            ..IvfStats::default()
        };
        for ix in guard.values() {
            s.rows += ix.lists.iter().map(Vec::len).sum::<usize>();
            s.lists += ix.lists.len();
            s.largest_list = s
                .largest_list
                .max(ix.lists.iter().map(Vec::len).max().unwrap_or(0));
            s.trained_rows += ix.trained_rows;
            s.assigned_since_training += ix.assigned_since_training;
            s.code_bytes += ix.code_bytes();
        }
        s
    }

    fn cpu(&self) -> CpuKernel {
        CpuKernel {
            threads: self.threads,
            ..CpuKernel::default()
        }
    }

    /// Candidates rescored per hit when the lists are scored in int8 (on
    /// this CPU).
    fn int8_rescore(&self) -> Option<usize> {
        self.params
            .int8_rescore
            .filter(|_| quant::vnni_available())
            .map(|r| r.max(1))
    }

    /// Trains the quantiser on `corpus` and assigns every row.
    fn build(&self, corpus: &Corpus) -> Result<Index> {
        let n = corpus.len();
        let p = &self.params;
        let cpu = self.cpu();
        let centroids = train(
            corpus,
            lists_for(n, p.lists),
            p.train_per_list,
            p.iters,
            &cpu,
        )?;
        let mut ix = Index {
            version: corpus.version(),
            lists: vec![Vec::new(); centroids.len()],
            codes: None,
            centroids,
            slot: Vec::with_capacity(n),
            trained_rows: n,
            assigned_since_training: 0,
        };
        let mut v = vec![0.0; corpus.dim()];
        for (row, list) in assign(corpus, 0..n, &ix.centroids, &cpu)?
            .into_iter()
            .enumerate()
        {
            corpus.copy_row(row, &mut v);
            ix.place(row, list, &v);
        }
        if self.int8_rescore().is_some() {
            let dim = corpus.dim();
            let mut rows = Vec::new();
            ix.codes = Some(
                ix.lists
                    .iter()
                    .map(|members| {
                        rows.clear();
                        rows.resize(members.len() * dim, 0.0);
                        for (dst, &r) in rows.chunks_exact_mut(dim).zip(members) {
                            corpus.copy_row(r as usize, dst);
                        }
                        let n = members.len();
                        QuantLinear::new(Format::Int8, &rows, &vec![0.0; n], n, dim)
                    })
                    .collect(),
            );
        }
        self.trainings
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(rows = n, lists = ix.lists.len(), "IVF trained.");
        Ok(ix)
    }

    /// The index of `corpus` (`slot`, none at first), brought up to date
    /// from its change log, or rebuilt (the log no longer reaching back, or
    /// the retraining rule).
    fn refresh(&self, slot: &mut Option<Index>, corpus: &Corpus) -> Result<()> {
        let changed = slot
            .as_ref()
            .and_then(|ix| corpus.changed_since(ix.version));
        let updated = match (slot.as_mut(), changed) {
            (Some(ix), Some(ranges)) => self.update(ix, corpus, ranges)?,
            _ => false,
        };
        if !updated {
            *slot = Some(self.build(corpus)?);
        }
        Ok(())
    }

    /// Assigns the changed `ranges` of rows to their nearest lists; `false`
    /// when the retraining rule says to build again instead.
    fn update(
        &self,
        ix: &mut Index,
        corpus: &Corpus,
        ranges: Vec<std::ops::Range<usize>>,
    ) -> Result<bool> {
        let mut rows: Vec<usize> = ranges.into_iter().flatten().collect();
        rows.sort_unstable();
        rows.dedup();
        let due = (ix.assigned_since_training + rows.len()) as f64
            >= f64::from(self.params.retrain_after) * ix.trained_rows.max(1) as f64;
        if due {
            return Ok(false);
        }
        if !rows.is_empty() {
            let dim = corpus.dim();
            let mut q = vec![0.0; rows.len() * dim];
            for (dst, &r) in q.chunks_exact_mut(dim).zip(&rows) {
                corpus.copy_row(r, dst);
            }
            let nearest = self.cpu().top_k(&q, &ix.centroids, &SearchParams::top(1))?;
            for ((&row, hits), v) in rows.iter().zip(nearest).zip(q.chunks_exact(dim)) {
                ix.place(row, hits.first().map_or(0, |h| h.index), v);
            }
            ix.assigned_since_training += rows.len();
        }
        ix.version = corpus.version();
        Ok(true)
    }
}

impl SimilarityKernel for IvfKernel {
    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn top_k(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>> {
        let n = corpus.len();
        if n < self.params.min_rows.max(1) || params.k == 0 {
            return self.exact.top_k(queries, corpus, params);
        }
        let q = match prepare_search(queries, corpus, params)? {
            Prepared::Search(q) => q,
            Prepared::Answered(hits) => return Ok(hits),
        };
        let mut guard = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let mut slot = guard.take(corpus);
        self.refresh(&mut slot, corpus)?;
        let Some(ix) = slot else {
            unreachable!("refresh leaves an index");
        };
        let found = self.search(&ix, queries, &q, corpus, params);
        guard.put(corpus, ix);
        found
    }
}

impl IvfKernel {
    /// `q` (the prepared `queries`) over `ix`, the index of `corpus`.
    fn search(
        &self,
        ix: &Index,
        queries: &[f32],
        q: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>> {
        let dim = corpus.dim();
        let m = q.len() / dim;
        let probes = self.params.probes.max(1);
        if probes >= ix.lists.len() {
            return self.exact.top_k(queries, corpus, params);
        }
        let nearest = self
            .cpu()
            .top_k(q, &ix.centroids, &SearchParams::top(probes))?;
        let mut by_list: Vec<Vec<u32>> = vec![Vec::new(); ix.lists.len()];
        for (qi, hits) in nearest.iter().enumerate() {
            for h in hits {
                by_list[h.index as usize].push(qi as u32);
            }
        }
        // The costliest lists first, so the threads finish together.
        let mut work: Vec<usize> = (0..ix.lists.len())
            .filter(|&l| !by_list[l].is_empty() && !ix.lists[l].is_empty())
            .collect();
        work.sort_by_key(|&l| std::cmp::Reverse(by_list[l].len() * ix.lists[l].len()));
        let longest = work.iter().map(|&l| ix.lists[l].len()).max().unwrap_or(0);
        let query_block = self.query_block.max(1);
        let widest = work.iter().map(|&l| by_list[l].len()).max().unwrap_or(0);
        let qb = query_block.min(widest);
        // int8 lists keep `k · rescore` candidates per query down to the
        // floor less the int8 error, rescored exactly below; f32 lists keep
        // the top-k itself, and gather each list's rows into a tile.
        let int8 = ix.codes.as_deref().zip(self.int8_rescore());
        let (kept, floor, tile_len) = match int8 {
            Some((_, rescore)) => (
                params.k.saturating_mul(rescore),
                params.min_score - quant::SLACK,
                0,
            ),
            None => (params.k, params.min_score, longest * dim),
        };
        let heaps = search_blocks(
            self.threads,
            work.len(),
            m,
            kept,
            tile_len + qb * dim + qb * longest,
            |b, scratch, heaps| {
                let list = work[b];
                let rows = &ix.lists[list];
                let n = rows.len();
                let (tile, rest) = scratch.split_at_mut(tile_len);
                let visit = |s: &[f32], qi: usize| {
                    scan_mapped(&mut heaps[qi], s, |j| rows[j] as usize, qi, floor, params);
                };
                let queries = &by_list[list];
                match int8 {
                    Some((codes, _)) => in_chunks(
                        q,
                        dim,
                        queries,
                        qb,
                        n,
                        rest,
                        |out, lhs, qs| codes[list].forward(out, lhs, qs),
                        visit,
                    ),
                    None => {
                        let tile = &mut tile[..n * dim];
                        for (dst, &r) in tile.chunks_exact_mut(dim).zip(rows) {
                            corpus.copy_row(r as usize, dst);
                        }
                        in_chunks(
                            q,
                            dim,
                            queries,
                            qb,
                            n,
                            rest,
                            |out, lhs, qs| scores(out, lhs, tile, qs, n, dim),
                            visit,
                        );
                    }
                }
            },
        );
        Ok(match int8 {
            Some(_) => quant::rescore_exactly(q, corpus, heaps, params),
            None => heaps.into_iter().map(TopK::into_sorted).collect(),
        })
    }
}

/// One list's pass: `queries` (indices into `q`) in chunks of `qb`, each
/// chunk's rows of `q` gathered into the front of `scratch` (`qb · dim`),
/// `score(out, lhs, chunk)` writing `chunk × n` scores into the rest, then
/// `visit(scores, query)` for each query's row.
#[allow(clippy::too_many_arguments)]
fn in_chunks(
    q: &[f32],
    dim: usize,
    queries: &[u32],
    qb: usize,
    n: usize,
    scratch: &mut [f32],
    mut score: impl FnMut(&mut [f32], &[f32], usize),
    mut visit: impl FnMut(&[f32], usize),
) {
    let (lhs, out) = scratch.split_at_mut(qb * dim);
    for chunk in queries.chunks(qb) {
        let qs = chunk.len();
        for (dst, &qi) in lhs.chunks_exact_mut(dim).zip(chunk) {
            let qi = qi as usize;
            dst.copy_from_slice(&q[qi * dim..(qi + 1) * dim]);
        }
        let out = &mut out[..qs * n];
        score(out, &lhs[..qs * dim], qs);
        for (s, &qi) in out.chunks_exact(n).zip(chunk) {
            visit(s, qi as usize);
        }
    }
}

#[cfg(test)]
mod tests;
