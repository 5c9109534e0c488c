//! Clustering and an in-memory IVF (inverted file) index for the read path.
//!
//! - [`kmeans`]: Lloyd's k-means (Euclidean, like scikit-learn's `KMeans`)
//!   for the handful of candidates the RF-Mem recollection clusters per
//!   round. Seeding is deterministic: the first centre is the first point
//!   (callers pass candidates best first), each next one the point farthest
//!   from the centres chosen so far (ties: lower index). No RNG, so the same
//!   candidates always give the same clusters.
//! - [`Ivf`]: a coarse quantiser (spherical k-means over a strided sample)
//!   and one contiguous [`Corpus`] per list. A query scores the centroids,
//!   scans the `probes` best lists with the CPU kernel and merges their
//!   top-k. Approximate: `steamrf bench retrieve` reports its recall against
//!   the exact search.
//! - [`IvfKernel`]: an inverted file kept up to date with a changing corpus
//!   (its change log), as a [`SimilarityKernel`] for relation extraction at
//!   millions of memories (see [`live`]).

mod live;

pub use live::{IvfKernel, IvfKernelParams, IvfStats};

use crate::cpu::CpuKernel;
use crate::{Corpus, Hit, Result, SearchParams, SimilarityKernel, TopK, invalid};

fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// Clusters `n = points.len() / dim` points into `min(k, n)` clusters and
/// returns each point's cluster (`0..k`). Deterministic (see the module docs);
/// at most `iters` Lloyd iterations, stopping early once no point moves.
///
/// # Errors
/// [`crate::Error::InvalidInput`] for a ragged input or `dim == 0`.
pub fn kmeans(points: &[f32], dim: usize, k: usize, iters: usize) -> Result<Vec<u32>> {
    if dim == 0 || !points.len().is_multiple_of(dim) {
        return Err(invalid("kmeans: points must be whole rows of dim > 0"));
    }
    let n = points.len() / dim;
    let k = k.min(n);
    if n == 0 || k == 0 {
        return Ok(vec![0; n]);
    }
    let row = |i: usize| &points[i * dim..(i + 1) * dim];
    // Farthest-first seeding from point 0.
    let mut centres: Vec<f32> = row(0).to_vec();
    let mut nearest: Vec<f32> = (0..n).map(|i| sq_dist(row(i), row(0))).collect();
    for _ in 1..k {
        let mut best = 0;
        for i in 1..n {
            if nearest[i] > nearest[best] {
                best = i;
            }
        }
        centres.extend_from_slice(row(best));
        let c = &centres[centres.len() - dim..];
        for (i, d) in nearest.iter_mut().enumerate() {
            *d = d.min(sq_dist(row(i), c));
        }
    }
    let mut labels = vec![u32::MAX; n];
    let mut sums = vec![0.0f32; k * dim];
    let mut counts = vec![0usize; k];
    for _ in 0..iters.max(1) {
        let mut moved = false;
        for (i, label) in labels.iter_mut().enumerate() {
            let mut best = (0u32, f32::INFINITY);
            for (c, centre) in centres.chunks_exact(dim).enumerate() {
                let d = sq_dist(row(i), centre);
                if d < best.1 {
                    best = (c as u32, d);
                }
            }
            if *label != best.0 {
                *label = best.0;
                moved = true;
            }
        }
        if !moved {
            break;
        }
        sums.iter_mut().for_each(|s| *s = 0.0);
        counts.iter_mut().for_each(|c| *c = 0);
        for (i, &l) in labels.iter().enumerate() {
            let l = l as usize;
            counts[l] += 1;
            for (s, v) in sums[l * dim..(l + 1) * dim].iter_mut().zip(row(i)) {
                *s += v;
            }
        }
        for c in 0..k {
            // An emptied cluster keeps its centre (it may win points back).
            if counts[c] > 0 {
                let inv = 1.0 / counts[c] as f32;
                for (dst, s) in centres[c * dim..(c + 1) * dim]
                    .iter_mut()
                    .zip(&sums[c * dim..(c + 1) * dim])
                {
                    *dst = s * inv;
                }
            }
        }
    }
    Ok(labels)
}

/// Lists for `n` rows: `configured`, or `sqrt(n)` when 0; at least 1, at most `n`.
pub(crate) fn lists_for(n: usize, configured: usize) -> usize {
    if configured == 0 {
        ((n as f64).sqrt().round() as usize).max(1)
    } else {
        configured.clamp(1, n.max(1))
    }
}

/// The coarse quantiser: spherical k-means (cosine; [`Corpus`] keeps
/// centroids unit-length) over a strided sample of `lists · per_list` rows,
/// seeded with evenly spaced sample rows, `iters` Lloyd rounds. An emptied
/// list keeps its centroid.
pub(crate) fn train(
    corpus: &Corpus,
    lists: usize,
    per_list: usize,
    iters: usize,
    kernel: &CpuKernel,
) -> Result<Corpus> {
    let (n, dim) = (corpus.len(), corpus.dim());
    let sample_n = (lists * per_list.max(1)).min(n);
    let stride = (n / sample_n.max(1)).max(1);
    let mut sample = Vec::with_capacity(sample_n * dim);
    for i in (0..n).step_by(stride).take(sample_n) {
        sample.extend_from_slice(&corpus.row(i));
    }
    let sample = Corpus::from_vec(sample, dim)?;
    let seed_stride = (sample.len() / lists.max(1)).max(1);
    let mut centres = Vec::with_capacity(lists * dim);
    for i in (0..sample.len()).step_by(seed_stride).take(lists) {
        centres.extend_from_slice(&sample.row(i));
    }
    let mut centroids = Corpus::from_vec(centres, dim)?;
    for _ in 0..iters {
        let assign = kernel.top_k(&sample.values(), &centroids, &SearchParams::top(1))?;
        let k = centroids.len();
        let mut sums = vec![0.0f32; k * dim];
        let mut counts = vec![0usize; k];
        for (i, hits) in assign.iter().enumerate() {
            if let Some(h) = hits.first() {
                let c = h.index as usize;
                counts[c] += 1;
                for (s, v) in sums[c * dim..(c + 1) * dim]
                    .iter_mut()
                    .zip(sample.row(i).iter())
                {
                    *s += v;
                }
            }
        }
        for c in 0..k {
            if counts[c] == 0 {
                sums[c * dim..(c + 1) * dim].copy_from_slice(&centroids.row(c));
            }
        }
        centroids = Corpus::from_vec(sums, dim)?;
    }
    Ok(centroids)
}

/// The nearest centroid of each of `corpus`'s rows `rows`, in chunks of
/// 64k rows on `kernel`'s threads.
pub(crate) fn assign(
    corpus: &Corpus,
    rows: std::ops::Range<usize>,
    centroids: &Corpus,
    kernel: &CpuKernel,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(rows.len());
    let chunk = 65_536;
    for start in rows.clone().step_by(chunk) {
        let end = (start + chunk).min(rows.end);
        let q = &corpus.rows(start..end);
        for hits in kernel.top_k(q, centroids, &SearchParams::top(1))? {
            out.push(hits.first().map_or(0, |h| h.index));
        }
    }
    Ok(out)
}

/// How an [`Ivf`] is built and searched.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IvfParams {
    /// Lists (0: `sqrt(n)`, at least 1).
    pub lists: usize,
    /// Lists scanned per query.
    pub probes: usize,
    /// Rows sampled (strided) to train the quantiser, per list.
    pub train_per_list: usize,
    /// Lloyd iterations of the quantiser.
    pub iters: usize,
}

impl Default for IvfParams {
    fn default() -> Self {
        Self {
            lists: 0,
            probes: 24,
            train_per_list: 32,
            iters: 8,
        }
    }
}

/// An inverted-file index over a fixed set of unit vectors.
#[derive(Debug)]
pub struct Ivf {
    centroids: Corpus,
    lists: Vec<Corpus>,
    ids: Vec<Vec<u32>>,
    probes: usize,
    rows: usize,
    scan: CpuKernel,
}

impl Ivf {
    /// Builds the index over `corpus` (row `i` keeps id `i`). Training and
    /// assignment run on `kernel`'s threads.
    ///
    /// # Errors
    /// Kernel errors (none for a valid corpus).
    pub fn build(corpus: &Corpus, p: &IvfParams, kernel: &CpuKernel) -> Result<Self> {
        let n = corpus.len();
        let centroids = train(
            corpus,
            lists_for(n, p.lists),
            p.train_per_list,
            p.iters,
            kernel,
        )?;
        let k = centroids.len();
        let mut ids: Vec<Vec<u32>> = vec![Vec::new(); k];
        for (i, c) in assign(corpus, 0..n, &centroids, kernel)?
            .into_iter()
            .enumerate()
        {
            ids[c as usize].push(i as u32);
        }
        let dim = corpus.dim();
        let mut data = Vec::with_capacity(k);
        for list in &ids {
            let mut rows = Vec::with_capacity(list.len() * dim);
            for &i in list {
                rows.extend_from_slice(&corpus.row(i as usize));
            }
            data.push(Corpus::from_vec(rows, dim)?);
        }
        Ok(Self {
            centroids,
            lists: data,
            ids,
            probes: p.probes.max(1),
            rows: n,
            scan: CpuKernel {
                threads: 1,
                ..CpuKernel::default()
            },
        })
    }

    /// Rows indexed.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Lists.
    pub fn lists(&self) -> usize {
        self.lists.len()
    }

    /// The approximate top-`k` (score ≥ `min_score`) of each query, in rank
    /// order, with the rows' original ids. Single-threaded per call.
    ///
    /// # Errors
    /// Invalid queries (ragged, NaN).
    pub fn search(&self, queries: &[f32], k: usize, min_score: f32) -> Result<Vec<Vec<Hit>>> {
        let dim = self.centroids.dim();
        let probes = self.scan.top_k(
            queries,
            &self.centroids,
            &SearchParams::top(self.probes.min(self.lists.len())),
        )?;
        let params = SearchParams {
            k,
            min_score,
            exclude: None,
        };
        // Queries probing the same list scan it together, in one GEMM: the
        // branches of a recollection round are close and share most lists.
        let mut by_list: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (qi, lists) in probes.iter().enumerate() {
            for l in lists {
                by_list.entry(l.index as usize).or_default().push(qi);
            }
        }
        let mut tops: Vec<TopK> = (0..probes.len()).map(|_| TopK::new(k)).collect();
        let mut batch = Vec::new();
        for (list, qs) in by_list {
            if self.lists[list].is_empty() {
                continue;
            }
            batch.clear();
            for &qi in &qs {
                batch.extend_from_slice(&queries[qi * dim..(qi + 1) * dim]);
            }
            let hits = self.scan.top_k(&batch, &self.lists[list], &params)?;
            for (&qi, hits) in qs.iter().zip(hits) {
                for h in hits {
                    tops[qi].push(Hit {
                        index: self.ids[list][h.index as usize],
                        score: h.score,
                    });
                }
            }
        }
        Ok(tops.into_iter().map(TopK::into_sorted).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blobs(centres: &[[f32; 3]], per: usize) -> Vec<f32> {
        let mut v = Vec::new();
        for (c, centre) in centres.iter().enumerate() {
            for i in 0..per {
                let j = (i as f32 + c as f32 * 0.37).sin() * 0.05;
                v.extend_from_slice(&[centre[0] + j, centre[1] - j, centre[2] + j * 0.5]);
            }
        }
        v
    }

    #[test]
    fn kmeans_separates_blobs_and_is_deterministic() {
        let pts = blobs(&[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], 5);
        let a = kmeans(&pts, 3, 3, 50).unwrap();
        assert_eq!(a, kmeans(&pts, 3, 3, 50).unwrap());
        for blob in a.chunks(5) {
            assert!(blob.iter().all(|&l| l == blob[0]), "{a:?}");
        }
        assert_eq!(a.iter().collect::<std::collections::BTreeSet<_>>().len(), 3);
        // More clusters than points, and no points.
        assert_eq!(kmeans(&pts[..6], 3, 5, 10).unwrap(), vec![0, 1]);
        assert!(kmeans(&[], 3, 2, 10).unwrap().is_empty());
        assert!(kmeans(&[1.0, 2.0], 3, 2, 10).is_err());
    }

    #[test]
    fn ivf_with_every_list_probed_is_exact() {
        let dim = 8;
        let n = 500;
        let rows: Vec<f32> = (0..n * dim)
            .map(|i| ((i as u64 * 2_654_435_761) % 10_007) as f32 / 10_007.0 - 0.5)
            .collect();
        let corpus = Corpus::from_rows(&rows, dim).unwrap();
        let kernel = CpuKernel::default();
        let ivf = Ivf::build(
            &corpus,
            &IvfParams {
                lists: 10,
                probes: 10,
                ..IvfParams::default()
            },
            &kernel,
        )
        .unwrap();
        assert_eq!(ivf.len(), n);
        let q = &rows[..3 * dim];
        let exact = kernel.top_k(q, &corpus, &SearchParams::top(7)).unwrap();
        let approx = ivf.search(q, 7, f32::NEG_INFINITY).unwrap();
        for (e, a) in exact.iter().zip(&approx) {
            let ids = |h: &[Hit]| h.iter().map(|h| h.index).collect::<Vec<_>>();
            assert_eq!(ids(e), ids(a));
            for (x, y) in e.iter().zip(a) {
                assert!((x.score - y.score).abs() < 1e-5);
            }
        }
        // Fewer probes: still the query's own row first (it is in its list).
        let ivf = Ivf::build(
            &corpus,
            &IvfParams {
                lists: 10,
                probes: 1,
                ..IvfParams::default()
            },
            &kernel,
        )
        .unwrap();
        let hits = ivf.search(&rows[dim * 5..dim * 6], 1, 0.0).unwrap();
        assert_eq!(hits[0][0].index, 5);
    }
}
