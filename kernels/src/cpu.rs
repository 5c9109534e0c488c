//! The CPU kernel: blocked GEMM (gemm's AVX2/AVX-512 micro-kernels, chosen at
//! run time) with the top-k fused per block.
//!
//! The corpus is cut into blocks of `block_rows` rows; threads take blocks in
//! turn. For each block and each chunk of `query_block` queries, one GEMM
//! writes a `query_block × block_rows` score tile into a per-thread scratch
//! buffer (2 MiB at the defaults, cache-resident), which is scanned at once
//! into per-query top-k collectors. The full `queries × corpus` score matrix
//! never exists, and the corpus is read in place (never copied per call).
//!
//! Measured on 2 cores (AVX-512): threads over corpus blocks beat gemm's own
//! rayon parallelism inside bigger GEMMs (243 vs 187 GFLOP/s at 1000 × 200k ×
//! 384), and 2048 × 256 tiles beat 16384 × 1000 ones. The hot crates must be
//! built with optimisation, without debug assertions and overflow checks, in
//! one codegen unit (see the workspace Cargo.toml): with the dev defaults the
//! same code ran at 80 GFLOP/s.

use std::sync::atomic::{AtomicUsize, Ordering};

use gemm::{Parallelism, gemm};

use crate::{
    Backend, Corpus, Hit, Prepared, Result, SearchParams, SimilarityKernel, TopK, prepare_search,
};

/// Blocked, multi-threaded CPU kernel.
#[derive(Debug, Clone, Copy)]
pub struct CpuKernel {
    /// Worker threads (default: available parallelism).
    pub threads: usize,
    /// Corpus rows per block.
    pub block_rows: usize,
    /// Queries per GEMM.
    pub query_block: usize,
}

impl Default for CpuKernel {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            block_rows: 2048,
            query_block: 256,
        }
    }
}

impl SimilarityKernel for CpuKernel {
    fn backend(&self) -> Backend {
        Backend::Cpu
    }

    fn top_k(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>> {
        let q = match prepare_search(queries, corpus, params)? {
            Prepared::Search(q) => q,
            Prepared::Answered(hits) => return Ok(hits),
        };
        let dim = corpus.dim();
        let m = q.len() / dim;
        let n = corpus.len();
        let block_rows = self.block_rows.max(1);
        let query_block = self.query_block.max(1);
        let blocks = n.div_ceil(block_rows);
        // Sized to the call: a single query over a small corpus (the
        // retrieval service's case) must not zero a 2 MiB tile.
        let scratch = query_block.min(m) * block_rows.min(n);
        let heaps = search_blocks(
            self.threads,
            blocks,
            m,
            params.k,
            scratch,
            |b, scratch, heaps| {
                let start = b * block_rows;
                let rows = block_rows.min(n - start);
                let block = &corpus.rows(start..start + rows);
                for q0 in (0..m).step_by(query_block) {
                    let qs = query_block.min(m - q0);
                    let lhs = &q[q0 * dim..(q0 + qs) * dim];
                    scores(&mut scratch[..qs * rows], lhs, block, qs, rows, dim);
                    for (i, scores) in scratch[..qs * rows].chunks_exact(rows).enumerate() {
                        let qi = q0 + i;
                        scan(&mut heaps[qi], scores, start, qi, params.min_score, params);
                    }
                }
            },
        );
        Ok(heaps.into_iter().map(TopK::into_sorted).collect())
    }
}

/// The blocked search both CPU kernels run: `threads` workers take the
/// `blocks` in turn, each with its own `scratch_len` floats and one top-`keep`
/// collector per query; `block(b, scratch, heaps)` scores block `b` into
/// them. Returns the merged collectors.
pub(crate) fn search_blocks<F>(
    threads: usize,
    blocks: usize,
    queries: usize,
    keep: usize,
    scratch_len: usize,
    block: F,
) -> Vec<TopK>
where
    F: Fn(usize, &mut [f32], &mut [TopK]) + Sync,
{
    let threads = threads.clamp(1, blocks.max(1));
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut heaps: Vec<TopK> = (0..queries).map(|_| TopK::new(keep)).collect();
        let mut scratch = vec![0.0f32; scratch_len];
        loop {
            let b = next.fetch_add(1, Ordering::Relaxed);
            if b >= blocks {
                break;
            }
            block(b, &mut scratch, &mut heaps);
        }
        heaps
    };
    let mut per_thread: Vec<Vec<TopK>> = if threads == 1 {
        vec![worker()]
    } else {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|_| s.spawn(worker)).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("kernel worker panicked"))
                .collect()
        })
    };
    let mut merged = per_thread.pop().unwrap_or_default();
    for other in per_thread {
        for (a, b) in merged.iter_mut().zip(other) {
            a.merge(b);
        }
    }
    merged
}

/// Queries per GEMM up to which scores are computed row by row instead.
/// gemm packs each corpus block before multiplying it, which for a handful
/// of queries (the retrieval service: one probe, a recollection beam of B)
/// reads the block twice and cost 68% of the time in `bench retrieve`.
const DIRECT_MAX_QUERIES: usize = 8;

/// `dst (qs × rows) = lhs (qs × dim) · blockᵀ (dim × rows)`, all row-major.
pub(crate) fn scores(
    dst: &mut [f32],
    lhs: &[f32],
    block: &[f32],
    qs: usize,
    rows: usize,
    dim: usize,
) {
    if qs <= DIRECT_MAX_QUERIES {
        direct(dst, lhs, block, rows, dim);
    } else {
        tile(dst, lhs, block, qs, rows, dim);
    }
}

fn direct(dst: &mut [f32], lhs: &[f32], block: &[f32], rows: usize, dim: usize) {
    dispatch!(direct_scores, direct_body(dst, lhs, block, rows, dim))
}

macro_rules! direct_variant {
    ($feature:literal, $module:ident) => {
        #[cfg(target_arch = "x86_64")]
        mod $module {
            #[target_feature(enable = $feature)]
            pub(super) fn direct_scores(
                dst: &mut [f32],
                lhs: &[f32],
                block: &[f32],
                rows: usize,
                dim: usize,
            ) {
                super::direct_body(dst, lhs, block, rows, dim)
            }
        }
    };
}
direct_variant!("avx512f", avx512);
direct_variant!("avx2,fma", avx2);

/// One pass over the block's rows, each dotted with every query while it is
/// in cache.
#[inline(always)]
fn direct_body(dst: &mut [f32], lhs: &[f32], block: &[f32], rows: usize, dim: usize) {
    for (j, row) in block.chunks_exact(dim).enumerate() {
        for (i, q) in lhs.chunks_exact(dim).enumerate() {
            dst[i * rows + j] = dot(q, row);
        }
    }
}

/// A dot product in 32 independent lanes (the compiler keeps them in two
/// vector registers; lane-wise sums need no reassociation to vectorise).
/// Lengths must match; extra values of the longer slice are ignored.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    let (ca, cb) = (a.chunks_exact(32), b.chunks_exact(32));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[f32; 32], &[f32; 32]) = match (x.try_into(), y.try_into()) {
            (Ok(x), Ok(y)) => (x, y),
            _ => unreachable!("chunks_exact(32) yields 32 values"),
        };
        for l in 0..32 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `dst (qs × rows) = lhs (qs × dim) · blockᵀ (dim × rows)`, all row-major.
fn tile(dst: &mut [f32], lhs: &[f32], block: &[f32], qs: usize, rows: usize, dim: usize) {
    assert!(dst.len() == qs * rows && lhs.len() == qs * dim && block.len() == rows * dim);
    // SAFETY: the assert above bounds every access: dst is qs×rows with row
    // stride `rows` and column stride 1; lhs is qs×dim with row stride `dim`;
    // the right-hand side reads block[j*dim + p] for p < dim, j < rows (row
    // stride 1, column stride `dim`). The three slices do not overlap (dst is
    // the only mutable borrow), and gemm reads nothing else.
    unsafe {
        gemm(
            qs,
            rows,
            dim,
            dst.as_mut_ptr(),
            1,
            rows as isize,
            false,
            lhs.as_ptr(),
            1,
            dim as isize,
            block.as_ptr(),
            dim as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// Feeds one query's scores over one block into its collector: scores at or
/// above `floor` (`params.min_score`, or lower for approximate scores), pairs
/// `params.exclude` rejects skipped.
#[inline]
pub(crate) fn scan(
    heap: &mut TopK,
    scores: &[f32],
    start: usize,
    qi: usize,
    floor: f32,
    params: &SearchParams<'_>,
) {
    scan_mapped(heap, scores, |j| start + j, qi, floor, params);
}

/// [`scan`] for scores of rows that are not contiguous in the corpus:
/// `row(j)` is the corpus row of score `j`.
#[inline]
pub(crate) fn scan_mapped(
    heap: &mut TopK,
    scores: &[f32],
    row: impl Fn(usize) -> usize,
    qi: usize,
    floor: f32,
    params: &SearchParams<'_>,
) {
    let mut threshold = heap.threshold().max(floor);
    let mut visit = |j: usize, score: f32, threshold: &mut f32| {
        // `>=` keeps ties; the collector breaks them by index.
        if score >= *threshold {
            let ci = row(j);
            if params.exclude.is_some_and(|f| f(qi, ci)) {
                return;
            }
            heap.push(Hit {
                index: ci as u32,
                score,
            });
            *threshold = heap.threshold().max(floor);
        }
    };
    // Sixteen scores at a time: one vectorised comparison rules out a whole
    // chunk, which is nearly every chunk once the heap is full (a branch
    // per score cost more than the int8 products that made them).
    let chunks = scores.chunks_exact(16);
    let tail = chunks.remainder();
    for (c, chunk) in chunks.enumerate() {
        if chunk.iter().fold(false, |any, &s| any | (s >= threshold)) {
            for (k, &score) in chunk.iter().enumerate() {
                visit(c * 16 + k, score, &mut threshold);
            }
        }
    }
    let base = scores.len() - tail.len();
    for (k, &score) in tail.iter().enumerate() {
        visit(base + k, score, &mut threshold);
    }
}

#[cfg(test)]
mod tests;
