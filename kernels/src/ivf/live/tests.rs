use super::*;

use crate::testdata::uniform;

/// `n` points around `clusters` random centres (noise 0.5 of the centre's
/// scale per component): nearest neighbours at cosine ~0.8, other clusters
/// near 0, like memories of distinct interests.
fn clustered(n: usize, clusters: usize, dim: usize, seed: u64) -> Vec<f32> {
    let centres = uniform(clusters, dim, seed);
    let noise = uniform(n, dim, seed + 1);
    let mut out = Vec::with_capacity(n * dim);
    for i in 0..n {
        let c = (i * 7919) % clusters;
        for d in 0..dim {
            out.push(centres[c * dim + d] + 0.5 * noise[i * dim + d]);
        }
    }
    out
}

fn params(min_rows: usize, lists: usize, probes: usize) -> IvfKernelParams {
    IvfKernelParams {
        lists,
        probes,
        min_rows,
        ..IvfKernelParams::default()
    }
}

fn ivf(p: IvfKernelParams) -> IvfKernel {
    IvfKernel::new(p, Arc::new(CpuKernel::default()))
}

fn ids(hits: &[Hit]) -> Vec<u32> {
    hits.iter().map(|h| h.index).collect()
}

/// Every row sits in exactly one list, at the position its slot says.
fn assert_consistent(k: &IvfKernel, n: usize) {
    let guard = k.index.lock().unwrap();
    let ix = guard.as_ref().expect("an index was built");
    let mut seen = vec![false; n];
    for (l, members) in ix.lists.iter().enumerate() {
        for (pos, &r) in members.iter().enumerate() {
            assert!(!seen[r as usize], "row {r} in two lists");
            seen[r as usize] = true;
            assert_eq!(ix.slot[r as usize], (l as u32, pos as u32));
        }
    }
    assert!(seen.iter().all(|&s| s), "a row is in no list");
}

#[test]
fn small_corpora_and_full_probes_are_answered_exactly() {
    let dim = 16;
    let rows = clustered(600, 12, dim, 3);
    let corpus = Corpus::from_rows(&rows, dim).unwrap();
    let exact = CpuKernel::default();
    let q = &rows[..20 * dim];
    let want = exact.top_k(q, &corpus, &SearchParams::top(5)).unwrap();
    // Below min_rows: the exact kernel, no index built.
    let k = ivf(params(1000, 10, 2));
    assert_eq!(k.top_k(q, &corpus, &SearchParams::top(5)).unwrap(), want);
    assert_eq!(k.stats(), IvfStats::default());
    // Probing every list: exact too (delegated after the index is built).
    let k = ivf(params(100, 10, 10));
    assert_eq!(k.top_k(q, &corpus, &SearchParams::top(5)).unwrap(), want);
    assert_eq!(k.stats().trainings, 1);
}

#[test]
fn approximate_hits_are_exact_scores_that_respect_the_filter() {
    let dim = 32;
    let n = 4000;
    let rows = clustered(n, 40, dim, 7);
    let corpus = Corpus::from_rows(&rows, dim).unwrap();
    let k = ivf(params(100, 0, 6));
    // Rows of the same "user" (row / 10) are excluded, as relation
    // extraction excludes a memory's own user.
    let exclude = |q: usize, c: usize| q / 10 == c / 10;
    let p = SearchParams {
        k: 3,
        min_score: 0.3,
        exclude: Some(&exclude),
    };
    let queries = &rows[..200 * dim];
    let got = k.top_k(queries, &corpus, &p).unwrap();
    let want = CpuKernel::default().top_k(queries, &corpus, &p).unwrap();
    let (mut found, mut total) = (0, 0);
    for (qi, (g, w)) in got.iter().zip(&want).enumerate() {
        for h in g {
            assert!(!exclude(qi, h.index as usize));
            assert!(h.score >= 0.3);
            let exact = crate::dot(corpus.row(qi), corpus.row(h.index as usize));
            assert!((h.score - exact).abs() < 1e-4, "{} vs {exact}", h.score);
        }
        let w = ids(w);
        total += w.len();
        found += ids(g).iter().filter(|i| w.contains(i)).count();
    }
    let stats = k.stats();
    assert_eq!(stats.rows, n);
    assert_eq!(stats.lists, 63); // sqrt(4000)
    let recall = found as f64 / total as f64;
    assert!(recall >= 0.95, "recall {recall} over {total} exact hits");
    assert_consistent(&k, n);
}

#[test]
fn changed_and_new_rows_are_found_without_retraining() {
    let dim = 16;
    let n = 2000;
    let rows = clustered(n, 20, dim, 11);
    let mut corpus = Corpus::from_rows(&rows, dim).unwrap();
    let k = ivf(params(100, 0, 3));
    let probe = uniform(1, dim, 99);
    let _ = k.top_k(&probe, &corpus, &SearchParams::top(1)).unwrap();
    assert_eq!(k.stats().trainings, 1);
    // A new row equal to the probe, then an old row moved onto its opposite
    // and back next to it: each is found at once, from the change log.
    corpus.push_rows(&probe).unwrap();
    let hits = k.top_k(&probe, &corpus, &SearchParams::top(1)).unwrap();
    assert_eq!(ids(&hits[0]), vec![n as u32]);
    let opposite: Vec<f32> = probe.iter().map(|v| -v).collect();
    corpus.set_row(n, &opposite).unwrap();
    corpus.set_row(5, &probe).unwrap();
    let hits = k.top_k(&probe, &corpus, &SearchParams::top(1)).unwrap();
    assert_eq!(ids(&hits[0]), vec![5]);
    assert!((hits[0][0].score - 1.0).abs() < 1e-5);
    let stats = k.stats();
    assert_eq!((stats.trainings, stats.rows), (1, n + 1));
    assert_eq!(stats.assigned_since_training, 3);
    assert_consistent(&k, n + 1);
}

#[test]
fn retrains_after_as_many_assignments_as_it_trained_on() {
    let dim = 8;
    let rows = clustered(400, 8, dim, 5);
    let mut corpus = Corpus::from_rows(&rows[..200 * dim], dim).unwrap();
    let k = ivf(IvfKernelParams {
        retrain_after: 0.5,
        ..params(100, 0, 2)
    });
    let q = &rows[..dim];
    let _ = k.top_k(q, &corpus, &SearchParams::top(1)).unwrap();
    assert_eq!(k.stats().trained_rows, 200);
    corpus.push_rows(&rows[200 * dim..299 * dim]).unwrap();
    let _ = k.top_k(q, &corpus, &SearchParams::top(1)).unwrap();
    assert_eq!(k.stats().trainings, 1, "99 < 0.5 x 200");
    corpus.push_rows(&rows[299 * dim..300 * dim]).unwrap();
    let _ = k.top_k(q, &corpus, &SearchParams::top(1)).unwrap();
    let stats = k.stats();
    assert_eq!((stats.trainings, stats.trained_rows), (2, 300));
    assert_eq!(stats.lists, 17); // sqrt(300)
    assert_consistent(&k, 300);
    // Another corpus: built again for it.
    let other = Corpus::from_rows(&rows, dim).unwrap();
    let _ = k.top_k(q, &other, &SearchParams::top(1)).unwrap();
    assert_eq!(k.stats().trainings, 3);
    assert_consistent(&k, 400);
}
