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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use steamrf_kernels::cpu::CpuKernel;
use steamrf_operators::fuse::{self, Fit};
use steamrf_operators::lexical::Bm25Params;
use steamrf_operators::rank::{self, ItemCf, ItemText, RankParams, UserKnn, Weights};
use steamrf_operators::steam::memory::{EvolveParams, Observation};
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_operators::steam::retrieve::{MemoryView, RecommendParams, recommend};
use steamrf_operators::steam::{MemoryId, Prototype};
use steamrf_operators::steam::{SteamParams, SteamState};
use steamrf_schemas::{Event, decode};

use steamrf_pipelines::config::EmbedConfig;
use steamrf_pipelines::error::{Error, Result};

/// Options of `steamrf eval steam`.
#[derive(Debug, Clone)]
pub struct SteamEval {
    /// The amazon_cds_agentcf directory, or ml-100k's.
    pub data: PathBuf,
    /// cds-dense, cds-sparse, ml100k-catalogue (negatives from the whole
    /// catalogue), ml100k-users (negatives from the sampled users' items) or
    /// ml100k-paper (the paper's sample: 5 history ratings and the target
    /// per user, nothing else learned from).
    pub subset: String,
    /// Shuffle seeds.
    pub seeds: Vec<u64>,
    /// The embedder.
    pub embed: EmbedConfig,
    /// Where the markdown table and the plot go.
    pub out: PathBuf,
    /// ranking, simulation (the AFL protocol) or diversity.
    pub task: String,
    /// Where to write the fused ranker's fitted weights as a config file
    /// (`[serve.ranker]`), for `steamrf serve -c`.
    pub fit_out: Option<PathBuf>,
    /// The embedding-geometry ablation; the default is the paper's set-up.
    pub geometry: Geometry,
    /// Overrides of `recommend`'s neighbours term (the defaults otherwise).
    pub scoring: Scoring,
    /// Stop after the fused ranker's validation fit (ranking only): print
    /// each signal's and the fits' validation NDCG@10; no test user is
    /// scored. What STEAM's parameters are chosen with.
    pub fit_only: bool,
}

/// Overrides of `recommend`'s neighbours(c) term (`RecommendParams`), for
/// the ablation and the validation sweep that chose its defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scoring {
    /// δ (default `RecommendParams::default().neighbour_weight`).
    pub neighbour_weight: Option<f32>,
    /// k_n (default `RecommendParams::default().k_neighbours`).
    pub k_neighbours: Option<usize>,
}

/// The embedding-geometry ablation (issue 17; `steam::geometry` in the
/// operators explains why): how item texts are written, whether item
/// vectors are mean-centred, and whether τ is read off the distribution of
/// item-item cosines.
#[derive(Debug, Clone, Copy, Default)]
pub struct Geometry {
    /// Item text `"{title}. {category}"` instead of the data set's sentence
    /// template (the AgentCF and STEAM prompts' wording).
    pub plain_text: bool,
    /// Mean-centre the item vectors over the items the run embeds.
    pub centre: bool,
    /// τ for formation, links and recommendation alike (the paper uses one
    /// τ) = this quantile of the item-item cosines; `None`: the paper's 0.5.
    pub tau_quantile: Option<f32>,
}

impl Geometry {
    /// One line for the report.
    pub(super) fn describe(&self, tau: Option<f32>) -> String {
        format!(
            "item text {}, {}, τ {}",
            if self.plain_text {
                "plain"
            } else {
                "templated"
            },
            if self.centre {
                "mean-centred"
            } else {
                "not centred"
            },
            match (self.tau_quantile, tau) {
                (Some(q), Some(t)) => format!("{t:.3} (the {q} quantile of item-item cosines)"),
                _ => format!("{} (the paper's)", SteamParams::default().link_tau),
            }
        )
    }
}

/// Pairs of items the τ quantile is read from (the first items by id): all
/// of ML-100K's 1,682 items are ~1.4M pairs.
const TAU_PAIRS: usize = 1_500_000;

#[derive(Clone)]
pub(super) struct User {
    pub(super) id: String,
    pub(super) history: Vec<String>,
    pub(super) target: String,
    pub(super) negatives: Vec<String>,
}

pub(super) fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        context: format!("reading {}", path.display()),
        source,
    })
}

pub(super) fn bad(what: String) -> Error {
    Error::Config {
        problems: vec![format!("CDs data: {what}")],
    }
}

/// The users of one sample: test.inter gives history and target, .random the
/// negatives. A negative is an item the user never interacted with: the
/// `.random` items that are the target or in the history are dropped (24 of
/// the 100 dense users have history items there), and the nine are made up
/// with items of the sample's `.random` pool drawn with a seed per user.
pub(super) fn users(dir: &Path, name: &str) -> Result<Vec<User>> {
    users_of_split(dir, name, "test")
}

/// [`users`] from `{name}.{split}.inter`: `valid` predicts the 7th item from
/// the first 6 (AgentCF's validation split, where anything is tuned); its
/// negatives also avoid the user's test target.
pub(super) fn users_of_split(dir: &Path, name: &str, split: &str) -> Result<Vec<User>> {
    let later: HashMap<String, String> = if split == "test" {
        HashMap::new()
    } else {
        read(&dir.join(format!("{name}.test.inter")))?
            .lines()
            .skip(1)
            .filter_map(|l| {
                let f: Vec<&str> = l.split('\t').collect();
                Some((f.first()?.to_string(), f.get(2)?.to_string()))
            })
            .collect()
    };
    let random: HashMap<String, Vec<String>> = read(&dir.join(format!("{name}.random")))?
        .lines()
        .filter_map(|l| {
            let mut it = l.split('\t');
            let u = it.next()?.to_owned();
            Some((
                u,
                it.next()?.split_whitespace().map(str::to_owned).collect(),
            ))
        })
        .collect();
    // Every item of the sample's candidate lists, sorted: where negatives
    // are re-drawn from.
    let pool: Vec<String> = random
        .values()
        .flatten()
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut out = Vec::new();
    for l in read(&dir.join(format!("{name}.{split}.inter")))?
        .lines()
        .skip(1)
    {
        let f: Vec<&str> = l.split('\t').collect();
        let [u, hist, target] = f[..] else {
            return Err(bad(format!("bad {split}.inter line {l:?}")));
        };
        let history: Vec<String> = hist.split_whitespace().map(str::to_owned).collect();
        let mut seen: HashSet<&str> = history.iter().map(String::as_str).collect();
        seen.insert(target);
        if let Some(t) = later.get(u) {
            seen.insert(t);
        }
        let mut negatives: Vec<String> = Vec::with_capacity(9);
        for i in random
            .get(u)
            .ok_or_else(|| bad(format!("user {u} missing from .random")))?
        {
            if negatives.len() < 9 && !seen.contains(i.as_str()) && !negatives.contains(i) {
                negatives.push(i.clone());
            }
        }
        if negatives.len() < 9 {
            let mut excluded = seen.clone();
            excluded.extend(negatives.iter().map(String::as_str));
            let pool: Vec<&str> = pool.iter().map(String::as_str).collect();
            let left = pool.iter().filter(|i| !excluded.contains(*i)).count();
            if left < 9 - negatives.len() {
                return Err(bad(format!(
                    "user {u}: too few items they never interacted with for 9 negatives"
                )));
            }
            let mut rng = StdRng::seed_from_u64(user_seed(u));
            let more = unseen(&mut rng, &pool, &excluded, 9 - negatives.len());
            negatives.extend(more);
        }
        out.push(User {
            id: u.to_owned(),
            history,
            target: target.to_owned(),
            negatives,
        });
    }
    Ok(out)
}

/// A seed of a user id (FNV-1a), so re-drawn negatives do not depend on the
/// order users are read in.
fn user_seed(user: &str) -> u64 {
    user.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn ndcg_at(rank: usize, k: usize) -> f64 {
    if rank < k {
        1.0 / ((rank + 2) as f64).log2()
    } else {
        0.0
    }
}

/// A ranker: candidates (in the shuffled order) → scores (higher is better;
/// ties keep the shuffled order).
pub(super) type Ranker<'a> = Box<dyn Fn(&User, &[String]) -> Vec<f64> + 'a>;

pub(super) type Items = HashMap<String, (String, String, Vec<f32>)>;

/// The STEAM state with the evaluation's catalogue, as the service's view
/// has the items table: what `RecommendParams::item_weight` reads.
pub(super) struct Catalogued<'a> {
    pub(super) state: &'a SteamState,
    pub(super) items: &'a Items,
}

impl MemoryView for Catalogued<'_> {
    fn user(&self, user_id: &str) -> Option<&UserMemories> {
        self.state.user(user_id)
    }
    fn community_of(&self, m: MemoryId) -> Option<MemoryId> {
        MemoryView::community_of(self.state, m)
    }
    fn prototype(&self, c: MemoryId) -> Option<&Prototype> {
        self.state.prototype(c)
    }
    fn memory(&self, id: MemoryId) -> Option<&Memory> {
        self.state.memory(id)
    }
    fn tenant_separator(&self) -> Option<char> {
        self.state.params().tenant_separator
    }
    fn item_vector(&self, item: &str) -> Option<&[f32]> {
        self.items.get(item).map(|(_, _, e)| e.as_slice())
    }
}

/// Ranks by `recommend` over the STEAM state and the catalogue.
pub(super) fn steam_ranker<'a>(
    state: &'a SteamState,
    items: &'a Items,
    p: RecommendParams,
) -> Ranker<'a> {
    Box::new(move |u: &User, cands: &[String]| {
        let c: Vec<(String, Vec<f32>)> = cands
            .iter()
            .filter_map(|i| items.get(i).map(|(_, _, e)| (i.clone(), e.clone())))
            .collect();
        let view = Catalogued { state, items };
        let ranked = recommend(&view, &u.id, &c, &p);
        let score: HashMap<&str, f64> = ranked
            .iter()
            .map(|r| (r.item_id.as_str(), f64::from(r.score)))
            .collect();
        cands
            .iter()
            .map(|i| score.get(i.as_str()).copied().unwrap_or(f64::MIN))
            .collect()
    })
}

/// Runs STEAM's operators over every user's history and returns the state.
pub(super) fn steam_state(
    users: &[User],
    items: &Items,
    params: SteamParams,
) -> Result<SteamState> {
    let mut state = SteamState::new(params, steamrf_schemas::tables::EMBEDDING_DIM);
    let kernel = CpuKernel::default();
    // Position by position (t = 0..6), all users' events of a position form
    // one micro-batch, as a stream would deliver them.
    let len = users.iter().map(|u| u.history.len()).max().unwrap_or(0);
    for t in 0..len {
        let mut lines = Vec::new();
        for u in users {
            if let Some(item) = u.history.get(t) {
                lines.push(serde_json::json!({
                    "schema_version": 1, "type": "click",
                    "event_id": format!("{}-{t}", u.id), "timestamp": 1_700_000_000_000i64 + t as i64 * 1000,
                    "user_id": u.id, "item_id": item,
                }).to_string());
            }
        }
        let mut batch = Vec::new();
        for l in &lines {
            let Event::Interaction(e) = decode(l.as_bytes()).map_err(|e| Error::Internal {
                message: format!("an eval event did not decode: {e}"),
            })?
            else {
                continue;
            };
            let item = e.item_id.as_deref().unwrap_or_default();
            let Some((title, category, emb)) = items.get(item) else {
                continue;
            };
            batch.push((
                e.user_id.to_string(),
                Observation {
                    event_id: e.event_id.to_string(),
                    timestamp_ms: e.timestamp_ms,
                    embedding: emb.clone(),
                    item_id: Some(item.to_owned()),
                    title: Some(title.clone()),
                    categories: category.split("; ").map(str::to_owned).collect(),
                    text: None,
                },
            ));
        }
        let o = state.observe(batch).map_err(|e| Error::Internal {
            message: e.to_string(),
        })?;
        state
            .link(&kernel, &o.changed)
            .map_err(|e| Error::Internal {
                message: e.to_string(),
            })?;
    }
    Ok(state)
}

/// One evaluation sample: the users, and the training interactions
/// (user, item) that popularity and item-item CF learn from.
#[derive(Clone)]
pub(super) struct Sample {
    pub(super) users: Vec<User>,
    pub(super) train: Vec<(String, String)>,
    /// The users not under test, each with every interaction as its
    /// history: STEAM learns from them too, as popularity and item-item CF
    /// learn from `train` (ML-100K; the CDs samples have none).
    pub(super) others: Vec<User>,
}

/// Items' titles and categories, and (user, item, timestamp) ratings.
pub(super) type MovieLens = (
    HashMap<String, (String, String)>,
    Vec<(String, String, i64)>,
);

/// MovieLens-100K: u.item (Latin-1; title and genre flags) and u.data.
pub(super) fn movielens(dir: &Path) -> Result<MovieLens> {
    let genres: Vec<String> = read(&dir.join("u.genre"))?
        .lines()
        .filter_map(|l| l.split('|').next().map(str::to_owned))
        .filter(|g| !g.is_empty())
        .collect();
    let raw = std::fs::read(dir.join("u.item")).map_err(|source| Error::Io {
        context: format!("reading {}", dir.join("u.item").display()),
        source,
    })?;
    // Latin-1: every byte is the code point of the same value.
    let text: String = raw.iter().map(|&b| b as char).collect();
    let mut meta = HashMap::new();
    for l in text.lines() {
        let f: Vec<&str> = l.split('|').collect();
        if f.len() < 6 {
            continue;
        }
        let gs: Vec<&str> = f[5..]
            .iter()
            .zip(&genres)
            .filter(|(flag, _)| **flag == "1")
            .map(|(_, g)| g.as_str())
            .collect();
        meta.insert(f[0].to_owned(), (f[1].to_owned(), gs.join("; ")));
    }
    let mut ratings = Vec::new();
    for l in read(&dir.join("u.data"))?.lines() {
        let f: Vec<&str> = l.split('\t').collect();
        if let [u, i, _, ts] = f[..] {
            ratings.push((u.to_owned(), i.to_owned(), ts.parse().unwrap_or(0)));
        }
    }
    Ok((meta, ratings))
}

/// Each user's ratings in time order; timestamp ties break by item id,
/// numerically (ML-100K's ids are numbers).
pub(super) fn histories(ratings: &[(String, String, i64)]) -> BTreeMap<&str, Vec<(i64, &str)>> {
    let mut by_user: BTreeMap<&str, Vec<(i64, &str)>> = BTreeMap::new();
    for (u, i, ts) in ratings {
        by_user.entry(u).or_default().push((*ts, i));
    }
    for v in by_user.values_mut() {
        let num = |i: &str| (i.parse::<u64>().unwrap_or(u64::MAX), i.to_owned());
        v.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| num(a.1).cmp(&num(b.1))));
    }
    by_user
}

/// Where negatives come from: the sampled users' items, or the catalogue.
pub(super) fn negative_pool<'a>(
    by_user: &BTreeMap<&'a str, Vec<(i64, &'a str)>>,
    ids: &[&str],
    meta: &'a HashMap<String, (String, String)>,
    from_users: bool,
) -> Vec<&'a str> {
    let mut p: Vec<&str> = if from_users {
        ids.iter()
            .flat_map(|u| by_user[u].iter().map(|x| x.1))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect()
    } else {
        meta.keys().map(String::as_str).collect()
    };
    p.sort_unstable();
    p
}

/// `n` distinct items of `pool` the user never rated.
pub(super) fn unseen(
    rng: &mut StdRng,
    pool: &[&str],
    seen: &HashSet<&str>,
    n: usize,
) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(n);
    while out.len() < n {
        let c = pool[rand::Rng::random_range(rng, 0..pool.len())];
        if !seen.contains(c) && !out.iter().any(|x| x == c) {
            out.push(c.to_owned());
        }
    }
    out
}

/// 100 users drawn with `seed`; each user's last rating (by timestamp, then
/// item id) is the target, the earlier ones the history; 9 negatives the
/// user never rated, from the whole catalogue or from the sampled users' items.
pub(super) fn ml_sample(
    ratings: &[(String, String, i64)],
    meta: &HashMap<String, (String, String)>,
    seed: u64,
    from_users: bool,
) -> Sample {
    ml_sample_holding(ratings, meta, seed, from_users, 1)
}

/// The validation split of [`ml_sample`] (where anything is fitted): the
/// same users, each predicting its second-to-last rating from the ones
/// before; the last rating (the test target) is in no one's training data.
pub(super) fn ml_valid_sample(
    ratings: &[(String, String, i64)],
    meta: &HashMap<String, (String, String)>,
    seed: u64,
    from_users: bool,
) -> Sample {
    ml_sample_holding(ratings, meta, seed, from_users, 2)
}

/// [`ml_sample`] whose target is each user's `held`-th rating from the end;
/// the ratings from the target on are held out of the training data.
fn ml_sample_holding(
    ratings: &[(String, String, i64)],
    meta: &HashMap<String, (String, String)>,
    seed: u64,
    from_users: bool,
    held: usize,
) -> Sample {
    let by_user = histories(ratings);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids: Vec<&str> = by_user.keys().copied().collect();
    ids.shuffle(&mut rng);
    ids.truncate(100);
    ids.sort_unstable();
    let pool = negative_pool(&by_user, &ids, meta, from_users);
    let mut users = Vec::new();
    let mut held_out = HashSet::new();
    for u in &ids {
        let v = &by_user[u];
        if v.len() < held {
            continue;
        }
        let cut = v.len() - held;
        let target = v[cut].1;
        // Negatives avoid every item the user rated, held-out ones included.
        let seen: HashSet<&str> = v.iter().map(|x| x.1).collect();
        let negatives = unseen(&mut rng, &pool, &seen, 9);
        held_out.extend(v[cut..].iter().map(|x| (*u, x.1)));
        users.push(User {
            id: (*u).to_owned(),
            history: v[..cut].iter().map(|x| x.1.to_owned()).collect(),
            target: target.to_owned(),
            negatives,
        });
    }
    let train = ratings
        .iter()
        .filter(|(u, i, _)| !held_out.contains(&(u.as_str(), i.as_str())))
        .map(|(u, i, _)| (u.clone(), i.clone()))
        .collect();
    Sample {
        users,
        train,
        others: others_of(&by_user, &ids),
    }
}

/// Every user of `by_user` not in `sampled`, with all its ratings as its
/// history (what STEAM learns from beside the users under test), in id
/// order.
pub(super) fn others_of(by_user: &BTreeMap<&str, Vec<(i64, &str)>>, sampled: &[&str]) -> Vec<User> {
    let sampled: HashSet<&str> = sampled.iter().copied().collect();
    // A BTreeMap iterates in key order: the result is sorted by id.
    by_user
        .iter()
        .filter(|(u, _)| !sampled.contains(*u))
        .map(|(u, v)| User {
            id: (*u).to_owned(),
            history: v.iter().map(|x| x.1.to_owned()).collect(),
            target: String::new(),
            negatives: Vec::new(),
        })
        .collect()
}

/// The STEAM paper's ML-100K sample (its Table 1: 100 users, 600
/// interactions): each user keeps its last 6 ratings, 5 as the history and
/// the target, and every method learns from those 500 history ratings only.
/// Negatives stay items the user never rated, from the sampled users' items.
pub(super) fn paper_sample(mut s: Sample) -> Sample {
    for u in &mut s.users {
        let cut = u.history.len().saturating_sub(PAPER_HISTORY);
        u.history.drain(..cut);
    }
    s.train = s
        .users
        .iter()
        .flat_map(|u| u.history.iter().map(|h| (u.id.clone(), h.clone())))
        .collect();
    s.others.clear();
    s
}

/// History length of [`paper_sample`].
const PAPER_HISTORY: usize = 5;

/// The STEAM states of the full method, w/o MC and w/o AMU.
pub(super) fn steam_states(
    users: &[User],
    items: &Items,
    tau: Option<f32>,
) -> Result<[SteamState; 3]> {
    let [full, no_mc, no_amu] = ablations(tau);
    Ok([
        steam_state(users, items, full)?,
        steam_state(users, items, no_mc)?,
        steam_state(users, items, no_amu)?,
    ])
}

/// A deterministic pseudo-random score in [0, 1) of (seed, user, item).
fn noise(seed: u64, user: &str, item: &str) -> f64 {
    // FNV-1a over the bytes, then splitmix64's finaliser.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in user.bytes().chain([0xff]).chain(item.bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (h ^ (h >> 31)) as f64 / 2f64.powi(64)
}

/// One signal of the recommendation ranker ([`rank::features`], the code
/// `/v1/recommend` runs) as a ranker: `column` of its features, with the
/// STEAM score left at 0.
fn signal<'a>(cf: Option<&'a ItemCf>, text: Option<&'a ItemText>, column: usize) -> Ranker<'a> {
    Box::new(move |u: &User, c: &[String]| {
        let history: Vec<&str> = u.history.iter().map(String::as_str).collect();
        let cands: Vec<&str> = c.iter().map(String::as_str).collect();
        let signals = rank::Signals { item_cf: cf, text };
        rank::features(
            &vec![0.0; c.len()],
            &history,
            &cands,
            signals,
            RankParams::default(),
        )
        .into_iter()
        .map(|f| f[column])
        .collect()
    })
}

/// steamrf (states: full, w/o MC, w/o AMU) with its ablations, and the
/// baselines, each as a scorer of candidates.
pub(super) fn rankers<'a>(
    states: &'a [SteamState; 3],
    items: &'a Items,
    (cf, knn): (&'a ItemCf, &'a UserKnn),
    text: &'a ItemText,
    seed: u64,
    rec: RecommendParams,
) -> Vec<(&'static str, Ranker<'a>)> {
    vec![
        ("steamrf (STEAM)", steam_ranker(&states[0], items, rec)),
        (
            "steamrf w/o CC",
            steam_ranker(&states[0], items, without_cc(rec)),
        ),
        (
            NO_NEIGHBOURS,
            steam_ranker(
                &states[0],
                items,
                RecommendParams {
                    neighbour_weight: 0.0,
                    ..rec
                },
            ),
        ),
        ("steamrf w/o MC", steam_ranker(&states[1], items, rec)),
        ("steamrf w/o AMU", steam_ranker(&states[2], items, rec)),
        (
            "steamrf per-item w=0.5",
            steam_ranker(
                &states[0],
                items,
                RecommendParams {
                    item_weight: 0.5,
                    ..rec
                },
            ),
        ),
        (
            "steamrf per-item w=1",
            steam_ranker(
                &states[0],
                items,
                RecommendParams {
                    item_weight: 1.0,
                    ..rec
                },
            ),
        ),
        (
            "random",
            Box::new(move |u: &User, c: &[String]| {
                c.iter().map(|i| noise(seed, &u.id, i)).collect()
            }),
        ),
        ("popularity", popularity(cf)),
        ("item-item CF", signal(Some(cf), None, 1)),
        ("BM25 (item text)", signal(None, Some(text), 2)),
        (
            USER_KNN,
            Box::new(|u: &User, c: &[String]| {
                let c: Vec<&str> = c.iter().map(String::as_str).collect();
                knn.scores(&u.id, &c, USER_KNN_K)
            }),
        ),
    ]
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

/// Ranks by the candidates' users in the training interactions.
fn popularity(cf: &ItemCf) -> Ranker<'_> {
    Box::new(|_u: &User, c: &[String]| c.iter().map(|i| cf.popularity(i)).collect())
}

/// The fused ranker's signals alone, in the order of [`FUSED_FEATURES`]:
/// what a fit needs, without the ablation states.
fn feature_rankers<'a>(
    state: &'a SteamState,
    items: &'a Items,
    cf: &'a ItemCf,
    text: &'a ItemText,
    rec: RecommendParams,
) -> Vec<(&'static str, Ranker<'a>)> {
    vec![
        (FUSED_FEATURES[0], steam_ranker(state, items, rec)),
        (FUSED_FEATURES[1], signal(Some(cf), None, 1)),
        (FUSED_FEATURES[2], signal(None, Some(text), 2)),
        (FUSED_FEATURES[3], popularity(cf)),
    ]
}

/// Per method (name, per user [NDCG@1, @5, @10] in the sample's user
/// order), and the memory counts (full, w/o MC, w/o AMU, published
/// prototypes).
type Evaluated = (
    Vec<(&'static str, Vec<[f64; 3]>)>,
    (usize, usize, usize, usize),
);

/// The rankers the fused ranker combines, in the order of [`rank::SIGNALS`].
const FUSED_FEATURES: [&str; 4] = [
    "steamrf (STEAM)",
    "item-item CF",
    "BM25 (item text)",
    "popularity",
];

/// User-user CF over the training interactions: the behavioural
/// counterpart of STEAM's neighbours(c), shown beside the baselines the
/// issue names (it is not one of them, so not in [`BASELINES`]).
pub(super) const USER_KNN: &str = "user-kNN CF (reference)";

/// Its neighbours: STEAM's k_n default, not tuned.
const USER_KNN_K: usize = 20;

/// STEAM with the paper's score: no neighbours(c) term (δ = 0).
const NO_NEIGHBOURS: &str = "steamrf w/o neighbours (δ = 0, the paper's score)";

/// The fused ranker's row name.
const FUSED: &str = "steamrf fused (STEAM + CF + BM25 + popularity, fit on valid)";

/// The same fit without STEAM: what STEAM's share is worth.
const FUSED_NO_STEAM: &str = "fused w/o STEAM (CF + BM25 + popularity, fit on valid)";

/// Every method's scores for each user's candidates: `[method][user][candidate]`.
fn score_all(
    rankers: &[(&'static str, Ranker<'_>)],
    users: &[User],
    cands: &[Vec<String>],
) -> Vec<Vec<Vec<f64>>> {
    rankers
        .iter()
        .map(|(_, rank)| users.iter().zip(cands).map(|(u, c)| rank(u, c)).collect())
        .collect()
}

/// The positions of [`FUSED_FEATURES`] among `names`.
pub(super) fn feature_rows(names: &[&str]) -> Result<[usize; 4]> {
    let mut rows = [0; 4];
    for (row, f) in rows.iter_mut().zip(FUSED_FEATURES) {
        *row = names
            .iter()
            .position(|n| *n == f)
            .ok_or_else(|| bad(format!("no {f} ranker to fuse")))?;
    }
    Ok(rows)
}

/// [`rank::features`] of one user's candidates, from `[method][user][candidate]`
/// scores (whose signal rows are that function's columns).
pub(super) fn features_of(
    scores: &[Vec<Vec<f64>>],
    rows: &[usize; 4],
    user: usize,
) -> Vec<[f64; 4]> {
    (0..scores[rows[0]][user].len())
        .map(|c| rows.map(|r| scores[r][user][c]))
        .collect()
}

/// The fused ranker's weights, and the same fit with STEAM left out.
pub(super) struct Fitted {
    /// All four signals.
    pub(super) with_steam: Fit,
    /// STEAM's weight held at 0.
    pub(super) without_steam: Fit,
    /// Each signal alone, in the order of [`FUSED_FEATURES`]: validation NDCG@10.
    pub(super) alone: Vec<f64>,
}

/// Fits the fused ranker's weights on a validation sample (its own STEAM
/// state, item-CF counts and histories: nothing of the test split).
pub(super) fn fit_fused(
    valid: &Sample,
    items: &Items,
    text: &ItemText,
    (tau, rec): (Option<f32>, RecommendParams),
) -> Result<Fitted> {
    let learners: Vec<User> = valid.users.iter().chain(&valid.others).cloned().collect();
    // Only the full state: the ablations are table rows, not features.
    let state = steam_state(&learners, items, ablations(tau)[0])?;
    let cf = item_cf(&valid.train);
    let rankers = feature_rankers(&state, items, &cf, text, rec);
    let cands: Vec<Vec<String>> = valid
        .users
        .iter()
        .map(|u| {
            let mut c = u.negatives.clone();
            c.push(u.target.clone());
            c
        })
        .collect();
    let scores = score_all(&rankers, &valid.users, &cands);
    let names: Vec<&str> = rankers.iter().map(|r| r.0).collect();
    let rows = feature_rows(&names)?;
    // The fit's queries over the feature columns `cols`.
    let queries = |cols: std::ops::Range<usize>| -> Vec<fuse::Query> {
        (0..valid.users.len())
            .map(|u| fuse::Query {
                scores: features_of(&scores, &rows, u)
                    .into_iter()
                    .map(|f| f[cols.clone()].to_vec())
                    .collect(),
                target: cands[u].len() - 1,
            })
            .collect()
    };
    // Each signal alone on the validation split (what a choice of STEAM's
    // parameters is read from: `--fit-only`).
    let alone: Vec<f64> = (0..4)
        .map(|col| fuse::fit(&queries(col..col + 1), 1, 10).ndcg10)
        .collect();
    let with_steam = fuse::fit(&queries(0..4), 4, 10);
    let mut without_steam = fuse::fit(&queries(1..4), 3, 10);
    without_steam.weights.insert(0, 0.0);
    Ok(Fitted {
        with_steam,
        without_steam,
        alone,
    })
}

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

/// User-user CF over `train`'s (user, item) pairs.
pub(super) fn user_knn(train: &[(String, String)]) -> UserKnn {
    UserKnn::new(train.iter().map(|(u, i)| (u.as_str(), i.as_str())))
}

/// Users per item from the training interactions.
pub(super) fn item_cf(train: &[(String, String)]) -> ItemCf {
    ItemCf::new(train.iter().map(|(u, i)| (u.as_str(), i.as_str())))
}

/// BM25 over the items' texts.
pub(super) fn item_text(texts: &HashMap<String, String>) -> ItemText {
    ItemText::new(
        texts.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        Bm25Params::default(),
    )
}

/// Every method on one sample; with `fused` weights also the fused ranker
/// and its fit without STEAM.
fn evaluate(
    sample: &Sample,
    items: &Items,
    text: &ItemText,
    seed: u64,
    fused: Option<&Fitted>,
    (tau, rec): (Option<f32>, RecommendParams),
) -> Result<Evaluated> {
    let users = &sample.users;
    // STEAM learns from the same interactions as the baselines: the test
    // users' histories and every other user's.
    let learners: Vec<User> = users.iter().chain(&sample.others).cloned().collect();
    let states = steam_states(&learners, items, tau)?;
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

/// Runs the evaluation (`e.task`: ranking, simulation or diversity).
///
/// # Errors
/// Missing data or embedding failures.
pub async fn steam(e: SteamEval) -> Result<Vec<String>> {
    if e.fit_only && e.task != "ranking" {
        return Err(Error::Config {
            problems: vec![format!(
                "--fit-only: only the ranking task has a fused ranker to fit (got --task {})",
                e.task
            )],
        });
    }
    match e.task.as_str() {
        "ranking" => ranking(e).await,
        "simulation" => super::simulate::simulation(e).await,
        "diversity" => super::simulate::diversity(e).await,
        other => Err(bad(format!(
            "unknown task {other:?} (ranking, simulation, diversity)"
        ))),
    }
}

/// Item id → (title, category), and the text template of a data set.
pub(super) type Catalogue = (HashMap<String, (String, String)>, &'static str);

/// The items an ML-100K run embeds: the whole catalogue (1,682 movies),
/// whatever users the seeds draw. The mean-centring of the item vectors, the
/// τ quantile and BM25's idf are then the same for every choice of seeds,
/// and every user STEAM learns from keeps its whole history (an item
/// without a vector is dropped from STEAM's events, while item-item CF
/// would still count it).
pub(super) fn ml_items(catalogue: &Catalogue) -> impl Iterator<Item = String> + '_ {
    catalogue.0.keys().cloned()
}

/// The AgentCF CDs items (`CDs.item`) and their text template.
pub(super) fn cds_catalogue(data: &Path) -> Result<Catalogue> {
    let mut meta = HashMap::new();
    for l in read(&data.join("CDs.item"))?.lines().skip(1) {
        let f: Vec<&str> = l.split('\t').collect();
        if f.len() >= 2 {
            meta.insert(
                f[0].to_owned(),
                (f[1].to_owned(), f.get(2).copied().unwrap_or("").to_owned()),
            );
        }
    }
    Ok((
        meta,
        "The CD is called '{title}'. The category of this CD is: '{category}'.",
    ))
}

/// MovieLens' text template.
pub(super) const ML_TEMPLATE: &str = "The movie is called '{title}'. Its genres are: '{category}'.";

/// Embeds the items `ids` (those with metadata) with the configured
/// embedder, in the given `geometry`; returns them, their texts, the
/// seconds it took and τ if the geometry reads it off the cosines.
pub(super) async fn embed_items(
    embed: &EmbedConfig,
    (meta, template): &Catalogue,
    mut ids: Vec<String>,
    geometry: &Geometry,
) -> Result<(Items, HashMap<String, String>, f64, Option<f32>)> {
    ids.retain(|i| meta.contains_key(i));
    ids.sort();
    ids.dedup();
    let texts: HashMap<String, String> = ids
        .iter()
        .map(|i| {
            let (t, c) = &meta[i];
            let text = if geometry.plain_text {
                format!("{t}. {c}")
            } else {
                template.replace("{title}", t).replace("{category}", c)
            };
            (i.clone(), text)
        })
        .collect();
    let embedder = steamrf_pipelines::embed::embedder(embed)?.ok_or_else(|| Error::Config {
        problems: vec!["embed.engine: eval steam needs an embedder".into()],
    })?;
    let t = Instant::now();
    let bar = super::progress(ids.len(), "embedding items");
    let mut items: Items = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(256) {
        let emb = embedder
            .embed(chunk.iter().map(|i| texts[i].clone()).collect())
            .await
            .map_err(|e| Error::Embed {
                retryable: false,
                source: Box::new(e),
            })?;
        let dim = emb.dim;
        for (k, i) in chunk.iter().enumerate() {
            let (t, c) = &meta[i];
            items.insert(
                i.clone(),
                (
                    t.clone(),
                    c.clone(),
                    emb.vectors[k * dim..(k + 1) * dim].to_vec(),
                ),
            );
        }
        bar.inc(chunk.len() as u64);
    }
    bar.finish_and_clear();
    // By id, so centring and the τ quantile do not depend on map order.
    let mut vectors: Vec<(&String, &mut Vec<f32>)> =
        items.iter_mut().map(|(k, v)| (k, &mut v.2)).collect();
    vectors.sort_by(|a, b| a.0.cmp(b.0));
    if geometry.centre {
        let mut refs: Vec<&mut [f32]> = vectors.iter_mut().map(|(_, v)| v.as_mut_slice()).collect();
        steamrf_operators::steam::geometry::mean_centre(&mut refs);
    }
    let tau = geometry.tau_quantile.and_then(|q| {
        let refs: Vec<&[f32]> = vectors.iter().map(|(_, v)| v.as_slice()).collect();
        steamrf_operators::steam::geometry::cosine_quantile(&refs, q, TAU_PAIRS)
    });
    Ok((items, texts, t.elapsed().as_secs_f64(), tau))
}

/// Mean and population standard deviation.
pub(super) fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// The paper's ablations as parameters: full, w/o MC, w/o AMU.
/// With `tau`, one τ for formation and links (the paper uses one τ).
pub(super) fn ablations(tau: Option<f32>) -> [SteamParams; 3] {
    let mut full = SteamParams::default();
    if let Some(t) = tau {
        full.evolve.tau = t;
        full.link_tau = t;
    }
    let no_mc = SteamParams {
        evolve: EvolveParams {
            consolidate: false,
            ..full.evolve
        },
        ..full
    };
    let no_amu = SteamParams {
        evolve: EvolveParams {
            max_memories_per_user: 1,
            ..full.evolve
        },
        ..full
    };
    [full, no_mc, no_amu]
}

/// `recommend`'s parameters: with `tau`, its least cosine for a local
/// memory; with `scoring`, δ and k_n.
pub(super) fn recommend_params(tau: Option<f32>, scoring: &Scoring) -> RecommendParams {
    let mut rec = RecommendParams::default();
    if let Some(t) = tau {
        rec.tau = t;
    }
    if let Some(w) = scoring.neighbour_weight {
        rec.neighbour_weight = w;
    }
    if let Some(k) = scoring.k_neighbours {
        rec.k_neighbours = k;
    }
    rec
}

/// `rec` without the collaborative terms: the paper's w/o CC.
fn without_cc(rec: RecommendParams) -> RecommendParams {
    RecommendParams {
        collab_weight: 0.0,
        seen_weight: 0.0,
        neighbour_weight: 0.0,
        ..rec
    }
}

/// The baselines steamrf is compared with: (ranker name, RESULT-line name).
const BASELINES: [(&str, &str); 3] = [
    ("popularity", "popularity"),
    ("item-item CF", "item_cf"),
    ("BM25 (item text)", "bm25"),
];

/// The ranking protocol.
async fn ranking(e: SteamEval) -> Result<Vec<String>> {
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
            let f = fit_fused(v, &items, &text, (tau, rec))?;
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
        let (rows, m) = evaluate(sample, &items, &text, seed, fitted.as_ref(), (tau, rec))?;
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
