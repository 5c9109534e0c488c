use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;

fn params() -> RfMemParams {
    RfMemParams::default()
}

#[test]
fn the_gate_follows_the_official_rules() {
    let p = params();
    // Mean ≥ θ_high (0.5): familiarity, whatever the entropy.
    let (path, rule, probe) = gate(&[0.9, 0.7, 0.6, 0.5, 0.5, 0.4, 0.4, 0.4, 0.4, 0.3], &p);
    assert_eq!((path, rule), (Path::Familiarity, Rule::MeanHigh));
    assert!((probe.mean - 0.51).abs() < 1e-6);
    // Mean ≤ θ_low (0.2): recollection.
    let (path, rule, _) = gate(&[0.3, 0.2, 0.1, 0.1], &p);
    assert_eq!((path, rule), (Path::Recollection, Rule::MeanLow));
    // Between the thresholds, flat scores: p is uniform, the mean-form
    // entropy is ln(10)/10 = 0.2303 < τ = 0.25, so familiarity — the
    // official settings never reach recollection this way.
    let flat = [0.3f32; 10];
    let (path, rule, probe) = gate(&flat, &p);
    assert!(
        (probe.entropy - 10f32.ln() / 10.0).abs() < 1e-6,
        "{probe:?}"
    );
    assert_eq!((path, rule), (Path::Familiarity, Rule::LowEntropy));
    // A lower τ sends the same flat scores to recollection.
    let low_tau = RfMemParams { tau: 0.2, ..p };
    assert_eq!(gate(&flat, &low_tau).1, Rule::HighEntropy);
    // One clear winner: p is peaked, entropy near 0.
    let mut peaked = [0.25f32; 10];
    peaked[3] = 0.6;
    let (path, rule, probe) = gate(&peaked, &low_tau);
    assert_eq!((path, rule), (Path::Familiarity, Rule::LowEntropy));
    assert!(probe.entropy < 0.01, "{probe:?}");
    // The paper's form is a sum: ln(10) for uniform scores.
    let sum = RfMemParams {
        entropy: EntropyMode::Sum,
        tau: 1.0,
        ..p
    };
    let (path, rule, probe) = gate(&flat, &sum);
    assert!((probe.entropy - 10f32.ln()).abs() < 1e-5);
    assert_eq!((path, rule), (Path::Recollection, Rule::HighEntropy));
    // Nothing probed: recollection (the official code's "no_hits").
    assert_eq!(gate(&[], &p).1, Rule::NoHits);
}

#[test]
fn the_gate_matches_a_hand_computed_entropy() {
    // softmax(30 · [0.4, 0.3]) = [1, e^-3] / (1 + e^-3).
    let p = RfMemParams {
        entropy: EntropyMode::Sum,
        ..params()
    };
    let (_, _, probe) = gate(&[0.3, 0.4], &p);
    let a = 1.0 / (1.0 + (-3.0f32).exp());
    let b = 1.0 - a;
    let h = -(a * a.ln() + b * b.ln());
    assert!((probe.entropy - h).abs() < 1e-5, "{} vs {h}", probe.entropy);
    let mean = RfMemParams {
        entropy: EntropyMode::Mean,
        ..p
    };
    assert!((gate(&[0.3, 0.4], &mean).2.entropy - h / 2.0).abs() < 1e-5);
}

fn random_store(n: usize, dim: usize, seed: u64, threads: usize) -> (VectorStore, Vec<f32>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    // A few topics, rows scattered around them.
    let topics: Vec<Vec<f32>> = (0..6)
        .map(|_| (0..dim).map(|_| rng.random_range(-1.0..1.0)).collect())
        .collect();
    let mut rows = Vec::with_capacity(n * dim);
    for i in 0..n {
        let t = &topics[i % topics.len()];
        rows.extend(t.iter().map(|v| v + rng.random_range(-0.6..0.6)));
    }
    let corpus = Corpus::from_vec(rows.clone(), dim).unwrap();
    let kernel = CpuKernel {
        threads,
        block_rows: 64,
        ..CpuKernel::default()
    };
    (VectorStore::flat(corpus, kernel), rows)
}

#[test]
fn recollection_is_deterministic_and_well_formed() {
    let (store, rows) = random_store(600, 16, 7, 2);
    let (other, _) = random_store(600, 16, 7, 1);
    let p = RfMemParams {
        mode: Mode::Recollection,
        k: 20,
        ..params()
    };
    let mut short = 0;
    for q in rows.chunks(16).step_by(97) {
        // Without the top-up (the official behaviour) the beam can run dry.
        let unfilled = retrieve(&store, q, &RfMemParams { fill: false, ..p }).unwrap();
        assert!(unfilled.hits.len() <= 20 && unfilled.filled == 0);
        short += usize::from(unfilled.hits.len() < 20);
        let a = retrieve(&store, q, &p).unwrap();
        let b = retrieve(&store, q, &p).unwrap();
        let c = retrieve(&other, q, &p).unwrap();
        assert_eq!(a.hits, b.hits);
        assert_eq!(a.hits, c.hits, "thread count changed the answer");
        assert_eq!(a.path, Path::Recollection);
        assert_eq!(a.rule, Rule::Forced);
        assert!(a.rounds >= 1);
        assert_eq!(a.hits.len(), 20);
        let mut ids: Vec<u32> = a.hits.iter().map(|h| h.index).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 20, "duplicates");
        let mut qn = q.to_vec();
        normalize(&mut qn);
        for h in &a.hits {
            let s = dot(&qn, &store.vector(h.index as usize));
            assert!((s - h.score).abs() < 1e-4);
        }
        // Rounds are non-decreasing in discovery order; the top-up follows
        // the rows recollection found, in their order.
        assert!(a.hits.windows(2).all(|w| w[0].round <= w[1].round));
        let found = a.hits.len() - a.filled;
        assert_eq!(&a.hits[..found], &unfilled.hits[..]);
        // Re-sorted order: same rows, by score.
        let s = retrieve(
            &store,
            q,
            &RfMemParams {
                order: Order::Score,
                ..p
            },
        )
        .unwrap();
        let mut by_score = a.hits.clone();
        by_score.sort_by(|x, y| y.score.total_cmp(&x.score).then(x.index.cmp(&y.index)));
        assert_eq!(s.hits, by_score);
    }
    assert!(
        short > 0,
        "every recollection found k rows: the top-up went untested"
    );
}

#[test]
fn recollection_respects_the_candidate_budget_and_depth() {
    let (store, rows) = random_store(400, 16, 11, 1);
    let q = &rows[..16];
    let tight = RfMemParams {
        mode: Mode::Recollection,
        k: 200,
        max_candidates: 30,
        fill: false,
        ..params()
    };
    let a = retrieve(&store, q, &tight).unwrap();
    assert!(a.candidates <= 30, "{}", a.candidates);
    let shallow = RfMemParams {
        mode: Mode::Recollection,
        k: 200,
        depth: 2,
        fill: false,
        ..params()
    };
    let b = retrieve(&store, q, &shallow).unwrap();
    assert!(b.rounds <= 2);
    assert!(b.hits.iter().all(|h| h.round < 2));
}

#[test]
fn a_stop_check_ends_recollection_with_what_it_has() {
    use std::cell::Cell;
    let (store, rows) = random_store(400, 16, 11, 1);
    let q = &rows[..16];
    let p = RfMemParams {
        mode: Mode::Recollection,
        k: 200,
        max_candidates: 10_000,
        ..params()
    };
    let full = retrieve(&store, q, &p).unwrap();
    assert!(!full.truncated && full.rounds > 3, "{}", full.rounds);
    // The first round is not asked; stop at the third question (before the
    // fourth round): rounds 0, 1 and 2 run.
    let asked = Cell::new(0);
    let stop = || {
        asked.set(asked.get() + 1);
        asked.get() > 2
    };
    let ab = RfMemParams { beam: 1, ..p };
    let one_branch = retrieve(&store, q, &ab).unwrap();
    assert!(one_branch.rounds > 3, "{}", one_branch.rounds);
    let a = retrieve_until(&store, q, &ab, &stop).unwrap();
    assert!(a.truncated);
    assert_eq!(a.rounds, 3);
    assert!(a.hits.iter().all(|h| h.round < 3));
    // The rows found are the full run's prefix; the top-up comes only
    // from the probe (none here: forced recollection probes nothing).
    assert_eq!(&a.hits[..], &one_branch.hits[..a.hits.len()]);
    assert!(a.candidates < one_branch.candidates);
    // Stopped at once: the first round still runs (the probe's prefix here),
    // and the probe's other rows top it up (adaptive mode).
    let adaptive = RfMemParams {
        mode: Mode::Adaptive,
        theta_low: 0.99,
        theta_high: 0.99,
        ..p
    };
    let b = retrieve_until(&store, q, &adaptive, &|| true).unwrap();
    assert_eq!(b.path, Path::Recollection);
    assert!(b.truncated && b.rounds == 1);
    assert_eq!(b.hits.len(), adaptive.probe_k);
    assert_eq!(b.filled, adaptive.probe_k - adaptive.beam);
    // Forced recollection probes nothing: the first round is the answer.
    let c = retrieve_until(&store, q, &p, &|| true).unwrap();
    assert!(
        c.truncated && c.rounds == 1 && c.hits.len() == p.beam,
        "{c:?}"
    );
}

#[test]
fn recollection_reaches_beyond_the_nearest_rows() {
    // Two clusters: A right around the query, B further out. The query's
    // top-4 are all in A; recollection (α-mixing towards B's centroid once a
    // B row is a candidate) must still return rows of both.
    let dim = 4;
    let mut rows = Vec::new();
    for i in 0..4 {
        rows.extend([1.0, 0.05 * i as f32, 0.0, 0.0]);
    }
    for i in 0..8 {
        rows.extend([0.6, 0.8, 0.05 * i as f32, 0.0]);
    }
    let store = VectorStore::flat(Corpus::from_vec(rows, dim).unwrap(), CpuKernel::default());
    let q = [1.0, 0.1, 0.0, 0.0];
    let fam = retrieve(
        &store,
        &q,
        &RfMemParams {
            mode: Mode::Familiarity,
            k: 6,
            ..params()
        },
    )
    .unwrap();
    let rec = retrieve(
        &store,
        &q,
        &RfMemParams {
            mode: Mode::Recollection,
            k: 6,
            ..params()
        },
    )
    .unwrap();
    assert_eq!(rec.hits.len(), 6);
    let from_b = |a: &Answer| a.hits.iter().filter(|h| h.index >= 4).count();
    assert!(from_b(&rec) >= 2, "{:?}", rec.hits);
    assert_eq!(from_b(&fam), 2);
}

#[test]
fn familiarity_is_the_exact_top_k_above_the_floor() {
    let (store, rows) = random_store(300, 8, 3, 2);
    let q = &rows[8..16];
    let p = RfMemParams {
        mode: Mode::Familiarity,
        k: 15,
        min_score: 0.2,
        ..params()
    };
    let a = retrieve(&store, q, &p).unwrap();
    let exact = store.search(q, 15, 0.2).unwrap().remove(0);
    assert_eq!(a.hits.len(), exact.len());
    for (f, h) in a.hits.iter().zip(&exact) {
        assert_eq!((f.index, f.round), (h.index, 0));
        assert!((f.score - h.score).abs() < 1e-6);
    }
    // Adaptive with k ≤ probe_k reuses the probe: one search in total.
    let adaptive = retrieve(
        &store,
        q,
        &RfMemParams {
            mode: Mode::Adaptive,
            theta_high: -1.0,
            theta_low: -1.0,
            k: 5,
            ..params()
        },
    )
    .unwrap();
    assert_eq!(adaptive.path, Path::Familiarity);
    assert_eq!(adaptive.rule, Rule::MeanHigh);
    assert_eq!(adaptive.candidates, 10);
    assert_eq!(adaptive.hits.len(), 5);
}

#[test]
fn the_ivf_store_with_every_list_probed_is_exact() {
    let (flat, rows) = random_store(500, 8, 5, 2);
    let corpus = Corpus::from_vec(rows.clone(), 8).unwrap();
    let ivf = VectorStore::ivf(
        corpus,
        &IvfParams {
            lists: 8,
            probes: 8,
            ..IvfParams::default()
        },
        CpuKernel::default(),
    )
    .unwrap();
    assert!(ivf.is_approximate());
    let p = RfMemParams {
        mode: Mode::Recollection,
        ..params()
    };
    for q in rows.chunks(8).step_by(50) {
        let ids = |s: &VectorStore| -> Vec<u32> {
            retrieve(s, q, &p)
                .unwrap()
                .hits
                .iter()
                .map(|h| h.index)
                .collect()
        };
        assert_eq!(ids(&flat), ids(&ivf));
    }
}

/// The int8 store (the service's exact scan from 8,192 rows on a VNNI CPU)
/// answers RF-Mem with the exact store's rows and exact scores on
/// clustered rows, and counts its int8 copy.
#[test]
fn the_int8_store_answers_as_the_exact_one() {
    let Ok(mut kernel) = QuantKernel::new(4) else {
        eprintln!("int8 store: no AVX-512 VNNI on this machine, not run");
        return;
    };
    kernel.threads = 1;
    let dim = 64;
    let (flat, rows) = random_store(9_000, dim, 11, 1);
    let int8 = VectorStore::flat_int8(Corpus::from_vec(rows.clone(), dim).unwrap(), kernel);
    assert!(int8.is_int8() && !flat.is_int8());
    assert_eq!(flat.extra_bytes(), 0);
    // The int8 codes: about a quarter of the f32 rows, built up front.
    assert!(int8.extra_bytes() >= 9_000 * dim, "{}", int8.extra_bytes());
    let mut rng = SmallRng::seed_from_u64(12);
    for (i, q) in rows.chunks(dim).step_by(450).enumerate() {
        // Half near a row, half off every topic.
        let q: Vec<f32> = if i % 2 == 0 {
            q.iter()
                .map(|v| v + rng.random_range(-0.05..0.05))
                .collect()
        } else {
            (0..dim).map(|_| rng.random_range(-1.0..1.0)).collect()
        };
        for mode in [Mode::Familiarity, Mode::Recollection, Mode::Adaptive] {
            let p = RfMemParams { mode, ..params() };
            let (a, b) = (
                retrieve(&flat, &q, &p).unwrap(),
                retrieve(&int8, &q, &p).unwrap(),
            );
            assert_eq!(a.hits, b.hits, "query {i}, {mode:?}");
        }
    }
}

#[test]
fn bad_queries_and_options_name_their_field() {
    let (store, _) = random_store(10, 4, 1, 1);
    let err = |q: &[f32], p: &RfMemParams| retrieve(&store, q, p).unwrap_err().to_string();
    assert!(err(&[1.0, 2.0], &params()).starts_with("query_vector: has 2 values"));
    assert!(err(&[1.0, f32::NAN, 0.0, 0.0], &params()).starts_with("query_vector: value 1"));
    assert!(err(&[0.0; 4], &params()).starts_with("query_vector: is all zeros"));
    let q = [1.0, 0.0, 0.0, 0.0];
    assert!(
        err(
            &q,
            &RfMemParams {
                alpha: 1.5,
                ..params()
            }
        )
        .starts_with("options.alpha")
    );
    assert!(err(&q, &RfMemParams { k: 0, ..params() }).starts_with("options.k:"));
    assert!(
        err(
            &q,
            &RfMemParams {
                lambda: f32::NAN,
                ..params()
            }
        )
        .starts_with("options.lambda")
    );
    assert!(
        err(
            &q,
            &RfMemParams {
                theta_low: 0.9,
                ..params()
            }
        )
        .starts_with("options.theta_low")
    );
    // An empty store answers nothing, without error.
    let empty = VectorStore::flat(Corpus::new(4), CpuKernel::default());
    let a = retrieve(&empty, &q, &params()).unwrap();
    assert!(a.hits.is_empty());
    assert_eq!(a.rule, Rule::NoHits);
}
