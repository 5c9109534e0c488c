//! Every backend against the scalar reference.

use proptest::prelude::*;

use super::CpuKernel;
use crate::reference::ScalarKernel;
use crate::{Corpus, Error, Hit, RowPrecision, SearchParams, SimilarityKernel};

/// Scores from different summation orders differ by a few ulps.
const TOL: f32 = 1e-5;

/// `got` is a correct answer if it has as many hits as the reference, every
/// reported score is the true score of its row, and the scores match the
/// reference's rank by rank (rows may swap only among near-ties).
fn assert_agrees(
    queries: &[f32],
    corpus: &Corpus,
    params: &SearchParams<'_>,
    got: &[Vec<Hit>],
    want: &[Vec<Hit>],
) {
    let q = crate::prepare_queries(queries, corpus, params).unwrap();
    assert_eq!(got.len(), want.len());
    for (qi, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "query {qi}: {g:?} vs {w:?}");
        let query = &q[qi * corpus.dim()..(qi + 1) * corpus.dim()];
        let mut seen = std::collections::HashSet::new();
        for (a, b) in g.iter().zip(w) {
            assert!(
                seen.insert(a.index),
                "query {qi}: duplicate row {}",
                a.index
            );
            let truth: f32 = query
                .iter()
                .zip(corpus.row(a.index as usize).iter())
                .map(|(x, y)| x * y)
                .sum();
            assert!(
                (a.score - truth).abs() <= TOL,
                "query {qi}: row {} reported {} true {truth}",
                a.index,
                a.score
            );
            assert!(
                (a.score - b.score).abs() <= TOL,
                "query {qi}: rank scores {} vs {}",
                a.score,
                b.score
            );
            assert!(a.score >= params.min_score - TOL);
            assert!(!params.exclude.is_some_and(|f| f(qi, a.index as usize)));
        }
        for pair in g.windows(2) {
            assert!(
                pair[0].score >= pair[1].score - TOL,
                "query {qi}: not sorted: {g:?}"
            );
        }
    }
}

fn kernels() -> Vec<Box<dyn SimilarityKernel>> {
    vec![
        Box::new(CpuKernel::default()),
        // Tiny blocks and one thread: exercises block edges and merging.
        Box::new(CpuKernel {
            threads: 1,
            block_rows: 3,
            query_block: 2,
        }),
        Box::new(CpuKernel {
            threads: 3,
            block_rows: 5,
            query_block: 7,
        }),
    ]
}

fn check(queries: &[f32], corpus: &Corpus, params: &SearchParams<'_>) {
    let want = ScalarKernel.top_k(queries, corpus, params).unwrap();
    for k in kernels() {
        let got = k.top_k(queries, corpus, params).unwrap();
        assert_agrees(queries, corpus, params, &got, &want);
    }
}

/// Values drawn from a small set make exact ties common.
fn values(len: usize, ties: bool) -> impl Strategy<Value = Vec<f32>> {
    if ties {
        prop::collection::vec(prop::sample::select(vec![-1.0f32, 0.0, 0.5, 1.0]), len).boxed()
    } else {
        prop::collection::vec(-1.0f32..1.0, len).boxed()
    }
}

/// (dim, corpus values, query values): up to 120 rows, 12 queries, 40 dims.
fn case() -> impl Strategy<Value = (usize, Vec<f32>, Vec<f32>)> {
    (1usize..40, 0usize..120, 0usize..12, any::<bool>()).prop_flat_map(|(dim, n, m, ties)| {
        (Just(dim), values(n * dim, ties), values(m * dim, ties))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_reference(
        (dim, corpus_values, queries) in case(),
        k in 0usize..20,
        min_score in prop::option::of(-1.0f32..1.0),
    ) {
        // Rows kept in f32 and in bf16: each against the reference over
        // the same corpus.
        for precision in [RowPrecision::F32, RowPrecision::Bf16] {
            let mut corpus = Corpus::with_precision(dim, precision);
            corpus.push_rows(&corpus_values).unwrap();
            let params = SearchParams { k, min_score: min_score.unwrap_or(f32::NEG_INFINITY), exclude: None };
            check(&queries, &corpus, &params);
            // The same with an exclusion filter ("not the same user": rows and
            // queries belong to users i % 3).
            let same_user = |q: usize, c: usize| q % 3 == c % 3;
            let params = SearchParams { exclude: Some(&same_user), ..params };
            check(&queries, &corpus, &params);
        }
    }
}

#[test]
fn k_larger_than_n_and_empty_inputs() {
    let corpus = Corpus::from_rows(&[1.0, 0.0, 0.0, 1.0, 0.6, 0.8], 2).unwrap();
    for k in kernels() {
        let hits = k
            .top_k(&[1.0, 0.0], &corpus, &SearchParams::top(10))
            .unwrap();
        assert_eq!(hits[0].len(), 3);
        assert_eq!(
            hits[0][0],
            Hit {
                index: 0,
                score: 1.0
            }
        );
        assert_eq!(hits[0][1].index, 2);
        assert!(
            k.top_k(&[], &corpus, &SearchParams::top(3))
                .unwrap()
                .is_empty()
        );
        let none = k
            .top_k(&[1.0, 0.0], &Corpus::new(2), &SearchParams::top(3))
            .unwrap();
        assert_eq!(none, vec![Vec::<Hit>::new()]);
        let zero_k = k
            .top_k(&[1.0, 0.0], &corpus, &SearchParams::top(0))
            .unwrap();
        assert_eq!(zero_k, vec![Vec::<Hit>::new()]);
    }
}

#[test]
fn exact_ties_break_by_index() {
    let corpus = Corpus::from_rows(&[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0], 2).unwrap();
    for k in kernels() {
        let hits = k
            .top_k(&[1.0, 0.0], &corpus, &SearchParams::top(2))
            .unwrap();
        assert_eq!(
            hits[0].iter().map(|h| h.index).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }
}

#[test]
fn nan_and_bad_shapes_are_rejected() {
    assert!(matches!(
        Corpus::from_rows(&[1.0, f32::NAN], 2),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        Corpus::from_rows(&[1.0, f32::INFINITY], 2),
        Err(Error::InvalidInput { .. })
    ));
    assert!(matches!(
        Corpus::from_rows(&[1.0, 2.0, 3.0], 2),
        Err(Error::InvalidInput { .. })
    ));
    let corpus = Corpus::from_rows(&[1.0, 0.0], 2).unwrap();
    let mut all: Vec<Box<dyn SimilarityKernel>> = kernels();
    all.push(Box::new(ScalarKernel));
    for k in all {
        let e = k
            .top_k(&[f32::NAN, 0.0], &corpus, &SearchParams::top(1))
            .unwrap_err();
        assert!(e.to_string().contains("NaN"), "{e}");
        assert!(
            k.top_k(&[1.0, 0.0, 1.0], &corpus, &SearchParams::top(1))
                .is_err()
        );
        let nan_floor = SearchParams {
            min_score: f32::NAN,
            ..SearchParams::top(1)
        };
        assert!(k.top_k(&[1.0, 0.0], &corpus, &nan_floor).is_err());
    }
}

#[test]
fn corpus_updates_incrementally() {
    let mut corpus = Corpus::from_rows(&[1.0, 0.0], 2).unwrap();
    corpus.push_rows(&[0.0, 3.0]).unwrap();
    assert_eq!(*corpus.row(1), [0.0, 1.0]);
    corpus.set_row(0, &[0.0, -2.0]).unwrap();
    assert_eq!(*corpus.row(0), [0.0, -1.0]);
    assert!(corpus.push_rows(&[f32::NAN, 1.0]).is_err());
    assert_eq!(corpus.len(), 2, "a rejected push appends nothing");
    let hits = CpuKernel::default()
        .top_k(&[0.0, 1.0], &corpus, &SearchParams::top(1))
        .unwrap();
    assert_eq!(hits[0][0].index, 1);
}

/// A bf16 corpus: half the bytes, each value the f32 row's rounded to
/// nearest (within 2⁻⁸ relative), read back the same by every accessor,
/// and updated in place like an f32 one.
#[test]
fn a_bf16_corpus_keeps_rounded_rows_in_half_the_bytes() {
    let dim = 384;
    let values: Vec<f32> = (0..5 * dim)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let full = Corpus::from_rows(&values, dim).unwrap();
    let mut half = Corpus::with_precision(dim, RowPrecision::Bf16);
    half.push_rows(&values).unwrap();
    assert_eq!(half.precision(), RowPrecision::Bf16);
    assert_eq!(half.len(), 5);
    assert_eq!(half.bytes() * 2, full.bytes());
    for i in 0..5 {
        let (a, b) = (full.row(i), half.row(i));
        for (x, y) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= x.abs() / 256.0, "{x} vs {y}");
            assert_eq!(half::bf16::from_f32(*x).to_f32(), *y);
        }
        let mut copied = vec![0.0; dim];
        half.copy_row(i, &mut copied);
        assert_eq!(copied, *b);
        assert_eq!(half.dot_row(i, &a), crate::dot(&a, &b));
        assert_eq!(*half.rows(i..i + 1), *b);
    }
    assert_eq!(half.values().len(), 5 * dim);
    half.set_row(2, &values[..dim]).unwrap();
    assert_eq!(*half.row(2), *half.row(0));
    let changed = half.changed_since(1).unwrap();
    assert_eq!((changed.len(), &changed[0]), (1, &(2..3)));
    assert!(half.push_rows(&[f32::NAN; 384]).is_err());
    assert_eq!(half.len(), 5, "a rejected push appends nothing");
    assert_eq!("bf16".parse::<RowPrecision>().unwrap(), RowPrecision::Bf16);
    assert!("f16".parse::<RowPrecision>().is_err());
}
