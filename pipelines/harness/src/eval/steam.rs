//! `steamrf eval steam --data DIR --subset dense|sparse`: the STEAM ranking
//! protocol on the AgentCF Amazon CDs samples (100 users, 8 chronological
//! interactions each; ../shared/data/README.md).
//!
//! For each user the first 7 interactions are the history and the 8th the
//! target; candidates come from the `.random` file (drop the target and the
//! user's history items, take the first 9, make up any shortfall with unseen
//! items of the sample's pool drawn with a per-user seed, append the target,
//! shuffle with the seed).
//! Items are `The CD is called '{title}'. The category of this CD is:
//! '{category}'.`, embedded by all-MiniLM-L6-v2.
//!
//! steamrf runs through its operators: every history becomes item and click
//! events, decoded by the schemas crate, observed by the STEAM state in
//! event-time order (formation and consolidation), linked across users
//! (relation extraction on the CPU kernel, communities, prototypes), and the
//! candidates ranked by `recommend`. Ablations: w/o CC (no collaborative
//! terms), w/o MC (no consolidation), w/o AMU (one memory per user).
//! Baselines in the same run: random, popularity, item-item CF, BM25 over the
//! item texts. NDCG@1/5/10: the mean over users and its 95% confidence
//! interval (percentile bootstrap over users), and steamrf's paired
//! difference to the best baseline at each cutoff.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use steamrf_kernels::RowPrecision;

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use steamrf_operators::fuse::Fit;
use steamrf_operators::rank::{self, ItemText, Weights};
use steamrf_operators::steam::SteamParams;
use steamrf_operators::steam::retrieve::RecommendParams;
use steamrf_pipelines::error::{Error, Result};

use super::SteamEval;
use super::datasets::{
    Items, ML_TEMPLATE, Sample, User, bad, cds_catalogue, embed_items, ml_items, ml_sample,
    ml_valid_sample, movielens, paper_sample, users_of_split,
};
use super::recommenders::{
    FUSED_FEATURES, Fitted, USER_KNN, feature_rows, features_of, fit_fused, item_cf, item_text,
    rankers, recommend_params, score_all, steam_states, user_knn,
};

fn ndcg_at(rank: usize, k: usize) -> f64 {
    if rank < k {
        1.0 / ((rank + 2) as f64).log2()
    } else {
        0.0
    }
}

/// Values in the order of [`FUSED_FEATURES`], each after its signal's name.
fn named(values: &[f64], decimals: usize) -> String {
    FUSED_FEATURES
        .iter()
        .zip(values)
        .map(|(f, x)| format!("{f} {x:.decimals$}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Per method (name, per user [NDCG@1, @5, @10] in the sample's user
/// order), and the memory counts (full, w/o MC, w/o AMU, published
/// prototypes).
type Evaluated = (
    Vec<(&'static str, Vec<[f64; 3]>)>,
    (usize, usize, usize, usize),
);

/// The fused ranker's row name.
const FUSED: &str = "steamrf fused (STEAM + CF + BM25 + popularity, fit on valid)";

/// The same fit without STEAM: what STEAM's share is worth.
const FUSED_NO_STEAM: &str = "fused w/o STEAM (CF + BM25 + popularity, fit on valid)";

/// Writes `fit`'s weights as a config file holding only `[serve.ranker]`,
/// with a comment saying where they come from.
fn write_weights(path: &Path, e: &SteamEval, fit: &Fit) -> Result<()> {
    let w = Weights::from_slice(&fit.weights);
    let body = format!(
        "# The fused ranker's weights, fitted by `steamrf eval steam --data {} --subset {}` on its\n\
         # validation split (never the test targets): validation NDCG@10 {:.4}.\n\
         # `steamrf serve -c {}` ranks /v1/recommend with them (docs/retrieval.md).\n\
         [serve.ranker]\nsteam = {:?}\nitem_cf = {:?}\nbm25 = {:?}\npopularity = {:?}\n",
        e.data.display(),
        e.subset,
        fit.ndcg10,
        path.display(),
        w.steam,
        w.item_cf,
        w.bm25,
        w.popularity,
    );
    std::fs::write(path, body).map_err(|source| Error::Io {
        context: format!("writing {}", path.display()),
        source,
    })
}

/// Every method on one sample; with `fused` weights also the fused ranker
/// and its fit without STEAM.
fn evaluate(
    sample: &Sample,
    items: &Items,
    text: &ItemText,
    seed: u64,
    fused: Option<&Fitted>,
    (tau, precision, rec): (Option<f32>, RowPrecision, RecommendParams),
) -> Result<Evaluated> {
    let users = &sample.users;
    // STEAM learns from the same interactions as the baselines: the test
    // users' histories and every other user's.
    let learners: Vec<User> = users.iter().chain(&sample.others).cloned().collect();
    let states = steam_states(&learners, items, (tau, precision))?;
    let cf = item_cf(&sample.train);
    let knn = user_knn(&sample.train);
    let rankers = rankers(&states, items, (&cf, &knn), text, seed, rec);
    let mut rng = StdRng::seed_from_u64(seed);
    let cands: Vec<Vec<String>> = users
        .iter()
        .map(|u| {
            let mut c = u.negatives.clone();
            c.push(u.target.clone());
            c.shuffle(&mut rng);
            c
        })
        .collect();
    let mut scores = score_all(&rankers, users, &cands);
    let mut names: Vec<&'static str> = rankers.iter().map(|r| r.0).collect();
    if let Some(f) = fused {
        let rows = feature_rows(&names)?;
        for (fit, name) in [(&f.with_steam, FUSED), (&f.without_steam, FUSED_NO_STEAM)] {
            let w = Weights::from_slice(&fit.weights);
            let fused_scores = (0..users.len())
                .map(|u| rank::score(&w, &features_of(&scores, &rows, u)))
                .collect();
            scores.push(fused_scores);
            names.push(name);
        }
    }
    let mut out = Vec::new();
    for (name, by_user) in names.into_iter().zip(scores) {
        let mut per_user = Vec::with_capacity(users.len());
        for ((u, c), s) in users.iter().zip(&cands).zip(by_user) {
            let target = c.iter().position(|i| *i == u.target).unwrap_or(0);
            // Rank: candidates strictly better, then ties before it in the shuffled order.
            let r = (0..c.len())
                .filter(|&j| s[j] > s[target] || (s[j] == s[target] && j < target))
                .count();
            per_user.push([1, 5, 10].map(|k| ndcg_at(r, k)));
        }
        out.push((name, per_user));
    }
    let counts = (
        states[0].len(),
        states[1].len(),
        states[2].len(),
        states[0].prototypes().count(),
    );
    Ok((out, counts))
}

/// The baselines steamrf is compared with: (ranker name, RESULT-line name).
const BASELINES: [(&str, &str); 3] = [
    ("popularity", "popularity"),
    ("item-item CF", "item_cf"),
    ("BM25 (item text)", "bm25"),
];

/// The ranking protocol.
pub(super) async fn ranking(e: SteamEval) -> Result<Vec<String>> {
    let started = Instant::now();
    let mut valid: Option<Sample> = None;
    let (catalogue, samples) = match e.subset.as_str() {
        "dense" | "sparse" | "cds-dense" | "cds-sparse" | "cds-dense-valid"
        | "cds-sparse-valid" => {
            let (sub, split) = match e.subset.trim_start_matches("cds-").split_once('-') {
                Some((sub, _)) => (sub, "valid"),
                None => (e.subset.trim_start_matches("cds-"), "test"),
            };
            let name = format!("CDs-100-user-{sub}");
            let sample_of = |users: Vec<User>| {
                let train: Vec<(String, String)> = users
                    .iter()
                    .flat_map(|u| u.history.iter().map(|h| (u.id.clone(), h.clone())))
                    .collect();
                Sample {
                    users,
                    train,
                    others: Vec::new(),
                }
            };
            let sample = sample_of(users_of_split(&e.data.join(&name), &name, split)?);
            // The test split also gets the fused ranker, fitted on the
            // validation split of the same users.
            if split == "test" {
                valid = Some(sample_of(users_of_split(
                    &e.data.join(&name),
                    &name,
                    "valid",
                )?));
            }
            let samples: Vec<Sample> = e.seeds.iter().map(|_| sample.clone()).collect();
            (cds_catalogue(&e.data)?, samples)
        }
        "ml100k-catalogue" | "ml100k-users" => {
            let (meta, ratings) = movielens(&e.data)?;
            let from_users = e.subset == "ml100k-users";
            let samples = e
                .seeds
                .iter()
                .map(|&seed| ml_sample(&ratings, &meta, seed, from_users))
                .collect();
            // The fused ranker is fitted on the first seed's users'
            // second-to-last ratings.
            let seed = e.seeds.first().copied().unwrap_or(0);
            valid = Some(ml_valid_sample(&ratings, &meta, seed, from_users));
            ((meta, ML_TEMPLATE), samples)
        }
        "ml100k-paper" => {
            let (meta, ratings) = movielens(&e.data)?;
            let samples = e
                .seeds
                .iter()
                .map(|&seed| paper_sample(ml_sample(&ratings, &meta, seed, true)))
                .collect();
            let seed = e.seeds.first().copied().unwrap_or(0);
            valid = Some(paper_sample(ml_valid_sample(&ratings, &meta, seed, true)));
            ((meta, ML_TEMPLATE), samples)
        }
        other => return Err(bad(format!("unknown subset {other:?}"))),
    };
    let mut needed: Vec<String> = Vec::new();
    for s in samples.iter().chain(&valid) {
        for u in &s.users {
            needed.extend(u.negatives.iter().cloned());
            needed.push(u.target.clone());
        }
        for u in s.users.iter().chain(&s.others) {
            needed.extend(u.history.iter().cloned());
        }
    }
    if e.subset.starts_with("ml100k") {
        needed.extend(ml_items(&catalogue));
    }
    let (items, texts, took, tau) = embed_items(&e.embed, &catalogue, needed, &e.geometry).await?;
    let mut out = vec![format!(
        "eval steam: {} ({} users per seed, {} items embedded in {took:.1} s), seeds {:?}",
        e.subset,
        samples.first().map_or(0, |s| s.users.len()),
        items.len(),
        e.seeds
    )];
    out.push(format!("  geometry: {}", e.geometry.describe(tau)));
    let rec = recommend_params(tau, &e.scoring);
    out.push(format!(
        "  recommend: neighbours(c) weight δ = {}, k_n = {}",
        rec.neighbour_weight, rec.k_neighbours
    ));

    let text = item_text(&texts);
    let fitted = match &valid {
        Some(v) => {
            let f = fit_fused(v, &items, &text, (tau, e.index_precision, rec))?;
            let split = if e.subset.starts_with("ml100k") {
                "each predicting its second-to-last rating; the last is held out of all training data"
            } else {
                "7th item from the first 6"
            };
            for (fit, what) in [
                (&f.with_steam, "fused ranker"),
                (&f.without_steam, "fused ranker w/o STEAM"),
            ] {
                out.push(format!(
                    "  {what} fitted on the validation split ({} users, {split}): weights {}; validation NDCG@10 {:.4} ({} grid points)",
                    v.users.len(),
                    named(&fit.weights, 1),
                    fit.ndcg10,
                    fit.tried
                ));
            }
            if let Some(path) = &e.fit_out {
                write_weights(path, &e, &f.with_steam)?;
                out.push(format!(
                    "  fused weights written to {} (`steamrf serve -c` it, or copy its [serve.ranker] section)",
                    path.display()
                ));
            }
            out.push(format!(
                "  each signal alone on the validation split, NDCG@10: {}",
                named(&f.alone, 4)
            ));
            if e.fit_only {
                out.push(format!(
                    "RESULT subset={} split=valid steam_ndcg10={:.4} fused_ndcg10={:.4} fused_no_steam_ndcg10={:.4} neighbour_weight={} k_neighbours={}",
                    e.subset,
                    f.alone[0],
                    f.with_steam.ndcg10,
                    f.without_steam.ndcg10,
                    rec.neighbour_weight,
                    rec.k_neighbours
                ));
                return Ok(out);
            }
            Some(f)
        }
        None => None,
    };
    // Per method: user id → (sum of [NDCG@1, @5, @10] over the seeds, seeds).
    // A user is one unit of the bootstrap: the CDs seeds reshuffle the same
    // users (their ± was only tie-breaking), so a user's NDCG is averaged
    // over the shuffles; the ML seeds draw other users.
    let mut names: Vec<&'static str> = Vec::new();
    let mut per_user: Vec<BTreeMap<String, ([f64; 3], usize)>> = Vec::new();
    let mut memories = (0, 0, 0, 0);
    let bar = super::progress(samples.len(), "seeds");
    for (sample, &seed) in samples.iter().zip(&e.seeds) {
        let (rows, m) = evaluate(
            sample,
            &items,
            &text,
            seed,
            fitted.as_ref(),
            (tau, e.index_precision, rec),
        )?;
        bar.inc(1);
        memories = m;
        names = rows.iter().map(|r| r.0).collect();
        per_user.resize_with(rows.len(), BTreeMap::new);
        for (ri, (_, values)) in rows.into_iter().enumerate() {
            for (u, v) in sample.users.iter().zip(values) {
                let e = per_user[ri].entry(u.id.clone()).or_insert(([0.0; 3], 0));
                for (sum, x) in e.0.iter_mut().zip(v) {
                    *sum += x;
                }
                e.1 += 1;
            }
        }
    }
    bar.finish_and_clear();
    // units[method][user] = [NDCG@1, @5, @10], users in the same order.
    let units: Vec<Vec<[f64; 3]>> = per_user
        .iter()
        .map(|by| by.values().map(|(s, n)| s.map(|x| x / *n as f64)).collect())
        .collect();
    let n_users = units.first().map_or(0, Vec::len);
    let column = |ri: usize, m: usize| units[ri].iter().map(|v| v[m]).collect::<Vec<f64>>();
    let ci = |xs: &[f64]| super::bootstrap_ci(xs, 0x5eed);
    let stat = |ri: usize, m: usize| ci(&column(ri, m)).0;
    let mut table = format!(
        "{} ({} users per seed, 1 target + 9 negatives the user never interacted with), {} seeds, {n_users} users\n\n\
         Mean NDCG and its 95% confidence interval: a percentile bootstrap over users, {} resamples \
         (a user's NDCG is averaged over the seeds it appears in); the difference is paired (the same \
         resampled users for both methods).\n\n| method | NDCG@1 | NDCG@5 | NDCG@10 |\n| --- | ---: | ---: | ---: |\n",
        e.subset,
        samples.first().map_or(0, |s| s.users.len()),
        e.seeds.len(),
        super::BOOTSTRAP_RESAMPLES,
    );
    for (ri, name) in names.iter().enumerate() {
        let cells: Vec<String> = (0..3)
            .map(|m| {
                let (mean, lo, hi) = ci(&column(ri, m));
                format!("{mean:.3} [{lo:.3}, {hi:.3}]")
            })
            .collect();
        table.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
    }
    // steamrf against the best baseline at each cutoff (by its mean).
    let baselines: Vec<usize> = names
        .iter()
        .enumerate()
        .filter(|(_, n)| BASELINES.iter().any(|b| b.0 == **n))
        .map(|(i, _)| i)
        .collect();
    // Method `ri` against the best baseline at each cutoff (paired CIs).
    // Row `a` − row `b` at cutoff `m`, paired over users.
    let paired_at = |a: usize, b: usize, m: usize| {
        let d: Vec<f64> = units[a]
            .iter()
            .zip(&units[b])
            .map(|(x, y)| x[m] - y[m])
            .collect();
        ci(&d)
    };
    let paired = |a: usize, b: usize| -> Vec<(f64, f64, f64)> {
        (0..3).map(|m| paired_at(a, b, m)).collect()
    };
    let against_best = |ri: usize| {
        let mut diffs = Vec::new();
        for m in 0..3 {
            let Some(&best) = baselines
                .iter()
                .max_by(|&&a, &&b| stat(a, m).total_cmp(&stat(b, m)))
            else {
                continue;
            };
            diffs.push((best, paired_at(ri, best, m)));
        }
        diffs
    };
    let fused_row = names.iter().position(|n| *n == FUSED);
    for ri in std::iter::once(0).chain(fused_row) {
        let diffs = against_best(ri);
        if diffs.len() == 3 {
            let cells: Vec<String> = diffs
                .iter()
                .map(|(best, (d, lo, hi))| {
                    format!("{d:+.3} [{lo:+.3}, {hi:+.3}] vs {}", names[*best])
                })
                .collect();
            table.push_str(&format!(
                "| {} − best baseline | {} |\n",
                names[ri],
                cells.join(" | ")
            ));
        }
    }
    // What STEAM's share of the fused ranker is worth (paired).
    let no_steam_row = names.iter().position(|n| *n == FUSED_NO_STEAM);
    let steam_share: Option<Vec<(f64, f64, f64)>> =
        fused_row.zip(no_steam_row).map(|(f, g)| paired(f, g));
    if let Some(share) = &steam_share {
        let cells: Vec<String> = share
            .iter()
            .map(|(d, lo, hi)| format!("{d:+.3} [{lo:+.3}, {hi:+.3}]"))
            .collect();
        table.push_str(&format!(
            "| fused − fused w/o STEAM | {} |\n",
            cells.join(" | ")
        ));
    }
    // The fused ranker against user-kNN CF, the reference beside the
    // baselines (paired).
    let knn_row = names.iter().position(|n| *n == USER_KNN);
    if let Some((f, k)) = fused_row.zip(knn_row) {
        let cells: Vec<String> = paired(f, k)
            .iter()
            .map(|(d, lo, hi)| format!("{d:+.3} [{lo:+.3}, {hi:+.3}]"))
            .collect();
        table.push_str(&format!("| fused − {USER_KNN} | {} |\n", cells.join(" | ")));
    }
    let diffs = against_best(0);
    let headline = [0, 1, 2].map(|m| ci(&column(0, m)));
    let file = super::write_table(&e.out, &format!("steam-{}.md", e.subset), &table)?;
    let series: Vec<super::plot::Series> = names
        .iter()
        .enumerate()
        .map(|(ri, name)| super::plot::Series {
            name: (*name).to_owned(),
            values: (0..3).map(|m| stat(ri, m)).collect(),
        })
        .collect();
    let plot = super::plot::bars(
        &e.out.join(format!("steam-{}.png", e.subset)),
        &format!(
            "STEAM ranking protocol, {} (mean of {} seeds)",
            e.subset,
            e.seeds.len()
        ),
        "NDCG",
        &["NDCG@1", "NDCG@5", "NDCG@10"],
        &series,
    )?;
    out.extend(table.lines().map(|l| format!("  {l}")));
    out.push(format!(
        "  memories {} (w/o MC {}, w/o AMU {}), published prototypes {} (last seed); table in {}; {}; took {:.0} s",
        memories.0,
        memories.1,
        memories.2,
        memories.3,
        file.display(),
        super::plot::said(&plot),
        started.elapsed().as_secs_f64()
    ));
    // The keys first: the three cutoffs, the best baseline at
    // NDCG@10 and the paired difference to it with its 95% CI.
    let mut result = format!(
        "RESULT subset={} ndcg1={:.4} ndcg5={:.4} ndcg10={:.4}",
        e.subset, headline[0].0, headline[1].0, headline[2].0
    );
    let ablated = e.geometry.plain_text || e.geometry.centre || tau.is_some();
    if ablated {
        result.push_str(&format!(
            " plain_item_text={} centre={} tau={:.4}",
            e.geometry.plain_text,
            e.geometry.centre,
            tau.unwrap_or(SteamParams::default().link_tau)
        ));
    }
    if let Some((best, (d, lo, hi))) = diffs.get(2) {
        let slug = BASELINES
            .iter()
            .find(|b| b.0 == names[*best])
            .map_or("?", |b| b.1);
        result.push_str(&format!(
            " baseline={slug} baseline_ndcg10={:.4} delta10={d:.4} delta10_ci95_low={lo:.4} delta10_ci95_high={hi:.4}",
            stat(*best, 2)
        ));
    }
    if let Some(f) = fused_row {
        let fd = against_best(f);
        if let Some((_, (d, lo, hi))) = fd.get(2) {
            result.push_str(&format!(
                " fused_ndcg1={:.4} fused_ndcg5={:.4} fused_ndcg10={:.4} fused_delta10={d:.4} fused_delta10_ci95_low={lo:.4} fused_delta10_ci95_high={hi:.4}",
                stat(f, 0),
                stat(f, 1),
                stat(f, 2)
            ));
        }
    }
    if let Some((d, lo, hi)) = steam_share.as_ref().and_then(|s| s.get(2)) {
        result.push_str(&format!(
            " steam_share10={d:.4} steam_share10_ci95_low={lo:.4} steam_share10_ci95_high={hi:.4}"
        ));
    }
    result.push_str(&format!(" users={n_users}"));
    for (m, k) in [1, 5, 10].into_iter().enumerate() {
        let (_, lo, hi) = headline[m];
        result.push_str(&format!(" ndcg{k}_lo={lo:.4} ndcg{k}_hi={hi:.4}"));
    }
    for ((best, (d, lo, hi)), k) in diffs.iter().zip([1, 5, 10]) {
        let slug = BASELINES
            .iter()
            .find(|b| b.0 == names[*best])
            .map_or("?", |b| b.1);
        result.push_str(&format!(
            " best{k}={slug} diff{k}={d:.4} diff{k}_lo={lo:.4} diff{k}_hi={hi:.4}"
        ));
    }
    out.push(result);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::super::datasets::users;
    use super::*;

    #[test]
    fn ndcg_of_a_rank() {
        assert_eq!(ndcg_at(0, 1), 1.0);
        assert_eq!(ndcg_at(1, 1), 0.0);
        assert!((ndcg_at(1, 5) - 1.0 / 3f64.log2()).abs() < 1e-12);
        assert_eq!(ndcg_at(9, 10), 1.0 / 11f64.log2());
        assert_eq!(ndcg_at(10, 10), 0.0);
    }

    #[test]
    fn bm25_prefers_the_matching_text() {
        let texts: HashMap<String, String> = [
            (
                "a",
                "The CD is called 'Blue Train'. The category of this CD is: 'Jazz'.",
            ),
            (
                "b",
                "The CD is called 'Rumours'. The category of this CD is: 'Rock'.",
            ),
            (
                "c",
                "The CD is called 'Kind of Blue'. The category of this CD is: 'Jazz'.",
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let b = item_text(&texts);
        // The history is "Kind of Blue" (Jazz).
        let s = b.scores(&["c"], &["a", "b", "missing"]);
        assert!(s[0] > s[1], "{s:?}");
        assert_eq!(s[2], 0.0);
    }

    #[test]
    fn users_take_nine_negatives_without_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let name = "CDs-100-user-dense";
        std::fs::write(
            dir.path().join(format!("{name}.test.inter")),
            "user_id:token\titem_id_list:token_seq\titem_id:token\nu1\t1 2 3\t9\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join(format!("{name}.random")),
            "u1\t9 10 11 12 13 14 15 16 17 18 19\n",
        )
        .unwrap();
        let u = users(dir.path(), name).unwrap();
        assert_eq!(u[0].history, ["1", "2", "3"]);
        assert_eq!(u[0].target, "9");
        assert_eq!(
            u[0].negatives,
            ["10", "11", "12", "13", "14", "15", "16", "17", "18"]
        );
    }

    #[test]
    fn the_validation_split_predicts_the_seventh_and_avoids_the_test_target() {
        let dir = tempfile::tempdir().unwrap();
        let name = "CDs-100-user-dense";
        let header = "user_id:token\titem_id_list:token_seq\titem_id:token\n";
        std::fs::write(
            dir.path().join(format!("{name}.test.inter")),
            format!("{header}u1\t1 2 3\t10\n"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join(format!("{name}.valid.inter")),
            format!("{header}u1\t1 2\t3\n"),
        )
        .unwrap();
        std::fs::write(
            dir.path().join(format!("{name}.random")),
            "u1\t3 10 11 12 13 14 15 16 17 18 19 20\n",
        )
        .unwrap();
        let u = users_of_split(dir.path(), name, "valid").unwrap();
        assert_eq!(
            (u[0].history.as_slice(), u[0].target.as_str()),
            (&["1".to_owned(), "2".to_owned()][..], "3")
        );
        assert_eq!(
            u[0].negatives,
            ["11", "12", "13", "14", "15", "16", "17", "18", "19"],
            "neither the target nor the later test item"
        );
    }

    #[test]
    fn negatives_the_user_interacted_with_are_redrawn() {
        let dir = tempfile::tempdir().unwrap();
        let name = "CDs-100-user-dense";
        std::fs::write(
            dir.path().join(format!("{name}.test.inter")),
            "user_id:token\titem_id_list:token_seq\titem_id:token\nu1\t1 2 10\t9\nu2\t5\t6\n",
        )
        .unwrap();
        // u1's list holds its history items 10 and 2 and its target 9.
        std::fs::write(
            dir.path().join(format!("{name}.random")),
            "u1\t9 10 11 2 12 13 14 15 16 17 18\nu2\t20 21 22 23 24 25 26 27 28 29\n",
        )
        .unwrap();
        let u = users(dir.path(), name).unwrap();
        let n = &u[0].negatives;
        assert_eq!(n.len(), 9);
        assert_eq!(n[..8], ["11", "12", "13", "14", "15", "16", "17", "18"]);
        for bad in ["1", "2", "10", "9"] {
            assert!(!n.iter().any(|x| x == bad), "{n:?}");
        }
        assert_eq!(n.iter().collect::<HashSet<_>>().len(), 9, "{n:?}");
        // Deterministic.
        assert_eq!(users(dir.path(), name).unwrap()[0].negatives, *n);
    }

    /// A 40-movie MovieLens catalogue.
    fn forty_dramas() -> HashMap<String, (String, String)> {
        (0..40)
            .map(|i| (i.to_string(), (format!("Movie {i}"), "Drama".to_owned())))
            .collect()
    }

    #[test]
    fn the_movielens_validation_split_predicts_the_second_to_last_and_hides_the_last() {
        let mut ratings = Vec::new();
        let meta = forty_dramas();
        for u in 0..120 {
            for k in 0..6 {
                ratings.push((u.to_string(), ((u + k * 7) % 40).to_string(), k as i64));
            }
        }
        let test = ml_sample(&ratings, &meta, 7, false);
        let valid = ml_valid_sample(&ratings, &meta, 7, false);
        let ids = |s: &Sample| s.users.iter().map(|u| u.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&valid), ids(&test), "the same users");
        for (v, t) in valid.users.iter().zip(&test.users) {
            assert_eq!(v.history.len(), 4);
            assert_eq!(t.history[..4], v.history[..]);
            assert_eq!(t.history[4], v.target, "the second-to-last rating");
            assert!(!v.history.contains(&t.target) && v.target != t.target);
            assert!(
                !v.negatives.contains(&t.target),
                "negatives were never rated"
            );
            for target in [&v.target, &t.target] {
                assert!(!valid.train.contains(&(v.id.clone(), target.clone())));
            }
        }
        assert_eq!(valid.train.len(), ratings.len() - 200);
    }

    #[test]
    fn movielens_samples_hold_out_the_last_rating_and_sample_unseen_negatives() {
        let mut ratings = Vec::new();
        let meta = forty_dramas();
        for u in 0..120 {
            for k in 0..5 {
                // Two ratings share the last timestamp: the larger item id is the target.
                let ts = if k >= 3 { 100 } else { k };
                ratings.push((u.to_string(), ((u + k * 7) % 40).to_string(), ts));
            }
        }
        let s = ml_sample(&ratings, &meta, 7, false);
        assert_eq!(s.users.len(), 100);
        assert_eq!(
            ml_sample(&ratings, &meta, 7, false).users[0].id,
            s.users[0].id
        );
        for u in &s.users {
            let mine: Vec<&(String, String, i64)> =
                ratings.iter().filter(|r| r.0 == u.id).collect();
            let last = mine
                .iter()
                .filter(|r| r.2 == 100)
                .map(|r| r.1.as_str())
                .max_by_key(|i| i.parse::<u64>().unwrap())
                .unwrap();
            assert_eq!(u.target, last);
            assert_eq!(u.history.len(), 4);
            assert_eq!(u.negatives.len(), 9);
            assert!(u.negatives.iter().all(|n| mine.iter().all(|r| &r.1 != n)));
            assert!(!s.train.contains(&(u.id.clone(), u.target.clone())));
        }
        assert_eq!(s.train.len(), ratings.len() - 100);
        // STEAM learns from the same interactions: the 20 other users whole.
        assert_eq!(s.others.len(), 20);
        assert!(
            s.others
                .iter()
                .all(|o| o.history.len() == 5 && !s.users.iter().any(|u| u.id == o.id))
        );
        let learned: usize = s
            .users
            .iter()
            .chain(&s.others)
            .map(|u| u.history.len())
            .sum();
        assert_eq!(learned, s.train.len());
        // The paper's sample: the last 5 history ratings, learned from alone.
        let full = ml_sample(&ratings, &meta, 7, true);
        let p = paper_sample(ml_sample(&ratings, &meta, 7, true));
        for (u, f) in p.users.iter().zip(&full.users) {
            assert_eq!(
                u.history[..],
                f.history[f.history.len().saturating_sub(5)..]
            );
            assert_eq!((&u.target, &u.negatives), (&f.target, &f.negatives));
        }
        assert!(p.others.is_empty());
        assert_eq!(
            p.train.len(),
            p.users.iter().map(|u| u.history.len()).sum::<usize>()
        );
    }
}
