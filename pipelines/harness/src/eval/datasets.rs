//! The STEAM paper's data for `steamrf eval steam`: the AgentCF Amazon CDs
//! samples and MovieLens-100K read into users, histories and candidate
//! samples, and the items embedded (../shared/data/README.md).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{SeedableRng, rngs::StdRng};
use steamrf_pipelines::config::EmbedConfig;
use steamrf_pipelines::error::{Error, Result};

use super::Geometry;

/// Pairs of items the τ quantile is read from (the first items by id): all
/// of ML-100K's 1,682 items are ~1.4M pairs.
pub(super) const TAU_PAIRS: usize = 1_500_000;

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
pub(super) fn user_seed(user: &str) -> u64 {
    user.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub(super) type Items = HashMap<String, (String, String, Vec<f32>)>;

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
pub(super) fn ml_sample_holding(
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
pub(super) const PAPER_HISTORY: usize = 5;

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
