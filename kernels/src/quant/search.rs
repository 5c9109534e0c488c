//! [`QuantKernel`]: batch cosine similarity + top-k scored in int8 on AVX-512
//! VNNI, then rescored exactly in f32.
//!
//! The corpus is kept a second time in int8, one [`QuantLinear`] per block of
//! rows (a quarter of the f32 bytes), updated from the [`Corpus`]'s change
//! log like the CUDA backend's device copy. Each query keeps its best
//! `k · rescore` candidates by the int8 score (floor `min_score` less
//! [`SLACK`]); those are scored again exactly against the f32 rows, and the
//! exact scores decide the top-k and the floor. A hit is lost only when the
//! int8 error pushes it out of the `k · rescore` candidates, which
//! `steamrf bench similarity --precision int8` measures (recall@k against
//! the f32 kernel).

use std::sync::{Arc, Mutex, PoisonError};

use super::{Format, QuantLinear, vnni_available};
use crate::cpu::{CpuKernel, scan, search_blocks};
use crate::{
    Backend, Corpus, Error, Hit, PerCorpus, Prepared, Result, SearchParams, SimilarityKernel, TopK,
    prepare_search,
};

/// How far below `min_score` an int8 score may fall and still be rescored:
/// well above the int8 error of a cosine of 384-dimensional unit vectors
/// (about 0.01 at most).
pub const SLACK: f32 = 0.05;

/// [`QuantKernel::f32_below`]'s default: corpora of fewer rows are scored in
/// f32 (measured, see the field).
pub const INT8_MIN_ROWS: usize = 8192;

/// The int8 corpus: one layer per block of rows, edited row by row as the
/// corpus changes.
struct Shadow {
    version: u64,
    rows: usize,
    blocks: Vec<Arc<QuantLinear>>,
}

/// Int8 scoring with exact f32 rescoring (see the module docs).
pub struct QuantKernel {
    /// Worker threads.
    pub threads: usize,
    /// Corpus rows per block.
    pub block_rows: usize,
    /// Queries per block multiply.
    pub query_block: usize,
    /// Candidates rescored per query: `k · rescore`.
    pub rescore: usize,
    /// A corpus of fewer rows is scored by the f32 kernel, with no int8
    /// copy: there the int8 pass's fixed cost per call exceeds what it saves
    /// (a tenant's corpus of 3.1k memories, 16 changed memories a call:
    /// int8 90 ms against f32 65 ms per 1,000; at 15.6k memories int8 is
    /// 2.8× faster; docs/results.md, stop 61).
    pub f32_below: usize,
    /// The int8 copy of each corpus searched.
    shadow: Mutex<PerCorpus<Shadow>>,
}

impl std::fmt::Debug for QuantKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantKernel")
            .field("threads", &self.threads)
            .field("block_rows", &self.block_rows)
            .field("query_block", &self.query_block)
            .field("rescore", &self.rescore)
            .field("f32_below", &self.f32_below)
            .finish_non_exhaustive()
    }
}

impl QuantKernel {
    /// A kernel rescoring `k · rescore` candidates per query.
    ///
    /// # Errors
    /// [`Error::Unavailable`] on a CPU without AVX-512 VNNI (the scalar path
    /// would be slower than the f32 kernel).
    pub fn new(rescore: usize) -> Result<Self> {
        if !vnni_available() {
            return Err(Error::Unavailable {
                backend: Backend::Cpu,
                message: "int8 scoring needs AVX-512 VNNI, which this CPU lacks".into(),
            });
        }
        Ok(Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            block_rows: 2048,
            query_block: 256,
            rescore: rescore.max(1),
            f32_below: INT8_MIN_ROWS,
            shadow: Mutex::default(),
        })
    }

    /// Bytes of the int8 copies of the corpora searched (that still live).
    pub fn shadow_bytes(&self) -> usize {
        let guard = self.shadow.lock().unwrap_or_else(PoisonError::into_inner);
        guard
            .values()
            .flat_map(|s| &s.blocks)
            .map(|b| b.bytes())
            .sum()
    }

    /// Builds (or brings up to date) the int8 copy of `corpus` now rather
    /// than at its first search, so its bytes can be counted up front.
    pub fn prepare(&self, corpus: &Corpus) {
        if corpus.len() >= self.f32_below {
            self.blocks(corpus);
        }
    }

    /// The int8 blocks of `corpus`, brought up to date from its change log.
    fn blocks(&self, corpus: &Corpus) -> Vec<Arc<QuantLinear>> {
        let (n, dim, rows) = (corpus.len(), corpus.dim(), self.block_rows.max(1));
        let build = |b: usize| {
            let (start, end) = (b * rows, ((b + 1) * rows).min(n));
            let data = &corpus.rows(start..end);
            Arc::new(QuantLinear::new(
                Format::Int8,
                data,
                &vec![0.0; end - start],
                end - start,
                dim,
            ))
        };
        let mut guard = self.shadow.lock().unwrap_or_else(PoisonError::into_inner);
        let mut slot = guard.take(corpus);
        let changed = slot
            .as_ref()
            .filter(|s| s.rows == rows)
            .and_then(|s| corpus.changed_since(s.version));
        let shadow = match (slot.as_mut(), changed) {
            (Some(s), Some(ranges)) => {
                // Row by row: a changed row's codes are rewritten, a new one
                // appended (in ascending order, so appends stay in order).
                let mut changed: Vec<usize> = ranges.into_iter().flatten().collect();
                changed.sort_unstable();
                changed.dedup();
                for r in changed.into_iter().filter(|&r| r < n) {
                    let (b, j) = (r / rows, r % rows);
                    if b == s.blocks.len() {
                        s.blocks
                            .push(Arc::new(QuantLinear::new(Format::Int8, &[], &[], 0, dim)));
                    }
                    // The last search's clones are gone: no copy is made.
                    let block = Arc::make_mut(&mut s.blocks[b]);
                    if j < block.outputs() {
                        block.set_row(j, &corpus.row(r));
                    } else {
                        debug_assert_eq!(j, block.outputs(), "rows are appended in order");
                        block.push_row(&corpus.row(r), 0.0);
                    }
                }
                s.version = corpus.version();
                s
            }
            _ => slot.insert(Shadow {
                version: corpus.version(),
                rows,
                blocks: (0..n.div_ceil(rows)).map(build).collect(),
            }),
        };
        let blocks = shadow.blocks.clone();
        if let Some(shadow) = slot {
            guard.put(corpus, shadow);
        }
        blocks
    }
}

impl SimilarityKernel for QuantKernel {
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
        if n < self.f32_below {
            let f32_kernel = CpuKernel {
                threads: self.threads,
                ..CpuKernel::default()
            };
            return f32_kernel.top_k(queries, corpus, params);
        }
        let q = match prepare_search(queries, corpus, params)? {
            Prepared::Search(q) => q,
            Prepared::Answered(hits) => return Ok(hits),
        };
        let dim = corpus.dim();
        let m = q.len() / dim;
        let blocks = self.blocks(corpus);
        let rows = self.block_rows.max(1);
        let query_block = self.query_block.max(1);
        let floor = params.min_score - SLACK;
        let scratch = query_block.min(m) * rows.min(n);
        let candidates = params.k.saturating_mul(self.rescore);
        let merged = search_blocks(
            self.threads,
            blocks.len(),
            m,
            candidates,
            scratch,
            |b, scratch, heaps| {
                let (block, start) = (&blocks[b], b * rows);
                let len = block.outputs();
                for q0 in (0..m).step_by(query_block) {
                    let qs = query_block.min(m - q0);
                    let tile = &mut scratch[..qs * len];
                    block.forward(tile, &q[q0 * dim..(q0 + qs) * dim], qs);
                    for (i, scores) in tile.chunks_exact(len).enumerate() {
                        scan(&mut heaps[q0 + i], scores, start, q0 + i, floor, params);
                    }
                }
            },
        );
        Ok(rescore_exactly(&q, corpus, merged, params))
    }
}

/// Each query's candidates (`heaps`, by query) scored again exactly against
/// the f32 rows: the exact scores decide the top-k and the floor.
pub(crate) fn rescore_exactly(
    q: &[f32],
    corpus: &Corpus,
    heaps: Vec<TopK>,
    params: &SearchParams<'_>,
) -> Vec<Vec<Hit>> {
    let dim = corpus.dim();
    heaps
        .into_iter()
        .enumerate()
        .map(|(qi, heap)| {
            let query = &q[qi * dim..(qi + 1) * dim];
            let mut exact = TopK::new(params.k);
            for hit in heap.into_sorted() {
                let score = corpus.dot_row(hit.index as usize, query);
                if score >= params.min_score {
                    exact.push(Hit {
                        index: hit.index,
                        score,
                    });
                }
            }
            exact.into_sorted()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::reference::ScalarKernel;
    use crate::testdata::uniform;

    proptest! {
        /// Against the scalar reference: the same hits with the same exact
        /// scores when every row is a candidate (rescore · k ≥ n), floors and
        /// exclusions included; blocks smaller than the corpus, grown and
        /// changed between calls.
        #[test]
        fn matches_the_reference_when_every_row_is_rescored(
            n in 1usize..300, dim in 1usize..40, k in 1usize..8, seed in 0u64..500, floor in -1.0f32..0.5,
        ) {
            let Ok(mut kernel) = QuantKernel::new(1000) else { return Ok(()) };
            kernel.f32_below = 0;
            kernel.block_rows = 64;
            kernel.query_block = 3;
            let mut corpus = Corpus::from_rows(&uniform(n, dim, seed), dim).unwrap();
            let queries = uniform(5, dim, seed + 1);
            let exclude = |q: usize, c: usize| (q + c).is_multiple_of(7);
            let params = SearchParams { k, min_score: floor, exclude: Some(&exclude) };
            for round in 0..3 {
                let got = kernel.top_k(&queries, &corpus, &params).unwrap();
                let want = ScalarKernel.top_k(&queries, &corpus, &params).unwrap();
                for (g, w) in got.iter().zip(&want) {
                    prop_assert_eq!(g.len(), w.len(), "round {}", round);
                    for (a, b) in g.iter().zip(w) {
                        prop_assert_eq!(a.index, b.index);
                        prop_assert!((a.score - b.score).abs() < 1e-5);
                    }
                }
                // Grow, then change a row in place: the int8 copy follows.
                if round == 0 {
                    corpus.push_rows(&uniform(70, dim, seed + 9)).unwrap();
                } else {
                    corpus.set_row(n / 2, &uniform(1, dim, seed + 11)).unwrap();
                }
            }
        }
    }

    #[test]
    fn recall_at_10_on_random_vectors_with_4x_candidates() {
        let Ok(kernel) = QuantKernel::new(4) else {
            eprintln!("int8 similarity: skipped, this CPU has no AVX-512 VNNI");
            return;
        };
        eprintln!("int8 similarity: {} path", crate::quant::int8_unit());
        let dim = 384;
        let corpus = Corpus::from_rows(&uniform(20_000, dim, 3), dim).unwrap();
        let queries = uniform(20, dim, 4);
        let params = SearchParams::top(10);
        let got = kernel.top_k(&queries, &corpus, &params).unwrap();
        let want = CpuKernel::default()
            .top_k(&queries, &corpus, &params)
            .unwrap();
        let found: usize = got
            .iter()
            .zip(&want)
            .map(|(g, w)| {
                w.iter()
                    .filter(|h| g.iter().any(|x| x.index == h.index))
                    .count()
            })
            .sum();
        assert!(found >= 198, "recall@10 {found}/200");
        assert!(kernel.shadow_bytes() < corpus.bytes() / 3);
        // A second corpus (another tenant's) gets its own int8 copy; the
        // first keeps its own, and goes when its corpus does.
        let first = kernel.shadow_bytes();
        let other = Corpus::from_rows(&uniform(10_000, dim, 8), dim).unwrap();
        let _ = kernel.top_k(&queries, &other, &params).unwrap();
        let both = kernel.shadow_bytes();
        assert!(both > first);
        let again = kernel.top_k(&queries, &corpus, &params).unwrap();
        assert_eq!(again, got);
        assert_eq!(kernel.shadow_bytes(), both);
        drop(corpus);
        let _ = kernel.top_k(&queries, &other, &params).unwrap();
        assert_eq!(kernel.shadow_bytes(), both - first);
        // Below `f32_below` rows: the f32 kernel's answer, no int8 copy.
        let small = Corpus::from_rows(&uniform(kernel.f32_below - 1, dim, 9), dim).unwrap();
        let got = kernel.top_k(&queries, &small, &params).unwrap();
        let want = CpuKernel::default()
            .top_k(&queries, &small, &params)
            .unwrap();
        assert_eq!(got, want);
        assert_eq!(kernel.shadow_bytes(), both - first);
    }
}
