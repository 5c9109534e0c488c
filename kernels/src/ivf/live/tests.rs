use super::*;

use crate::RowPrecision;
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
    // The index of the corpus of `n` rows (a test may keep two corpora).
    let ix = guard
        .values()
        .find(|ix| ix.lists.iter().map(Vec::len).sum::<usize>() == n)
        .expect("an index of n rows was built");
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
            let exact = crate::dot(&corpus.row(qi), &corpus.row(h.index as usize));
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

/// With int8 lists: the lists' codes follow every row as it is added,
/// changed and moved between lists (byte for byte the layer built from the
/// list's rows now), and the hits are exact cosines that respect the floor
/// and the filter, with recall close to the f32 lists'.
#[test]
fn int8_lists_follow_the_rows_and_rescore_exactly() {
    int8_lists_follow_the_rows(RowPrecision::F32);
}

/// The same over a corpus kept in bf16: the codes are built from the rows
/// as stored, and the rescored scores are the f32 dot products with them.
#[test]
fn int8_lists_over_bf16_rows_rescore_against_the_rows_kept() {
    int8_lists_follow_the_rows(RowPrecision::Bf16);
}

fn int8_lists_follow_the_rows(precision: RowPrecision) {
    if !quant::vnni_available() {
        eprintln!("int8 IVF lists: skipped, this CPU lacks AVX-512 VNNI");
        return;
    }
    eprintln!(
        "int8 IVF lists over {} rows on {}",
        precision.as_str(),
        quant::int8_unit()
    );
    let dim = 32;
    let n = 4000;
    let rows = clustered(n + 400, 40, dim, 7);
    let mut corpus = Corpus::with_precision(dim, precision);
    corpus.push_rows(&rows[..n * dim]).unwrap();
    let p = params(100, 0, 6);
    let k8 = ivf(IvfKernelParams {
        int8_rescore: Some(4),
        ..p
    });
    let k32 = ivf(p);
    let exclude = |q: usize, c: usize| q / 10 == c / 10;
    let sp = SearchParams {
        k: 3,
        min_score: 0.3,
        exclude: Some(&exclude),
    };
    let queries = &rows[..200 * dim];
    let normalised = Corpus::from_rows(queries, dim).unwrap();
    let check = |k8: &IvfKernel, corpus: &Corpus| {
        let got = k8.top_k(queries, corpus, &sp).unwrap();
        let f32_hits = k32.top_k(queries, corpus, &sp).unwrap();
        let (mut same, mut total) = (0, 0);
        for (qi, (g, w)) in got.iter().zip(&f32_hits).enumerate() {
            for h in g {
                assert!(!exclude(qi, h.index as usize));
                assert!(h.score >= 0.3);
                let exact = crate::dot(&normalised.row(qi), &corpus.row(h.index as usize));
                assert_eq!(h.score, exact);
            }
            total += w.len();
            same += ids(g).iter().filter(|i| ids(w).contains(i)).count();
        }
        let agree = same as f64 / total as f64;
        assert!(
            agree >= 0.98,
            "int8 lists found {agree} of the f32 lists' hits"
        );
        // Each list's codes are the layer built from its rows.
        let guard = k8.index.lock().unwrap();
        let ix = guard.values().next().unwrap();
        let codes = ix.codes.as_ref().expect("int8 lists");
        for (members, layer) in ix.lists.iter().zip(codes) {
            let flat: Vec<f32> = members
                .iter()
                .flat_map(|&r| corpus.row(r as usize).to_vec())
                .collect();
            let built = QuantLinear::new(
                Format::Int8,
                &flat,
                &vec![0.0; members.len()],
                members.len(),
                dim,
            );
            assert_eq!(layer.outputs(), members.len());
            let x = &rows[..2 * dim];
            let (mut a, mut b) = (vec![0.0; 2 * members.len()], vec![0.0; 2 * members.len()]);
            layer.forward(&mut a, x, 2);
            built.forward(&mut b, x, 2);
            assert_eq!(a, b);
        }
    };
    check(&k8, &corpus);
    // New rows, and old rows moved elsewhere (into other lists, mostly).
    corpus.push_rows(&rows[n * dim..]).unwrap();
    for r in (0..n).step_by(37) {
        let other = &rows[((r * 13) % n) * dim..((r * 13) % n + 1) * dim];
        corpus.set_row(r, other).unwrap();
    }
    check(&k8, &corpus);
    let stats = k8.stats();
    assert_eq!(stats.trainings, 1);
    // A byte per value, 12 per row (scale, code sum, bias), and per list at
    // most one partly filled block of 48 rows and the AMX slack.
    let rows_bytes = (n + 400) * (dim + 12);
    let per_list = quant::NR * (dim + 12) + 15 * quant::NR * 4;
    assert!(stats.code_bytes >= (n + 400) * dim);
    assert!(
        stats.code_bytes <= rows_bytes + stats.lists * per_list,
        "{stats:?}"
    );
    assert_consistent(&k8, n + 400);
}

/// Corpora searched in turn (one per tenant) each keep their own index:
/// alternating between them trains each once; a corpus dropped takes its
/// index with it at the next call.
#[test]
fn each_corpus_keeps_its_index_while_it_lives() {
    let dim = 16;
    let a = Corpus::from_rows(&clustered(600, 6, dim, 1), dim).unwrap();
    let b = Corpus::from_rows(&clustered(900, 6, dim, 2), dim).unwrap();
    let k = ivf(params(100, 0, 2));
    let q = uniform(3, dim, 5);
    for _ in 0..3 {
        for c in [&a, &b] {
            let got = k.top_k(&q, c, &SearchParams::top(2)).unwrap();
            assert_eq!(got.len(), 3);
        }
    }
    let s = k.stats();
    assert_eq!((s.trainings, s.rows), (2, 1500));
    drop(b);
    let _ = k.top_k(&q, &a, &SearchParams::top(2)).unwrap();
    let s = k.stats();
    assert_eq!((s.trainings, s.rows), (2, 600));
}
