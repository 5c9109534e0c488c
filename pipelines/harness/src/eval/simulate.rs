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
//!   agent, it is not told the ratio. The fused agent
//!   ([`fuse::fit_pooled_decision`]) fits its weights and threshold together
//!   on the same calibration users, on each signal standardised over every
//!   calibration item, so that an item's answer does not depend on the
//!   items shown with it. Stop 36's agent standardised over each slate,
//!   which says yes to about the same share of every slate and fell at 1:9;
//!   it stays as a row.
//!   Every method learns from the same interactions: all users' ratings but
//!   the sampled users' held-out ones (STEAM's state holds every user, as
//!   popularity and item-item CF count every user). Precision and F1 are
//!   micro-averaged over all decisions of the test users of every seed, with
//!   a 95% percentile-bootstrap interval over those users (paired for
//!   differences).
//! - **Diversity** (`--task diversity`): each method recommends its top 10 from
//!   a pool (ML-100K: the negative pool of the subset; CDs: every item of the
//!   sample), the user's history excluded. ILD is the mean pairwise L2
//!   distance of the items' (normalised MiniLM) embeddings, Entropy and DS
//!   are over each item's primary genre (its first listed genre or category),
//!   as the STEAM paper defines them; HR@10 (the held-out target is in the
//!   list) is printed beside them, since random lists are the most diverse.
//!   On ML-100K STEAM's state holds every user, as the baselines count
//!   every user (the CDs samples have no others).
//!
//! Each seed runs on its own thread: building a seed's STEAM states is
//! single-threaded, and the seeds are independent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use steamrf_kernels::RowPrecision;

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use steamrf_operators::fuse::{self, Slate};
use steamrf_operators::rank::ItemText;
use steamrf_operators::steam::retrieve::RecommendParams;
use steamrf_pipelines::error::Result;

use super::SteamEval;
use super::datasets::{
    Catalogue, Items, ML_TEMPLATE, User, bad, cds_catalogue, embed_items, histories, ml_items,
    ml_sample, movielens, negative_pool, others_of, unseen, users,
};
use super::plot::{self, Series};
use super::recommenders::{
    Ranker, feature_rows, features_of, item_cf, item_text, mean_sd, rankers, recommend_params,
    steam_states, user_knn,
};

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
    /// Every user not sampled, with all its ratings as its history: STEAM
    /// learns from them, as popularity and item-item CF learn from `train`.
    others: Vec<User>,
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
    let others = others_of(&by_user, &ids);
    SimSample {
        users,
        train,
        others,
        cases,
    }
}

/// Micro precision and F1 of `[tp, fp, fn]`.
fn precision_f1([tp, fp, fneg]: [usize; 3]) -> (f64, f64) {
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

/// One user's `[tp, fp, fn]` at each ratio.
type Counts = [[usize; 3]; 3];

/// Per method, each test user's counts (by user id).
type SeedRun = Vec<(&'static str, Vec<(String, Counts)>)>;

/// The fused agent's row name (the declared headline): signals
/// standardised over the calibration items.
const FUSED: &str = "steamrf fused (fit on the calibration users)";
/// The same fit with STEAM's weight held at 0.
const FUSED_NO_STEAM: &str = "fused w/o STEAM (CF + BM25 + popularity)";
/// Stop 36's fused agent: the same four signals standardised over each
/// slate.
const FUSED_SLATE: &str = "steamrf fused, z over the slate (stop 36's agent)";

/// Each of the fused agent's signals alone, standardised over its slate as
/// the fused agent's are (the agent sees its 20 items together): what the
/// fusion adds beyond that standardisation. In the order of the features.
const SLATE_Z: [&str; 4] = [
    "steamrf (STEAM), z over the slate",
    "item-item CF, z over the slate",
    "BM25 (item text), z over the slate",
    "popularity, z over the slate",
];

/// The baselines the fused agent and STEAM are compared with: the best of
/// them at each ratio.
const BASELINES: [&str; 6] = [
    "popularity",
    "item-item CF",
    "BM25 (item text)",
    SLATE_Z[1],
    SLATE_Z[2],
    SLATE_Z[3],
];

/// Each test user's counts from answers `yes[ratio][case][item]`.
fn tally(s: &SimSample, yes: &[Vec<Vec<bool>>]) -> Vec<(String, Counts)> {
    let mut by_user: Vec<Counts> = vec![[[0; 3]; 3]; USERS.min(s.users.len())];
    for (r, (cases, answers)) in s.cases.iter().zip(yes).enumerate() {
        for (c, a) in cases.iter().zip(answers) {
            if c.user >= USERS {
                continue;
            }
            for (&y, &p) in a.iter().zip(&c.positive) {
                let k = match (y, p) {
                    (true, true) => 0,
                    (true, false) => 1,
                    (false, true) => 2,
                    (false, false) => continue,
                };
                by_user[c.user][r][k] += 1;
            }
        }
    }
    by_user
        .into_iter()
        .enumerate()
        .map(|(u, c)| (s.users[u].id.clone(), c))
        .collect()
}

/// The fused agents fitted on one seed's calibration users, for the report.
struct Fitted {
    /// The declared agent, with STEAM and without.
    pooled: [fuse::PooledDecision; 2],
    /// Stop 36's agent (z over the slate).
    slate: fuse::Decision,
}

/// An agent's answers `[ratio][case][item]` from what it reads per case
/// (`per_case[ratio][case]`: its items' scores or features).
fn answers<C>(per_case: &[Vec<C>], decide: impl Fn(&C) -> Vec<bool>) -> Vec<Vec<Vec<bool>>> {
    per_case
        .iter()
        .map(|r| r.iter().map(&decide).collect())
        .collect()
}

/// Every method's answers for the test users of one seed, and the fused
/// agents' fitted weights for the report.
fn simulate_one(
    s: &SimSample,
    items: &Items,
    text: &ItemText,
    (seed, tau, precision, rec): (u64, Option<f32>, RowPrecision, RecommendParams),
    bar: &indicatif::ProgressBar,
) -> Result<(SeedRun, Fitted)> {
    // STEAM learns from the same interactions as the baselines.
    let learners: Vec<User> = s.users.iter().chain(&s.others).cloned().collect();
    let states = steam_states(&learners, items, (tau, precision))?;
    let cf = item_cf(&s.train);
    let knn = user_knn(&s.train);
    let rankers = rankers(&states, items, (&cf, &knn), text, seed, rec);
    // `scores[method][ratio][case][item]`.
    let scores: Vec<Vec<Vec<Vec<f64>>>> = rankers
        .iter()
        .map(|(_, rank)| {
            s.cases
                .iter()
                .map(|cases| {
                    cases
                        .iter()
                        .map(|c| rank(&s.users[c.user], &c.items))
                        .collect()
                })
                .collect()
        })
        .collect();
    let mut out = Vec::new();
    for ((name, _), sc) in rankers.iter().zip(&scores) {
        let calibration: Vec<(f64, bool)> = s.cases[0]
            .iter()
            .zip(&sc[0])
            .filter(|(c, _)| c.user >= USERS)
            .flat_map(|(c, x)| x.iter().copied().zip(c.positive.iter().copied()))
            .collect();
        let (t, _) = fuse::best_threshold(calibration);
        let yes = answers(sc, |x| x.iter().map(|&v| v >= t).collect());
        out.push((*name, tally(s, &yes)));
        bar.inc(1);
    }
    // The fused agent: the ranker's four signals, weights and threshold
    // fitted together at 1:1 on the calibration users.
    let names: Vec<&str> = rankers.iter().map(|r| r.0).collect();
    let rows = feature_rows(&names)?;
    // `features[ratio][case]`: per item the four signals.
    let features: Vec<Vec<Vec<[f64; 4]>>> = (0..RATIOS.len())
        .map(|r| {
            let per_ratio: Vec<Vec<Vec<f64>>> = scores.iter().map(|m| m[r].clone()).collect();
            (0..s.cases[r].len())
                .map(|c| features_of(&per_ratio, &rows, c))
                .collect()
        })
        .collect();
    let slates = |from: usize| -> Vec<Slate> {
        s.cases[0]
            .iter()
            .zip(&features[0])
            .filter(|(c, _)| c.user >= USERS)
            .map(|(c, f)| Slate {
                scores: f.iter().map(|x| x[from..].to_vec()).collect(),
                positive: c.positive.clone(),
            })
            .collect()
    };
    let calibration = slates(0);
    let with_steam = fuse::fit_pooled_decision(&calibration, 4, 10);
    let mut without_steam = fuse::fit_pooled_decision(&slates(1), 3, 10);
    without_steam.decision.weights.insert(0, 0.0);
    without_steam.mean.insert(0, 0.0);
    without_steam.sd.insert(0, 0.0);
    let over_slate = fuse::fit_decision(&calibration, 4, 10);
    let alone: Vec<fuse::Decision> = (0..4)
        .map(|k| {
            let one: Vec<Slate> = calibration
                .iter()
                .map(|sl| Slate {
                    scores: sl.scores.iter().map(|x| vec![x[k]]).collect(),
                    positive: sl.positive.clone(),
                })
                .collect();
            let mut d = fuse::fit_decision(&one, 1, 1);
            d.weights = (0..4).map(|j| f64::from(u8::from(j == k))).collect();
            d
        })
        .collect();
    let decisions = alone
        .iter()
        .zip(SLATE_Z)
        .chain([(&over_slate, FUSED_SLATE)]);
    for (d, name) in decisions {
        let yes = answers(&features, |f| {
            let rows: Vec<Vec<f64>> = f.iter().map(|x| x.to_vec()).collect();
            fuse::fuse(&d.weights, &rows)
                .into_iter()
                .map(|v| v >= d.threshold)
                .collect()
        });
        out.push((name, tally(s, &yes)));
    }
    for (d, name) in [(&with_steam, FUSED), (&without_steam, FUSED_NO_STEAM)] {
        let yes = answers(&features, |f| f.iter().map(|x| d.says_yes(x)).collect());
        out.push((name, tally(s, &yes)));
    }
    let mut all_yes = Vec::new();
    for cases in &s.cases {
        all_yes.push(cases.iter().map(|c| vec![true; c.items.len()]).collect());
    }
    out.push(("always yes", tally(s, &all_yes)));
    Ok((
        out,
        Fitted {
            pooled: [with_steam, without_steam],
            slate: over_slate,
        },
    ))
}

/// `sum += c`, element by element.
fn add(sum: &mut [usize; 3], c: [usize; 3]) {
    for (s, x) in sum.iter_mut().zip(c) {
        *s += x;
    }
}

/// Micro (precision, F1) at each ratio from summed counts.
fn micro(counts: &[Counts]) -> [(f64, f64); 3] {
    std::array::from_fn(|r| {
        let mut sum = [0usize; 3];
        for c in counts {
            add(&mut sum, c[r]);
        }
        precision_f1(sum)
    })
}

/// What [`summarise`] makes of the seeds' runs.
struct Summary {
    /// The markdown table.
    table: String,
    /// The point values, for the plot.
    series: Vec<Series>,
    /// Per method: per ratio (precision, F1, F1 low, F1 high).
    cells: Vec<(&'static str, [(f64, f64, f64, f64); 3])>,
    /// Per compared pair: (label, per ratio (difference, low, high)).
    diffs: Vec<(String, [(f64, f64, f64); 3])>,
}

/// The simulation's table: per method micro precision and F1 at each ratio
/// over the test users of every seed (a user drawn by several seeds counts
/// once, with its decisions summed), F1 with a 95% percentile-bootstrap
/// interval over users; then paired differences of F1.
fn summarise(per_seed: &[SeedRun], header: &str) -> Summary {
    use rand::Rng;
    let mut table = header.to_owned();
    let Some(first) = per_seed.first() else {
        return Summary {
            table,
            series: Vec::new(),
            cells: Vec::new(),
            diffs: Vec::new(),
        };
    };
    let names: Vec<&'static str> = first.iter().map(|m| m.0).collect();
    // The union of test users over the seeds, in id order.
    let mut units: BTreeMap<&str, usize> = BTreeMap::new();
    for run in per_seed {
        for (u, _) in &run[0].1 {
            units.insert(u.as_str(), 0);
        }
    }
    for (i, v) in units.values_mut().enumerate() {
        *v = i;
    }
    // `counts[method][unit]`.
    let counts: Vec<Vec<Counts>> = (0..names.len())
        .map(|m| {
            let mut by_unit = vec![[[0usize; 3]; 3]; units.len()];
            for run in per_seed {
                for (u, c) in &run[m].1 {
                    let at = &mut by_unit[units[u.as_str()]];
                    for (sum, x) in at.iter_mut().zip(c) {
                        add(sum, *x);
                    }
                }
            }
            by_unit
        })
        .collect();
    // Resampled F1 per method and ratio: `boot[method][ratio][resample]`.
    let n = units.len();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut boot = vec![vec![Vec::with_capacity(super::BOOTSTRAP_RESAMPLES); 3]; names.len()];
    let mut pick: Vec<Counts> = Vec::with_capacity(n);
    for _ in 0..super::BOOTSTRAP_RESAMPLES {
        let idx: Vec<usize> = (0..n).map(|_| rng.random_range(0..n)).collect();
        for (m, c) in counts.iter().enumerate() {
            pick.clear();
            pick.extend(idx.iter().map(|&i| c[i]));
            for (r, (_, f1)) in micro(&pick).into_iter().enumerate() {
                boot[m][r].push(f1);
            }
        }
    }
    let interval = |mut xs: Vec<f64>| -> (f64, f64) {
        xs.sort_by(f64::total_cmp);
        let at = |q: f64| xs[((q * (xs.len() - 1) as f64).round()) as usize];
        (at(0.025), at(0.975))
    };
    let mut cells = Vec::new();
    let mut series = Vec::new();
    for (m, name) in names.iter().enumerate() {
        let point = micro(&counts[m]);
        let cell: [(f64, f64, f64, f64); 3] = std::array::from_fn(|r| {
            let (lo, hi) = interval(boot[m][r].clone());
            (point[r].0, point[r].1, lo, hi)
        });
        table.push_str(&format!(
            "| {name} | {} |\n",
            cell.iter()
                .map(|(p, f, lo, hi)| format!("{p:.3} | {f:.3} [{lo:.3}, {hi:.3}]"))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        series.push(Series {
            name: (*name).to_owned(),
            values: cell.iter().flat_map(|c| [c.0, c.1]).collect(),
        });
        cells.push((*name, cell));
    }
    // Paired differences: the fused agent and STEAM alone against the best
    // baseline at each ratio, and the fused agent against its fit without STEAM.
    let at = |name: &str| names.iter().position(|n| *n == name);
    let mut diffs = Vec::new();
    // (label, method, the method compared with at each ratio, name those).
    let mut pairs: Vec<(String, usize, [usize; 3], bool)> = Vec::new();
    let best: [usize; 3] = std::array::from_fn(|r| {
        BASELINES
            .iter()
            .filter_map(|b| at(b))
            .max_by(|&a, &b| cells[a].1[r].1.total_cmp(&cells[b].1[r].1))
            .unwrap_or(0)
    });
    for name in [FUSED, "steamrf (STEAM)"] {
        if let Some(m) = at(name) {
            pairs.push((format!("{name} − best baseline"), m, best, true));
        }
    }
    if let (Some(a), Some(b)) = (at(FUSED), at(FUSED_NO_STEAM)) {
        pairs.push(("fused − fused w/o STEAM".to_owned(), a, [b; 3], false));
    }
    if let (Some(a), Some(b)) = (at(FUSED), at(FUSED_SLATE)) {
        pairs.push((
            "fused − fused z over the slate".to_owned(),
            a,
            [b; 3],
            false,
        ));
    }
    table.push_str("\nPaired differences of F1 (the same resampled users for both):\n\n| difference | 1:1 | 1:3 | 1:9 |\n| --- | ---: | ---: | ---: |\n");
    for (label, a, against, name_them) in pairs {
        let d: [(f64, f64, f64); 3] = std::array::from_fn(|r| {
            let b = against[r];
            let (lo, hi) = interval(
                boot[a][r]
                    .iter()
                    .zip(&boot[b][r])
                    .map(|(x, y)| x - y)
                    .collect(),
            );
            (cells[a].1[r].1 - cells[b].1[r].1, lo, hi)
        });
        let vs: Vec<&str> = against.iter().map(|&b| names[b]).collect();
        let vs = if !name_them {
            String::new()
        } else if vs.iter().all(|v| *v == vs[0]) {
            format!(" ({})", vs[0])
        } else {
            format!(" ({})", vs.join(" / "))
        };
        table.push_str(&format!(
            "| {label}{vs} | {} |\n",
            d.iter()
                .map(|(x, lo, hi)| format!("{x:+.3} [{lo:+.3}, {hi:+.3}]"))
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        diffs.push((label, d));
    }
    Summary {
        table,
        series,
        cells,
        diffs,
    }
}

/// Mean ± std per method and column over the seeds, as markdown rows, and
/// the means as plot series (the diversity task).
fn summarise_means(
    per_seed: &[Vec<(&'static str, Vec<f64>)>],
    header: &str,
) -> (String, Vec<Series>) {
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
    let needed = needed.into_iter().chain(ml_items(&catalogue)).collect();
    let (items, texts, took, tau) = embed_items(&e.embed, &catalogue, needed, &e.geometry).await?;
    let rec = recommend_params(tau, &e.scoring);
    let text = item_text(&texts);
    let bar = super::progress(e.seeds.len() * 10, "methods × seeds");
    let work: Vec<(&SimSample, u64)> = samples.iter().zip(e.seeds.iter().copied()).collect();
    let runs = super::on_threads(&work, |&(s, seed)| {
        simulate_one(s, &items, &text, (seed, tau, e.index_precision, rec), &bar)
    })?;
    let mut per_seed = Vec::new();
    let mut fitted = Vec::new();
    for ((run, fit), &seed) in runs.into_iter().zip(&e.seeds) {
        per_seed.push(run);
        fitted.push((seed, fit));
    }
    bar.finish_and_clear();
    let n_users: HashSet<&str> = per_seed
        .iter()
        .flat_map(|run| run[0].1.iter().map(|(u, _)| u.as_str()))
        .collect();
    let header = format!(
        "User simulation (AFL protocol), {}: {USERS} test users per seed ({} distinct over {} seeds), {SHOWN} items each; \
         every threshold (and the fused agent's weights) fitted at 1:1 on {USERS} other users per seed; \
         micro precision and F1 over all test decisions, F1 with a 95% bootstrap interval over users ({} resamples)\n\n\
         | method | P 1:1 | F1 1:1 | P 1:3 | F1 1:3 | P 1:9 | F1 1:9 |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        e.subset,
        n_users.len(),
        e.seeds.len(),
        super::BOOTSTRAP_RESAMPLES,
    );
    let mut summary = summarise(&per_seed, &header);
    summary.table.push_str("\nFused agents, fitted per seed on its calibration users (weights STEAM, item-item CF, BM25, popularity; threshold on the fused score; calibration F1 at 1:1). The declared agent standardises each signal over every calibration item; stop 36's over each slate:\n\n");
    for (seed, f) in &fitted {
        let [with, without] = &f.pooled;
        for (name, d) in [
            ("with STEAM", &with.decision),
            ("w/o STEAM", &without.decision),
            ("z over the slate", &f.slate),
        ] {
            summary.table.push_str(&format!(
                "- seed {seed}, {name}: weights {:?}, threshold {:.3}, calibration F1 {:.3}\n",
                d.weights, d.threshold, d.f1
            ));
        }
    }
    let file = super::write_table(
        &e.out,
        &format!("steam-simulation-{}.md", e.subset),
        &summary.table,
    )?;
    let png = plot::bars(
        &e.out.join(format!("steam-simulation-{}.png", e.subset)),
        &format!("User simulation (AFL protocol), {}", e.subset),
        "precision / F1",
        &["P 1:1", "F1 1:1", "P 1:3", "F1 1:3", "P 1:9", "F1 1:9"],
        &summary.series,
    )?;
    let mut out = report(
        "simulation",
        &e,
        (items.len(), took, tau),
        &summary.table,
        (&file, &png),
        started,
    );
    out.push(simulation_result(&summary));
    Ok(out)
}

/// The simulation's `RESULT` line: the declared configuration (the fused
/// agent) with F1 intervals, STEAM alone beside it, and the fused agent's
/// paired F1 difference to the best baseline at each ratio.
fn simulation_result(summary: &Summary) -> String {
    let cell = |name: &str| {
        summary
            .cells
            .iter()
            .find(|c| c.0 == name)
            .map_or([(0.0, 0.0, 0.0, 0.0); 3], |c| c.1)
    };
    let mut line = String::from("RESULT method=fused");
    let fused = cell(FUSED);
    for (r, m) in RATIOS.iter().enumerate() {
        let (p, f1, lo, hi) = fused[r];
        line.push_str(&format!(
            " precision_1_{m}={p:.4} f1_1_{m}={f1:.4} f1_1_{m}_ci95_low={lo:.4} f1_1_{m}_ci95_high={hi:.4}"
        ));
    }
    let steam = cell("steamrf (STEAM)");
    for (r, m) in RATIOS.iter().enumerate() {
        line.push_str(&format!(" steam_f1_1_{m}={:.4}", steam[r].1));
    }
    if let Some((_, d)) = summary.diffs.iter().find(|d| d.0.starts_with(FUSED)) {
        for (r, m) in RATIOS.iter().enumerate() {
            let (x, lo, hi) = d[r];
            line.push_str(&format!(
                " delta_f1_1_{m}={x:.4} delta_f1_1_{m}_ci95_low={lo:.4} delta_f1_1_{m}_ci95_high={hi:.4}"
            ));
        }
    }
    line
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
    (users, others): (&[User], &[User]),
    pool: &[String],
    train: &[(String, String)],
    (items, text): (&Items, &ItemText),
    meta: &HashMap<String, (String, String)>,
    (seed, tau, precision, rec): (u64, Option<f32>, RowPrecision, RecommendParams),
    bar: &indicatif::ProgressBar,
) -> Result<Vec<(&'static str, Vec<f64>)>> {
    // STEAM learns from the same interactions as popularity and item-item
    // CF: the users' histories and every other user's ratings.
    let learners: Vec<User> = users.iter().chain(others).cloned().collect();
    let states = steam_states(&learners, items, (tau, precision))?;
    let cf = item_cf(train);
    let knn = user_knn(train);
    let rankers: Vec<(&'static str, Ranker<'_>)> =
        rankers(&states, items, (&cf, &knn), text, seed, rec);
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
    // Per seed: users, the recommendation pool, the training interactions,
    // the users not under test (whom STEAM learns from too).
    type Run = (Vec<User>, Vec<String>, Vec<(String, String)>, Vec<User>);
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
                .map(|_| (us.clone(), pool.clone(), train.clone(), Vec::new()))
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
                    (s.users, pool, s.train, s.others)
                })
                .collect();
            ((meta, ML_TEMPLATE), runs)
        }
        other => return Err(bad(format!("unknown subset {other:?}"))),
    };
    let mut needed: Vec<String> = runs
        .iter()
        .flat_map(|(us, pool, _, _)| {
            pool.iter()
                .cloned()
                .chain(us.iter().flat_map(|u| u.history.iter().cloned()))
        })
        .collect();
    if e.subset.starts_with("ml100k") {
        needed.extend(ml_items(&catalogue));
    }
    let (items, texts, took, tau) = embed_items(&e.embed, &catalogue, needed, &e.geometry).await?;
    let rec = recommend_params(tau, &e.scoring);
    let text = item_text(&texts);
    let bar = super::progress(e.seeds.len() * 8, "methods × seeds");
    let work: Vec<(&Run, u64)> = runs.iter().zip(e.seeds.iter().copied()).collect();
    let per_seed = super::on_threads(&work, |&((us, pool, train, others), seed)| {
        let pool: Vec<String> = pool
            .iter()
            .filter(|i| items.contains_key(*i))
            .cloned()
            .collect();
        diversity_one(
            (us, others),
            &pool,
            train,
            (&items, &text),
            &catalogue.0,
            (seed, tau, e.index_precision, rec),
            &bar,
        )
    })?;
    bar.finish_and_clear();
    let (table, series) = summarise_means(
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
    fn micro_precision_and_f1_count_every_decision() {
        assert_eq!(precision_f1([1, 1, 1]), (0.5, 0.5));
        assert_eq!(precision_f1([0, 0, 1]), (0.0, 0.0));
        // Two users at 1:1: 2 TP + 1 FP, then 1 FN: P 2/3, F1 4/6.
        let a: Counts = [[2, 1, 0], [0; 3], [0; 3]];
        let b: Counts = [[0, 0, 1], [0; 3], [0; 3]];
        let [(p, f1), _, _] = micro(&[a, b]);
        assert!((p - 2.0 / 3.0).abs() < 1e-12 && (f1 - 4.0 / 6.0).abs() < 1e-12);
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
        // STEAM learns from every other user, all of its ratings.
        assert_eq!(s.others.len(), 250 - 2 * USERS);
        assert!(s.others.iter().all(|o| o.history.len() == 30));
        assert!(
            s.others
                .iter()
                .all(|o| s.users.iter().all(|u| u.id != o.id))
        );
    }

    #[test]
    fn the_summary_pools_users_over_seeds_and_pairs_the_differences() {
        // Two seeds; "a" answers every user right, "b" misses each user's
        // positive at 1:1. User "u0" is drawn by both seeds.
        let right: Counts = [[1, 0, 0], [1, 0, 0], [1, 0, 0]];
        let wrong: Counts = [[0, 1, 1], [1, 0, 0], [1, 0, 0]];
        let run = |users: &[&str]| -> SeedRun {
            ["a", "popularity"]
                .into_iter()
                .zip([right, wrong])
                .map(|(m, c)| (m, users.iter().map(|u| ((*u).to_owned(), c)).collect()))
                .collect()
        };
        let s = summarise(&[run(&["u0", "u1"]), run(&["u0", "u2"])], "");
        let a = s.cells[0].1;
        assert_eq!((a[0].0, a[0].1, a[0].2, a[0].3), (1.0, 1.0, 1.0, 1.0));
        let b = s.cells[1].1;
        assert_eq!((b[0].0, b[0].1), (0.0, 0.0));
        assert_eq!(b[1].1, 1.0);
        // No fused row here: no difference rows either, and no panic.
        assert!(s.diffs.is_empty());
        assert!(
            s.table.contains("| a | 1.000 | 1.000 [1.000, 1.000]"),
            "{}",
            s.table
        );
    }
}
