//! The evaluation harness end to end, on small fixtures the test writes
//! (never ../shared/data): the real binary and the real MiniLM model.

use std::fmt::Write as _;
use std::path::Path;

use rand::{Rng, SeedableRng};

use crate::support::*;

const GENRES: [&str; 4] = ["Action", "Comedy", "Drama", "Horror"];

/// A MovieLens-100K-shaped directory (`u.genre`, `u.item`, `u.data`): 400
/// movies in 4 genres with a popularity skew, and 250 users who each rate
/// 30 movies, nine in ten from the user's own genre.
fn write_movielens(dir: &Path) {
    let mut genre = String::from("unknown|0\n");
    for (i, g) in GENRES.iter().enumerate() {
        writeln!(genre, "{g}|{}", i + 1).unwrap();
    }
    std::fs::write(dir.join("u.genre"), genre).unwrap();
    let mut items = String::new();
    for id in 1..=400u32 {
        let g = (id % 4) as usize;
        let flags: Vec<&str> = (0..=GENRES.len())
            .map(|k| if k == g + 1 { "1" } else { "0" })
            .collect();
        writeln!(
            items,
            "{id}|{} story {id} (1995)|01-Jan-1995||http://example.org/{id}|{}",
            GENRES[g],
            flags.join("|")
        )
        .unwrap();
    }
    std::fs::write(dir.join("u.item"), items).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let mut data = String::new();
    for u in 1..=250u32 {
        let own = u % 4;
        let mut seen = std::collections::HashSet::new();
        let mut t = 880_000_000u64 + u64::from(u) * 10_000;
        while seen.len() < 30 {
            let g = if rng.random_bool(0.9) {
                own
            } else {
                rng.random_range(0..4)
            };
            // Low ids within a genre are the popular ones.
            let rank = (rng.random::<f64>().powi(2) * 100.0) as u32;
            let item = rank * 4 + g;
            let item = if item == 0 { 4 } else { item };
            if seen.insert(item) {
                t += 60;
                writeln!(data, "{u}\t{item}\t4\t{t}").unwrap();
            }
        }
    }
    std::fs::write(dir.join("u.data"), data).unwrap();
}

/// A temporary directory holding [`write_movielens`]'s fixture in `ml/`.
fn movielens_fixture() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("ml");
    std::fs::create_dir(&data).unwrap();
    write_movielens(&data);
    (dir, data)
}

/// `steamrf eval steam --subset ml100k-catalogue --seeds 1` on the fixture
/// in `data`, with `extra` arguments: its output and `RESULT` values.
fn eval_steam_on_fixture(
    data: &Path,
    out: &Path,
    extra: &[&str],
) -> (String, std::collections::HashMap<String, f64>) {
    let mut args = vec![
        "eval",
        "steam",
        "--subset",
        "ml100k-catalogue",
        "--seeds",
        "1",
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    steamrf_result(args)
}

/// `steamrf eval steam --task simulation` runs the AFL protocol on a small
/// MovieLens-shaped fixture: every method learns, the fused agent is fitted
/// on the calibration users, and the RESULT line carries each ratio's F1
/// with its interval and the paired difference to the best baseline.
#[test]
fn eval_steam_simulation_reports_f1_with_intervals_on_a_small_fixture() {
    let (dir, data) = movielens_fixture();
    let out_dir = dir.path().join("results");
    let (text, r) = eval_steam_on_fixture(&data, &out_dir, &["--task", "simulation"]);
    for m in [1, 3, 9] {
        let f1 = r[&format!("f1_1_{m}")];
        let (lo, hi) = (
            r[&format!("f1_1_{m}_ci95_low")],
            r[&format!("f1_1_{m}_ci95_high")],
        );
        assert!(
            lo <= f1 && f1 <= hi && 0.0 < lo && hi <= 1.0,
            "1:{m}: {text}"
        );
        let d = r[&format!("delta_f1_1_{m}")];
        assert!(
            r[&format!("delta_f1_1_{m}_ci95_low")] <= d
                && d <= r[&format!("delta_f1_1_{m}_ci95_high")],
            "1:{m}: {text}"
        );
        assert!((0.0..=1.0).contains(&r[&format!("steam_f1_1_{m}")]));
    }
    // Genre is all there is to learn here: the fused agent must beat
    // saying yes to everything (F1 2/3 at 1:1, 0.4 at 1:3).
    assert!(r["f1_1_1"] > 0.7 && r["f1_1_3"] > 0.45, "{text}");
    let table =
        std::fs::read_to_string(out_dir.join("steam-simulation-ml100k-catalogue.md")).unwrap();
    for row in [
        "steamrf (STEAM)",
        "fused w/o STEAM",
        "popularity, z over the slate",
        "steamrf fused, z over the slate",
        "fused − fused z over the slate",
    ] {
        assert!(table.contains(row), "{row}: {table}");
    }
    // The whole catalogue is embedded, whatever users the seed draws (every
    // other user's history is learnt from whole).
    assert!(text.contains("(400 items embedded"), "{text}");
}

/// `steamrf eval steam --fit-only` scores the validation split alone and
/// says so (`split=valid`); the fused fit searches a superset of the fit
/// without STEAM, so it is never below it. On the fixture, where a user's
/// genre and the popular movies in it are all there is to learn, the votes
/// of the users most like this one (neighbours(c), δ = 10 by default) rank
/// better than the paper's score (δ = 0), which sees the genre only. The
/// run embeds the whole catalogue, so BM25's index and the geometry do not
/// depend on the seeds.
#[test]
fn eval_steam_fit_only_scores_the_validation_split_and_the_neighbours_term_helps() {
    let (dir, data) = movielens_fixture();
    let out_dir = dir.path().join("results");
    let run = |extra: &[&str]| {
        let mut args = vec!["--fit-only"];
        args.extend_from_slice(extra);
        eval_steam_on_fixture(&data, &out_dir, &args)
    };
    let (text, with) = run(&[]);
    assert!(text.contains("split=valid"), "{text}");
    assert!(text.contains(", 400 items embedded"), "{text}");
    assert!(!text.contains("| method |"), "no test table: {text}");
    for k in ["steam_ndcg10", "fused_ndcg10", "fused_no_steam_ndcg10"] {
        assert!(with[k] > 0.0 && with[k] <= 1.0, "{k}: {text}");
    }
    assert!(
        with["fused_ndcg10"] >= with["fused_no_steam_ndcg10"],
        "{text}"
    );
    assert_eq!(
        (with["neighbour_weight"], with["k_neighbours"]),
        (10.0, 20.0)
    );
    let (text0, without) = run(&["--neighbour-weight", "0"]);
    assert_eq!(without["neighbour_weight"], 0.0, "{text0}");
    assert!(
        with["steam_ndcg10"] > without["steam_ndcg10"],
        "δ = 10: {text}\nδ = 0: {text0}"
    );
}

/// A LoCoMo-shaped file: two conversations of three sessions of 12 turns
/// (filler about the weather and work), one fact per conversation planted in
/// one turn, a question for each, and an adversarial (category 5) question
/// the protocol leaves out.
fn write_locomo(path: &Path) {
    let mut convs = Vec::new();
    for (c, (name, fact, question)) in [
        (
            "Melanie",
            "Melanie: I finally visited Zanzibar last week, the spice market was amazing",
            "When did Melanie visit Zanzibar?",
        ),
        (
            "Caroline",
            "Caroline: I started learning the bassoon at the community orchestra",
            "Which instrument is Caroline learning?",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let mut conv = serde_json::Map::new();
        conv.insert("speaker_a".into(), name.into());
        conv.insert("speaker_b".into(), "Jon".into());
        let mut evidence = String::new();
        for s in 1..=3 {
            conv.insert(
                format!("session_{s}_date_time"),
                format!("{s}:15 pm on {} May, 2023", 2 + s).into(),
            );
            let turns: Vec<serde_json::Value> = (1..=12)
                .map(|t| {
                    let dia = format!("D{s}:{t}");
                    let text = if s == 2 && t == 7 {
                        evidence.clone_from(&dia);
                        fact.splitn(2, ": ").nth(1).unwrap().to_owned()
                    } else if t % 2 == 1 {
                        format!("The weather was grey again on day {t}, and work was busy.")
                    } else {
                        format!("Same here, meetings all day {t}; the rain never stops.")
                    };
                    let speaker = if t % 2 == 1 { name } else { "Jon" };
                    serde_json::json!({"speaker": speaker, "dia_id": dia, "text": text})
                })
                .collect();
            conv.insert(format!("session_{s}"), turns.into());
        }
        convs.push(serde_json::json!({
            "sample_id": format!("conv-{c}"),
            "conversation": conv,
            "qa": [
                {"question": question, "answer": "x", "evidence": [evidence], "category": 4},
                {"question": "What did Jon say about Mars?", "adversarial_answer": "x", "category": 5}
            ]
        }));
    }
    std::fs::write(path, serde_json::to_string(&convs).unwrap()).unwrap();
}

/// `steamrf eval locomo` end to end on a fixture: events through the real
/// broker, the pipeline and the service; the protocol's counting (category
/// 5 left out, answers cut at the turn budget); the planted facts found
/// within 10 turns by both steamrf and the BM25 baseline.
#[test]
fn eval_locomo_scores_the_turns_the_service_hands_over() {
    let dir = tempfile::tempdir().unwrap();
    write_locomo(&dir.path().join("locomo-test.json"));
    let config = dir.path().join("eval.toml");
    std::fs::write(
        &config,
        format!(
            "[kafka]\nbrokers = \"{}\"\n[embed]\nmodel_dir = {:?}\nsparse_model_dir = {:?}\n",
            brokers(),
            model_dir().display().to_string(),
            sparse_model_dir().display().to_string()
        ),
    )
    .unwrap();
    let (text, r) = steamrf_result([
        "eval".as_ref(),
        "locomo".as_ref(),
        "--data".as_ref(),
        dir.path().as_os_str(),
        "--split".as_ref(),
        "test".as_ref(),
        "--config".as_ref(),
        config.as_os_str(),
    ]);
    assert!(text.contains("RESULT split=test "), "{text}");
    assert_eq!(r["questions"], 2.0, "category 5 is left out: {text}");
    // 36 turns per conversation, more than an answer may hold.
    assert!(
        r["turns_per_answer"] > 10.0 && r["turns_per_answer"] <= 30.0,
        "{text}"
    );
    assert_eq!(r["bm25w_r5"], 1.0, "{text}");
    // The planted turn comes first, not after the rest of its session.
    assert_eq!(r["r5"], 1.0, "{text}");
    assert_eq!(r["r30"], 1.0, "{text}");
    assert!(r["p50_ms"] > 0.0, "{text}");
}
