use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;

use super::*;
use crate::lexical::Bm25Params;
use crate::rfmem::Mode;

pub(super) fn store(rows: &[[f32; 4]]) -> VectorStore {
    let mut flat = Vec::new();
    for r in rows {
        let mut v = r.to_vec();
        normalize(&mut v);
        flat.extend(v);
    }
    VectorStore::flat(Corpus::from_vec(flat, 4).unwrap(), CpuKernel::default())
}

#[test]
fn each_turn_ends_one_window() {
    let w = |turns| WindowParams { turns };
    assert_eq!(windows(4, &w(2)), vec![0..1, 0..2, 1..3, 2..4]);
    assert_eq!(windows(3, &w(3)), vec![0..1, 0..2, 0..3]);
    assert_eq!(windows(2, &w(1)), vec![0..1, 1..2]);
    assert!(windows(0, &w(2)).is_empty());
    assert!(windows(4, &w(0)).is_empty());
}

#[test]
fn headers_name_who_and_the_utc_day() {
    assert_eq!(utc_day(0), "1970-01-01");
    assert_eq!(utc_day(1_728_897_240_000), "2024-10-14");
    assert_eq!(utc_day(951_782_400_000), "2000-02-29");
    assert_eq!(utc_day(-86_400_000), "1969-12-31");
    assert_eq!(
        header("Conversation", "Samuel Mills", &utc_day(1_728_897_240_000)),
        "Conversation with Samuel Mills on 2024-10-14"
    );
    assert_eq!(header("Session", "", ""), "Session");
    assert_eq!(
        render("Session on 2024-10-14", &["user: hi", "assistant: hello"]),
        "Session on 2024-10-14:\nuser: hi\nassistant: hello"
    );
}

/// Three rows. Row 0's whole vector points away from the query but one of
/// its windows matches it; row 1 is mildly similar as a whole; row 2 only
/// shares a rare word with the query.
fn index(lexical: bool) -> PassageIndex {
    let rows = store(&[
        [0.2, 1.0, 0.0, 0.0],
        [0.6, 0.8, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
    ]);
    let windows = store(&[
        [0.0, 1.0, 0.0, 0.0],
        [1.0, 0.05, 0.0, 0.0],
        [0.6, 0.8, 0.0, 0.0],
        [0.0, 0.0, 1.0, 0.0],
    ]);
    let lex = lexical.then(|| {
        Bm25Index::new(
            [
                "about the weather",
                "about the weather again",
                "Coltrane Blue Train",
            ],
            Bm25Params::default(),
        )
    });
    PassageIndex::new(rows, windows, vec![0, 0, 1, 2], lex).unwrap()
}

fn ix_lexical_ceiling(q: &str) -> f32 {
    Bm25Index::new(
        [
            "about the weather",
            "about the weather again",
            "Coltrane Blue Train",
        ],
        Bm25Params::default(),
    )
    .max_score(q)
}

fn familiarity(k: usize) -> RfMemParams {
    RfMemParams {
        mode: Mode::Familiarity,
        k,
        ..RfMemParams::default()
    }
}

#[test]
fn a_row_is_found_by_its_best_window_and_returned_once() {
    let ix = index(false);
    let q = [1.0, 0.0, 0.0, 0.0];
    let h = HybridParams {
        mix: 1.0,
        lexical_weight: 0.0,
        ..HybridParams::default()
    };
    let a = retrieve_until(&ix, &q, None, &familiarity(3), &h, &|| false).unwrap();
    let rows: Vec<u32> = a.hits.iter().map(|r| r.row).collect();
    assert_eq!(rows, [0, 1, 2], "{a:?}");
    assert_eq!(a.hits[0].passage, Some(1), "the matching window is named");
    assert!((a.hits[0].dense - 1.0 / 1.0025f32.sqrt()).abs() < 1e-4);
    // Whole rows only (mix 0): row 1 wins, row 0's second half is invisible.
    let whole = HybridParams { mix: 0.0, ..h };
    let a = retrieve_until(&ix, &q, None, &familiarity(3), &whole, &|| false).unwrap();
    assert_eq!(a.hits[0].row, 1);
    // The mix is linear in the two cosines.
    let half = HybridParams { mix: 0.5, ..h };
    let a = retrieve_until(&ix, &q, None, &familiarity(3), &half, &|| false).unwrap();
    let w = 1.0 / 1.0025f32.sqrt();
    let r = 0.2 / 1.04f32.sqrt();
    let row0 = a.hits.iter().find(|h| h.row == 0).unwrap();
    assert!((row0.dense - (0.5 * w + 0.5 * r)).abs() < 1e-4, "{a:?}");
}

#[test]
fn the_lexical_side_adds_rows_the_dense_side_misses() {
    let ix = index(true);
    let q = [1.0, 0.0, 0.0, 0.0];
    let dense_only = HybridParams {
        lexical_weight: 0.0,
        ..HybridParams::default()
    };
    let a = retrieve_until(
        &ix,
        &q,
        Some("blue train"),
        &familiarity(2),
        &dense_only,
        &|| false,
    )
    .unwrap();
    assert!(a.hits.iter().all(|r| r.row != 2), "{a:?}");
    // One window per row asked for: only rows 0 and 1 are dense candidates.
    let hybrid = HybridParams {
        lexical_weight: 2.0,
        expand: 1,
        ..HybridParams::default()
    };
    let a = retrieve_until(
        &ix,
        &q,
        Some("blue train"),
        &familiarity(2),
        &hybrid,
        &|| false,
    )
    .unwrap();
    assert_eq!(a.hits[0].row, 2, "{a:?}");
    let ceiling = ix_lexical_ceiling("blue train");
    assert!(
        a.hits[0].lexical > 0.4 && a.hits[0].lexical < 1.0,
        "{a:?} {ceiling}"
    );
    assert_eq!(a.lexical_only, 1);
    // Without query text, or without a lexical index, the dense ranking.
    let a = retrieve_until(&ix, &q, None, &familiarity(2), &hybrid, &|| false).unwrap();
    assert!(a.hits.iter().all(|r| r.row != 2));
    let a = retrieve_until(
        &index(false),
        &q,
        Some("blue train"),
        &familiarity(2),
        &hybrid,
        &|| false,
    )
    .unwrap();
    assert!(a.hits.iter().all(|r| r.row != 2));
}

#[test]
fn every_path_returns_distinct_rows_best_first() {
    let ix = index(true);
    for mode in [Mode::Familiarity, Mode::Recollection, Mode::Adaptive] {
        let p = RfMemParams {
            mode,
            k: 3,
            ..RfMemParams::default()
        };
        let a = retrieve_until(
            &ix,
            &[0.5, 0.5, 0.1, 0.0],
            Some("weather"),
            &p,
            &HybridParams::default(),
            &|| false,
        )
        .unwrap();
        let mut rows: Vec<u32> = a.hits.iter().map(|r| r.row).collect();
        assert!(a.hits.windows(2).all(|w| w[0].score >= w[1].score), "{a:?}");
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), a.hits.len(), "{mode:?}: {a:?}");
        assert!(a.hits.len() <= 3);
    }
}

#[test]
fn bad_parameters_and_mismatched_parts_are_refused() {
    let ix = index(true);
    let q = [1.0, 0.0, 0.0, 0.0];
    for (h, field) in [
        (
            HybridParams {
                mix: 1.5,
                ..HybridParams::default()
            },
            "hybrid.mix",
        ),
        (
            HybridParams {
                lexical_weight: f32::NAN,
                ..HybridParams::default()
            },
            "hybrid.lexical_weight",
        ),
        (
            HybridParams {
                expand: 0,
                ..HybridParams::default()
            },
            "hybrid.expand",
        ),
    ] {
        let e = retrieve_until(&ix, &q, None, &familiarity(2), &h, &|| false).unwrap_err();
        assert!(
            matches!(e, Error::Invalid { field: f, .. } if f == field),
            "{e}"
        );
    }
    let e = retrieve_until(
        &ix,
        &[0.0; 4],
        None,
        &familiarity(2),
        &HybridParams::default(),
        &|| false,
    )
    .unwrap_err();
    assert!(matches!(
        e,
        Error::Invalid {
            field: "query_vector",
            ..
        }
    ));
    let rows = || store(&[[1.0, 0.0, 0.0, 0.0]]);
    let one = || store(&[[1.0, 0.0, 0.0, 0.0]]);
    assert!(
        PassageIndex::new(rows(), one(), vec![], None).is_err(),
        "owner count"
    );
    assert!(
        PassageIndex::new(rows(), one(), vec![1], None).is_err(),
        "unknown row"
    );
    let two = store(&[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]);
    let rows2 = store(&[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]);
    assert!(
        PassageIndex::new(rows2, two, vec![1, 0], None).is_err(),
        "grouped"
    );
    let lex = Bm25Index::new(["a", "b"], Bm25Params::default());
    assert!(
        PassageIndex::new(rows(), one(), vec![0], Some(lex)).is_err(),
        "lexical rows"
    );
    let two_rows = || store(&[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]);
    let e = PassageIndex::new(two_rows(), one(), vec![0], None).unwrap_err();
    assert!(e.to_string().contains("row 1 has no window"), "{e}");
    assert!(
        PassageIndex::new(two_rows(), store(&[]), vec![], None).is_ok(),
        "no windows at all: rows are searched whole"
    );
}
