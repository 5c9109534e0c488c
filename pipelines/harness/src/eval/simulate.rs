//! The STEAM paper's two other evaluations, through the same operators as
//! the ranking protocol (eval/steam.rs):
//!
//! - **User simulation** (`--task simulation`, the AFL protocol; MovieLens-100K):
//!   each agent is initialised with a user's ratings except the last 10, then
//!   shown 20 items at positive:negative 1:1, 1:3 or 1:9 (10, 5 or 2 of the
//!   held-out ratings; the rest unseen items from the negative pool) and
//!   answers yes or no per item. Without an LLM, an agent says yes when the
//!   method's score reaches a threshold. That threshold is the one that
//!   maximises F1 at 1:1 on 100 *other* users (calibration users, drawn with
//!   the same seed), and is then used unchanged at every ratio: like the LLM
//!   agent, it is not told the ratio. Precision and F1 are micro-averaged over
//!   all decisions of the 100 test users.
//! - **Diversity** (`--task diversity`): each method recommends its top 10 from
//!   a pool (ML-100K: the negative pool of the subset; CDs: every item of the
//!   sample), the user's history excluded. ILD is the mean pairwise L2
//!   distance of the items' (normalised MiniLM) embeddings, Entropy and DS
//!   are over each item's primary genre (its first listed genre or category),
//!   as the STEAM paper defines them; HR@10 (the held-out target is in the
//!   list) is printed beside them, since random lists are the most diverse.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};

use super::plot::{self, Series};
use super::steam::{
    Catalogue, Items, ML_TEMPLATE, Ranker, SteamEval, User, bad, cds_catalogue, embed_items,
    histories, item_cf, item_text, mean_sd, ml_sample, movielens, negative_pool, rankers,
    steam_states, unseen, users,
};
use steamrf_operators::rank::ItemText;

use steamrf_pipelines::error::Result;

/// Items shown to an agent.
const SHOWN: usize = 20;
/// Ratings held out of each agent's initialisation.
const HELD_OUT: usize = 10;
/// Negatives per positive.
const RATIOS: [usize; 3] = [1, 3, 9];
/// Test users (and as many calibration users) per seed.
const USERS: usize = 100;
/// Length of a recommendation list for diversity.
const LIST: usize = 10;

/// One agent's 20 items and which are the user's.
struct Case {
    user: usize,
    items: Vec<String>,
    positive: Vec<bool>,
}

/// Test users `users[..USERS]`, calibration users after them; `cases[r]`
/// are every user's items at `RATIOS[r]`.
struct SimSample {
    users: Vec<User>,
    train: Vec<(String, String)>,
    cases: Vec<Vec<Case>>,
}

fn sim_sample(
    ratings: &[(String, String, i64)],
    meta: &HashMap<String, (String, String)>,
    seed: u64,
    from_users: bool,
) -> SimSample {
    let by_user = histories(ratings);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids: Vec<&str> = by_user
        .iter()
        .filter(|(_, v)| v.len() >= HELD_OUT + 5)
        .map(|(u, _)| *u)
        .collect();
    ids.shuffle(&mut rng);
    ids.truncate(2 * USERS);
    let pool = negative_pool(&by_user, &ids, meta, from_users);
    let mut users = Vec::new();
    let mut held = Vec::new();
    for u in &ids {
        let v = &by_user[u];
        let split = v.len() - HELD_OUT;
        users.push(User {
            id: (*u).to_owned(),
            history: v[..split].iter().map(|x| x.1.to_owned()).collect(),
            target: String::new(),
            negatives: Vec::new(),
        });
        held.push(v[split..].iter().map(|x| x.1).collect::<Vec<&str>>());
    }
    let mut cases = Vec::new();
    for m in RATIOS {
        let positives = SHOWN / (1 + m);
        let mut at_ratio = Vec::new();
        for (ui, u) in ids.iter().enumerate() {
            let seen: HashSet<&str> = by_user[u].iter().map(|x| x.1).collect();
            let mut shown: Vec<(String, bool)> = held[ui][..positives]
                .iter()
                .map(|i| ((*i).to_owned(), true))
                .chain(
                    unseen(&mut rng, &pool, &seen, SHOWN - positives)
                        .into_iter()
                        .map(|i| (i, false)),
                )
                .collect();
            shown.shuffle(&mut rng);
            at_ratio.push(Case {
                user: ui,
                items: shown.iter().map(|s| s.0.clone()).collect(),
                positive: shown.iter().map(|s| s.1).collect(),
            });
        }
        cases.push(at_ratio);
    }
    let held_out: HashSet<(&str, &str)> = ids
        .iter()
        .zip(&held)
        .flat_map(|(u, h)| h.iter().map(move |i| (*u, *i)))
        .collect();
    let train = ratings
        .iter()
        .filter(|(u, i, _)| !held_out.contains(&(u.as_str(), i.as_str())))
        .map(|(u, i, _)| (u.clone(), i.clone()))
        .collect();
    SimSample {
        users,
        train,
        cases,
    }
}

/// The threshold (say yes when score ≥ it) with the best F1 over the
/// labelled scores; ties go to the higher threshold.
fn best_threshold(mut scored: Vec<(f64, bool)>) -> f64 {
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let positives = scored.iter().filter(|s| s.1).count();
    let (mut best, mut threshold, mut tp) = (-1.0, f64::INFINITY, 0usize);
    for (i, &(score, positive)) in scored.iter().enumerate() {
        tp += usize::from(positive);
        // Only cut between different scores: equal scores get one answer.
        if scored.get(i + 1).is_some_and(|next| next.0 == score) {
            continue;
        }
        let f1 = 2.0 * tp as f64 / (i + 1 + positives) as f64;
        if f1 > best {
            (best, threshold) = (f1, score);
        }
    }
    threshold
}

/// Micro precision and F1 of yes/no answers.
fn precision_f1(answers: impl Iterator<Item = (bool, bool)>) -> (f64, f64) {
    let (mut tp, mut fp, mut fneg) = (0usize, 0usize, 0usize);
    for (yes, positive) in answers {
        match (yes, positive) {
            (true, true) => tp += 1,
            (true, false) => fp += 1,
            (false, true) => fneg += 1,
            (false, false) => {}
        }
    }
    let precision = if tp + fp > 0 {
        tp as f64 / (tp + fp) as f64
    } else {
        0.0
    };
    let f1 = if tp > 0 {
        2.0 * tp as f64 / (2 * tp + fp + fneg) as f64
    } else {
        0.0
    };
    (precision, f1)
}

/// Per method: [P, F1] at each ratio, flattened.
fn simulate_one(
    s: &SimSample,
    items: &Items,
    text: &ItemText,
    (seed, tau): (u64, Option<f32>),
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(&'static str, Vec<f64>)>> {
    let states = steam_states(&s.users, items, tau)?;
    let cf = item_cf(&s.train);
    let rankers = rankers(&states, items, &cf, text, seed, tau);
    let mut out = Vec::new();
    for (name, rank) in &rankers {
        let scores: Vec<Vec<Vec<f64>>> = s
            .cases
            .iter()
            .map(|cases| {
                cases
                    .iter()
                    .map(|c| rank(&s.users[c.user], &c.items))
                    .collect()
            })
            .collect();
        let calibration: Vec<(f64, bool)> = s.cases[0]
            .iter()
            .zip(&scores[0])
            .filter(|(c, _)| c.user >= USERS)
            .flat_map(|(c, sc)| sc.iter().copied().zip(c.positive.iter().copied()))
            .collect();
        let t = best_threshold(calibration);
        let mut row = Vec::new();
        for (cases, sc) in s.cases.iter().zip(&scores) {
            let (p, f1) = precision_f1(
                cases
                    .iter()
                    .zip(sc)
                    .filter(|(c, _)| c.user < USERS)
                    .flat_map(|(c, sc)| {
                        sc.iter()
                            .map(move |&x| x >= t)
                            .zip(c.positive.iter().copied())
                    }),
            );
            row.extend([p, f1]);
        }
        out.push((*name, row));
        bar.inc(1);
    }
    let mut all_yes = Vec::new();
    for cases in &s.cases {
        let (p, f1) = precision_f1(
            cases
                .iter()
                .filter(|c| c.user < USERS)
                .flat_map(|c| c.positive.iter().map(|&p| (true, p))),
        );
        all_yes.extend([p, f1]);
    }
    out.push(("always yes", all_yes));
    Ok(out)
}

/// Mean ± std per method and column over the seeds, as markdown rows, and
/// the means as plot series.
fn summarise(per_seed: &[Vec<(&'static str, Vec<f64>)>], header: &str) -> (String, Vec<Series>) {
    let mut table = header.to_owned();
    let mut series = Vec::new();
    let Some(first) = per_seed.first() else {
        return (table, series);
    };
    for (mi, (name, row)) in first.iter().enumerate() {
        let cols: Vec<(f64, f64)> = (0..row.len())
            .map(|c| {
                mean_sd(
                    &per_seed
                        .iter()
                        .map(|seed| seed[mi].1[c])
                        .collect::<Vec<_>>(),
                )
            })
            .collect();
        table.push_str(&format!(
            "| {name} | {} |\n",
            cols.iter()
                .map(|(m, sd)| format!("{m:.3} ± {sd:.3}"))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        series.push(Series {
            name: (*name).to_owned(),
            values: cols.iter().map(|c| c.0).collect(),
        });
    }
    (table, series)
}

/// The report of a task, up to (not including) its `RESULT` line.
fn report(
    task: &str,
    e: &SteamEval,
    (embedded, took, tau): (usize, f64, Option<f32>),
    table: &str,
    (file, png): (
        &std::path::Path,
        &std::result::Result<std::path::PathBuf, String>,
    ),
    started: Instant,
) -> Vec<String> {
    let mut out = vec![format!(
        "eval steam --task {task}: {} ({embedded} items embedded in {took:.1} s), seeds {:?}",
        e.subset, e.seeds
    )];
    out.push(format!("  geometry: {}", e.geometry.describe(tau)));
    out.extend(table.lines().map(|l| format!("  {l}")));
    out.push(format!(
        "  table in {}; {}; took {:.0} s",
        file.display(),
        plot::said(png),
        started.elapsed().as_secs_f64()
    ));
    out
}

/// `steamrf eval steam --task simulation`.
pub(super) async fn simulation(e: SteamEval) -> Result<Vec<String>> {
    let started = Instant::now();
    let from_users = match e.subset.as_str() {
        "ml100k-catalogue" => false,
        "ml100k-users" => true,
        other => {
            return Err(bad(format!(
                "--task simulation runs on ml100k-catalogue or ml100k-users, not {other:?}: the AgentCF CDs samples hold 8 interactions per user, too few to hold 10 out"
            )));
        }
    };
    let (meta, ratings) = movielens(&e.data)?;
    let samples: Vec<SimSample> = e
        .seeds
        .iter()
        .map(|&seed| sim_sample(&ratings, &meta, seed, from_users))
        .collect();
    let needed: Vec<String> = samples
        .iter()
        .flat_map(|s| {
            s.users
                .iter()
                .flat_map(|u| u.history.iter().cloned())
                .chain(
                    s.cases
                        .iter()
                        .flatten()
                        .flat_map(|c| c.items.iter().cloned()),
                )
        })
        .collect();
    let catalogue: Catalogue = (meta, ML_TEMPLATE);
    let (items, texts, took, tau) = embed_items(&e.embed, &catalogue, needed, &e.geometry).await?;
    let text = item_text(&texts);
    let bar = super::progress(e.seeds.len() * 8, "methods × seeds");
    let mut per_seed = Vec::new();
    for (s, &seed) in samples.iter().zip(&e.seeds) {
        per_seed.push(simulate_one(s, &items, &text, (seed, tau), &bar)?);
    }
    bar.finish_and_clear();
    let (table, series) = summarise(
        &per_seed,
        &format!(
            "User simulation (AFL protocol), {}: {USERS} users per seed, {SHOWN} items each, threshold calibrated on {USERS} other users at 1:1; {} seeds\n\n| method | P 1:1 | F1 1:1 | P 1:3 | F1 1:3 | P 1:9 | F1 1:9 |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
            e.subset,
            e.seeds.len()
        ),
    );
    let file = super::write_table(&e.out, &format!("steam-simulation-{}.md", e.subset), &table)?;
    let png = plot::bars(
        &e.out.join(format!("steam-simulation-{}.png", e.subset)),
        &format!("User simulation (AFL protocol), {}", e.subset),
        "precision / F1",
        &["P 1:1", "F1 1:1", "P 1:3", "F1 1:3", "P 1:9", "F1 1:9"],
        &series,
    )?;
    let mut out = report(
        "simulation",
        &e,
        (items.len(), took, tau),
        &table,
        (&file, &png),
        started,
    );
    let m = series.first().map_or(vec![0.0; 6], |s| s.values.clone());
    out.push(format!(
        "RESULT precision_1_1={:.4} f1_1_1={:.4} precision_1_3={:.4} f1_1_3={:.4} precision_1_9={:.4} f1_1_9={:.4}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    ));
    Ok(out)
}

/// The primary genre of an item: its first listed genre or category.
fn genre<'a>(meta: &'a HashMap<String, (String, String)>, item: &str) -> &'a str {
    meta.get(item)
        .and_then(|(_, c)| c.split("; ").next())
        .unwrap_or("")
}

/// ILD, Entropy and DS of one list (the STEAM paper's definitions).
fn diversity_of(
    list: &[&str],
    items: &Items,
    meta: &HashMap<String, (String, String)>,
) -> [f64; 3] {
    let n = list.len();
    if n < 2 {
        return [0.0, 0.0, n as f64];
    }
    let mut ild = 0.0;
    for (a, x) in list.iter().enumerate() {
        for y in &list[a + 1..] {
            let (ex, ey) = (&items[*x].2, &items[*y].2);
            let d2: f32 = ex.iter().zip(ey).map(|(p, q)| (p - q) * (p - q)).sum();
            ild += f64::from(d2.sqrt());
        }
    }
    // Each unordered pair counted once: the mean over ordered pairs is the same.
    ild /= (n * (n - 1) / 2) as f64;
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for i in list {
        *counts.entry(genre(meta, i)).or_default() += 1;
    }
    let entropy = -counts
        .values()
        .map(|&c| {
            let p = c as f64 / n as f64;
            p * p.ln()
        })
        .sum::<f64>();
    [ild, entropy, counts.len() as f64 / n as f64]
}

/// Per method: [ILD, Entropy, DS, HR@10], means over the users.
fn diversity_one(
    users: &[User],
    pool: &[String],
    train: &[(String, String)],
    (items, text): (&Items, &ItemText),
    meta: &HashMap<String, (String, String)>,
    (seed, tau): (u64, Option<f32>),
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(&'static str, Vec<f64>)>> {
    let states = steam_states(users, items, tau)?;
    let cf = item_cf(train);
    let rankers: Vec<(&'static str, Ranker<'_>)> = rankers(&states, items, &cf, text, seed, tau);
    let mut out = Vec::new();
    for (name, rank) in &rankers {
        let mut acc = [0.0f64; 4];
        for u in users {
            let seen: HashSet<&str> = u.history.iter().map(String::as_str).collect();
            let cands: Vec<String> = pool
                .iter()
                .filter(|i| !seen.contains(i.as_str()))
                .cloned()
                .collect();
            let scores = rank(u, &cands);
            let mut order: Vec<usize> = (0..cands.len()).collect();
            // Highest score first; ties keep the pool's order.
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            let list: Vec<&str> = order
                .iter()
                .take(LIST)
                .map(|&k| cands[k].as_str())
                .collect();
            let [ild, entropy, ds] = diversity_of(&list, items, meta);
            acc[0] += ild;
            acc[1] += entropy;
            acc[2] += ds;
            acc[3] += f64::from(u8::from(list.contains(&u.target.as_str())));
        }
        out.push((
            *name,
            acc.iter().map(|a| a / users.len().max(1) as f64).collect(),
        ));
        bar.inc(1);
    }
    Ok(out)
}

/// `steamrf eval steam --task diversity`.
pub(super) async fn diversity(e: SteamEval) -> Result<Vec<String>> {
    let started = Instant::now();
    // Per seed: users, the recommendation pool, the training interactions.
    type Run = (Vec<User>, Vec<String>, Vec<(String, String)>);
    let (catalogue, runs): (Catalogue, Vec<Run>) = match e.subset.as_str() {
        "dense" | "sparse" | "cds-dense" | "cds-sparse" => {
            let sub = e.subset.trim_start_matches("cds-");
            let name = format!("CDs-100-user-{sub}");
            let us = users(&e.data.join(&name), &name)?;
            let mut pool: Vec<String> = us
                .iter()
                .flat_map(|u| {
                    u.history
                        .iter()
                        .chain(&u.negatives)
                        .chain(std::iter::once(&u.target))
                        .cloned()
                })
                .collect();
            pool.sort();
            pool.dedup();
            let train: Vec<(String, String)> = us
                .iter()
                .flat_map(|u| u.history.iter().map(|h| (u.id.clone(), h.clone())))
                .collect();
            let runs = e
                .seeds
                .iter()
                .map(|_| (us.clone(), pool.clone(), train.clone()))
                .collect();
            (cds_catalogue(&e.data)?, runs)
        }
        "ml100k-catalogue" | "ml100k-users" => {
            let (meta, ratings) = movielens(&e.data)?;
            let from_users = e.subset == "ml100k-users";
            let by_user = histories(&ratings);
            let runs = e
                .seeds
                .iter()
                .map(|&seed| {
                    let s = ml_sample(&ratings, &meta, seed, from_users);
                    let ids: Vec<&str> = s.users.iter().map(|u| u.id.as_str()).collect();
                    let pool = negative_pool(&by_user, &ids, &meta, from_users)
                        .into_iter()
                        .map(str::to_owned)
                        .collect();
                    (s.users, pool, s.train)
                })
                .collect();
            ((meta, ML_TEMPLATE), runs)
        }
        other => return Err(bad(format!("unknown subset {other:?}"))),
    };
    let needed: Vec<String> = runs
        .iter()
        .flat_map(|(us, pool, _)| {
            pool.iter()
                .cloned()
                .chain(us.iter().flat_map(|u| u.history.iter().cloned()))
        })
        .collect();
    let (items, texts, took, tau) = embed_items(&e.embed, &catalogue, needed, &e.geometry).await?;
    let text = item_text(&texts);
    let bar = super::progress(e.seeds.len() * 8, "methods × seeds");
    let mut per_seed = Vec::new();
    for ((us, pool, train), &seed) in runs.iter().zip(&e.seeds) {
        let pool: Vec<String> = pool
            .iter()
            .filter(|i| items.contains_key(*i))
            .cloned()
            .collect();
        per_seed.push(diversity_one(
            us,
            &pool,
            train,
            (&items, &text),
            &catalogue.0,
            (seed, tau),
            &bar,
        )?);
    }
    bar.finish_and_clear();
    let (table, series) = summarise(
        &per_seed,
        &format!(
            "Diversity, {}: top {LIST} from the pool (history excluded), {} users, {} seeds; ILD over MiniLM embeddings, Entropy and DS over primary genres\n\n| method | ILD | Entropy | DS | HR@10 |\n| --- | ---: | ---: | ---: | ---: |\n",
            e.subset,
            runs.first().map_or(0, |r| r.0.len()),
            e.seeds.len()
        ),
    );
    let file = super::write_table(&e.out, &format!("steam-diversity-{}.md", e.subset), &table)?;
    let png = plot::bars(
        &e.out.join(format!("steam-diversity-{}.png", e.subset)),
        &format!("Diversity of top-{LIST} lists, {}", e.subset),
        "value",
        &["ILD", "Entropy", "DS", "HR@10"],
        &series,
    )?;
    let mut out = report(
        "diversity",
        &e,
        (items.len(), took, tau),
        &table,
        (&file, &png),
        started,
    );
    let m = series.first().map_or(vec![0.0; 4], |s| s.values.clone());
    out.push(format!(
        "RESULT ild={:.4} entropy={:.4} ds={:.4} hr10={:.4}",
        m[0], m[1], m[2], m[3]
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_threshold_maximises_f1_and_never_splits_ties() {
        // Scores 0.9 (yes), 0.8 (yes), 0.7 (no), 0.6 (yes), 0.1 (no):
        // cut at 0.8 → F1 = 4/5 = 0.8; at 0.6 → 6/7 ≈ 0.857 (best).
        let s = vec![
            (0.9, true),
            (0.7, false),
            (0.1, false),
            (0.8, true),
            (0.6, true),
        ];
        assert_eq!(best_threshold(s), 0.6);
        // Two equal scores, one of each: both get the same answer.
        let t = best_threshold(vec![(0.5, true), (0.5, false), (0.2, false)]);
        assert_eq!(t, 0.5);
        let (p, f1) =
            precision_f1([(true, true), (true, false), (false, true), (false, false)].into_iter());
        assert_eq!((p, f1), (0.5, 0.5));
        assert_eq!(precision_f1([(false, true)].into_iter()), (0.0, 0.0));
    }

    #[test]
    fn diversity_follows_the_papers_definitions() {
        let e = |v: [f32; 2]| v.to_vec();
        let items: Items = [
            ("a", "Jazz", [1.0, 0.0]),
            ("b", "Jazz; Bop", [0.0, 1.0]),
            ("c", "Rock", [1.0, 0.0]),
            ("d", "Pop", [0.0, 1.0]),
        ]
        .into_iter()
        .map(|(i, g, v)| (i.to_owned(), (i.to_owned(), g.to_owned(), e(v))))
        .collect();
        let meta: HashMap<String, (String, String)> = items
            .iter()
            .map(|(k, v)| (k.clone(), (v.0.clone(), v.1.clone())))
            .collect();
        // Pairs: a-b √2, a-c 0, b-c √2 → ILD = 2√2 / 3.
        let [ild, entropy, ds] = diversity_of(&["a", "b", "c"], &items, &meta);
        assert!((ild - 2.0 * 2f64.sqrt() / 3.0).abs() < 1e-6, "{ild}");
        // Genres Jazz, Jazz, Rock: −(2/3 ln 2/3 + 1/3 ln 1/3).
        let h = -(2.0 / 3.0 * (2.0f64 / 3.0).ln() + 1.0 / 3.0 * (1.0f64 / 3.0).ln());
        assert!((entropy - h).abs() < 1e-12);
        assert!((ds - 2.0 / 3.0).abs() < 1e-12);
        let [_, entropy, ds] = diversity_of(&["a", "c", "d"], &items, &meta);
        assert!((entropy - 3f64.ln()).abs() < 1e-12);
        assert_eq!(ds, 1.0);
    }

    #[test]
    fn simulation_cases_hold_out_the_last_ten_ratings_at_each_ratio() {
        let mut ratings = Vec::new();
        let mut meta = HashMap::new();
        for i in 0..400 {
            meta.insert(i.to_string(), (format!("Movie {i}"), "Drama".to_owned()));
        }
        for u in 0..250 {
            for k in 0..30 {
                ratings.push((u.to_string(), ((u * 3 + k) % 400).to_string(), k));
            }
        }
        let s = sim_sample(&ratings, &meta, 3, false);
        assert_eq!(s.users.len(), 2 * USERS);
        for (r, m) in RATIOS.iter().enumerate() {
            for c in &s.cases[r] {
                let u = &s.users[c.user];
                assert_eq!(u.history.len(), 20);
                assert_eq!(c.items.len(), SHOWN);
                let pos: Vec<&String> = c
                    .items
                    .iter()
                    .zip(&c.positive)
                    .filter(|x| *x.1)
                    .map(|x| x.0)
                    .collect();
                assert_eq!(pos.len(), SHOWN / (1 + m));
                let mine: HashSet<String> = ratings
                    .iter()
                    .filter(|x| x.0 == u.id)
                    .map(|x| x.1.clone())
                    .collect();
                for (i, p) in c.items.iter().zip(&c.positive) {
                    // Positives are held-out ratings, negatives never rated.
                    assert_eq!(mine.contains(i), *p);
                    assert!(!u.history.contains(i));
                }
            }
        }
        assert_eq!(s.train.len(), ratings.len() - 2 * USERS * HELD_OUT);
    }
}
