//! The recommendation ranker: STEAM's score of each candidate, optionally
//! fused ([`crate::fuse`]) with three signals every recommender team knows:
//! item-item collaborative filtering, BM25 between the candidate's text and
//! the user's history's texts, and popularity.
//!
//! One ranker for `eval steam` and `/v1/recommend`: the evaluation scores its
//! "steamrf fused" row with [`features`] and [`score`], and the service does
//! the same with the statistics it reads from the tables, so the weights an
//! evaluation fits on its validation split are the weights the service runs.
//!
//! - [`ItemCf`]: for each item, the ids of the users who interacted with it
//!   (numbers assigned at build time; user ids are not kept). Popularity is
//!   the number of such users; the item-item score of a candidate is
//!   `Σ_h |U_h ∩ U_c| / √(|U_h| |U_c|)` over the history items `h`
//!   (cosine of the items' user sets).
//! - [`ItemText`]: BM25 ([`crate::lexical`]'s terms, idf and parameters) of
//!   each candidate's text against the concatenated texts of the history,
//!   scored per candidate from a forward index, so the cost is the
//!   candidate's length, not the catalogue's size.
//!
//! Cost per request: `history × candidates` set intersections (sorted merge,
//! galloping when one set is much smaller), each at most the smaller set's
//! size times a logarithm. [`RankParams::max_history`] bounds the history
//! (its most recent items).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::fuse;
use crate::lexical::{Bm25Params, idf, terms};

/// The signals in the order of [`Weights::as_array`] and of each row of
/// [`features`].
pub const SIGNALS: [&str; 4] = ["steam", "item_cf", "bm25", "popularity"];

/// The weight of each signal in the fused score (non-negative; only their
/// ratios matter). The default is STEAM alone.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    /// STEAM's `recommend` score.
    pub steam: f64,
    /// Item-item collaborative filtering over the history.
    pub item_cf: f64,
    /// BM25 of the candidate's text against the history's texts.
    pub bm25: f64,
    /// Users who interacted with the candidate.
    pub popularity: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            steam: 1.0,
            item_cf: 0.0,
            bm25: 0.0,
            popularity: 0.0,
        }
    }
}

impl Weights {
    /// In the order of [`SIGNALS`].
    pub fn as_array(&self) -> [f64; 4] {
        [self.steam, self.item_cf, self.bm25, self.popularity]
    }

    /// From weights in the order of [`SIGNALS`] (missing ones are 0).
    pub fn from_slice(w: &[f64]) -> Self {
        let at = |i: usize| w.get(i).copied().unwrap_or(0.0);
        Self {
            steam: at(0),
            item_cf: at(1),
            bm25: at(2),
            popularity: at(3),
        }
    }

    /// Whether only STEAM counts: the score is then STEAM's own.
    pub fn steam_only(&self) -> bool {
        self.item_cf == 0.0 && self.bm25 == 0.0 && self.popularity == 0.0
    }

    /// Whether [`ItemCf`] is needed (item-CF or popularity weighted).
    pub fn needs_item_cf(&self) -> bool {
        self.item_cf > 0.0 || self.popularity > 0.0
    }

    /// Whether [`ItemText`] is needed.
    pub fn needs_text(&self) -> bool {
        self.bm25 > 0.0
    }

    /// What is wrong with them, naming the field (empty when valid).
    pub fn problems(&self, prefix: &str) -> Vec<String> {
        let mut p = Vec::new();
        for (name, w) in SIGNALS.iter().zip(self.as_array()) {
            if !w.is_finite() || w < 0.0 {
                p.push(format!(
                    "{prefix}.{name}: must be a finite, non-negative number (got {w})"
                ));
            }
        }
        if p.is_empty() && self.as_array().iter().sum::<f64>() <= 0.0 {
            p.push(format!("{prefix}: at least one weight must be above 0"));
        }
        p
    }
}

/// The ranker's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankParams {
    /// Only the most recent this many distinct history items are scored
    /// against (item-CF and BM25).
    pub max_history: usize,
}

impl Default for RankParams {
    fn default() -> Self {
        Self { max_history: 1000 }
    }
}

/// Users per item, from (user, item) interactions (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ItemCf {
    /// Item → the numbers of its users, ascending, distinct.
    users: HashMap<Box<str>, Vec<u32>>,
}

impl ItemCf {
    /// From `(user, item)` pairs; repeated pairs count once.
    pub fn new<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut number: HashMap<&str, u32> = HashMap::new();
        let mut users: HashMap<Box<str>, Vec<u32>> = HashMap::new();
        for (u, i) in pairs {
            let next = u32::try_from(number.len()).unwrap_or(u32::MAX);
            let n = *number.entry(u).or_insert(next);
            match users.get_mut(i) {
                Some(list) => list.push(n),
                None => {
                    users.insert(i.into(), vec![n]);
                }
            }
        }
        for list in users.values_mut() {
            list.sort_unstable();
            list.dedup();
            list.shrink_to_fit();
        }
        Self { users }
    }

    /// Items with at least one user.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether no item has a user.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// Users who interacted with `item` (its popularity).
    pub fn popularity(&self, item: &str) -> f64 {
        self.users.get(item).map_or(0.0, |l| l.len() as f64)
    }

    /// Cosine of the user sets of `a` and `b` (0 when either has none).
    pub fn cosine(&self, a: &str, b: &str) -> f64 {
        match (self.users.get(a), self.users.get(b)) {
            (Some(x), Some(y)) => cosine(x, y),
            _ => 0.0,
        }
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.users
            .iter()
            .map(|(k, v)| k.len() + v.capacity() * 4 + 64)
            .sum()
    }
}

/// [`ItemCf`] per tenant (`steamrf_schemas::tenancy`): what the service
/// ranks with. A tenant's popularity and co-occurrence counts are its own
/// users' only, so no answer tells one tenant how another's users chose.
#[derive(Debug, Default)]
pub struct TenantItemCf {
    by_tenant: HashMap<Box<str>, ItemCf>,
    separator: Option<char>,
}

impl TenantItemCf {
    /// From `(user, item)` pairs, split by the users' tenants.
    pub fn new<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
        separator: Option<char>,
    ) -> Self {
        let mut split: HashMap<&str, Vec<(&str, &str)>> = HashMap::new();
        for (u, i) in pairs {
            split
                .entry(steamrf_schemas::tenancy::tenant_of(u, separator))
                .or_default()
                .push((u, i));
        }
        Self {
            by_tenant: split
                .into_iter()
                .map(|(t, pairs)| (t.into(), ItemCf::new(pairs)))
                .collect(),
            separator,
        }
    }

    /// The statistics of `user_id`'s tenant (none: the tenant has no rows).
    pub fn of(&self, user_id: &str) -> Option<&ItemCf> {
        self.by_tenant
            .get(steamrf_schemas::tenancy::tenant_of(user_id, self.separator))
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.by_tenant
            .iter()
            .map(|(t, cf)| t.len() + cf.bytes() + 64)
            .sum()
    }
}

fn cosine(x: &[u32], y: &[u32]) -> f64 {
    let co = intersection(x, y);
    if co == 0 {
        return 0.0;
    }
    f64::from(co) / ((x.len() * y.len()) as f64).sqrt()
}

/// `|x ∩ y|` of two ascending, distinct lists: a merge, or, when one is
/// much smaller, a galloping search of its elements in the other.
fn intersection(x: &[u32], y: &[u32]) -> u32 {
    let (small, large) = if x.len() <= y.len() { (x, y) } else { (y, x) };
    if small.is_empty() {
        return 0;
    }
    let mut n = 0;
    if large.len() / small.len() >= 16 {
        let mut rest = large;
        for v in small {
            // Gallop: double the step until past v, then search that range.
            let mut hi = 1;
            while hi < rest.len() && rest[hi] < *v {
                hi *= 2;
            }
            let lo = hi / 2;
            let end = hi.min(rest.len() - 1) + 1;
            match rest[lo..end].binary_search(v) {
                Ok(k) => {
                    n += 1;
                    rest = &rest[lo + k + 1..];
                }
                Err(k) => rest = &rest[lo + k..],
            }
            if rest.is_empty() {
                break;
            }
        }
        return n;
    }
    let (mut i, mut j) = (0, 0);
    while i < small.len() && j < large.len() {
        match small[i].cmp(&large[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// User-user collaborative filtering over binary interactions: a user's k
/// most similar other users (cosine of their item sets) vote for the items
/// they hold, each with its similarity; a candidate's score is its share of
/// the votes. A reference baseline for the evaluation (the behavioural
/// counterpart of STEAM's neighbours(c), which finds its neighbours by
/// memory embeddings), not a signal of the served ranker.
#[derive(Debug, Clone, Default)]
pub struct UserKnn {
    /// User id → its number.
    users: HashMap<Box<str>, u32>,
    /// User number → its items (numbers), ascending, distinct.
    items_of: Vec<Vec<u32>>,
    /// Item number → its users, ascending, distinct.
    users_of: Vec<Vec<u32>>,
    /// Item id → its number.
    numbers: HashMap<Box<str>, u32>,
}

/// The number of `key` in `map`, assigned in first-seen order.
fn number_of(map: &mut HashMap<Box<str>, u32>, key: &str) -> u32 {
    let next = u32::try_from(map.len()).unwrap_or(u32::MAX);
    *map.entry(key.into()).or_insert(next)
}

impl UserKnn {
    /// From `(user, item)` pairs; repeated pairs count once.
    pub fn new<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut me = Self::default();
        for (u, i) in pairs {
            let user = number_of(&mut me.users, u);
            let item = number_of(&mut me.numbers, i);
            for (list, at, v) in [
                (&mut me.items_of, user, item),
                (&mut me.users_of, item, user),
            ] {
                if list.len() <= at as usize {
                    list.resize(at as usize + 1, Vec::new());
                }
                list[at as usize].push(v);
            }
        }
        for list in me.items_of.iter_mut().chain(me.users_of.iter_mut()) {
            list.sort_unstable();
            list.dedup();
        }
        me
    }

    /// Each candidate's share of the votes of `user`'s `k` nearest users
    /// (0 for a user without items, or a candidate none of them holds).
    pub fn scores(&self, user: &str, candidates: &[&str], k: usize) -> Vec<f64> {
        let Some(&me) = self.users.get(user) else {
            return vec![0.0; candidates.len()];
        };
        let mine = &self.items_of[me as usize];
        // Co-occurrence with every other user through the shared items.
        let mut co: HashMap<u32, u32> = HashMap::new();
        for &i in mine {
            for &v in &self.users_of[i as usize] {
                *co.entry(v).or_insert(0) += 1;
            }
        }
        let mut near: Vec<(f64, u32)> = co
            .into_iter()
            .filter(|&(v, _)| v != me)
            .map(|(v, n)| {
                let theirs = self.items_of[v as usize].len();
                (f64::from(n) / ((mine.len() * theirs) as f64).sqrt(), v)
            })
            .collect();
        near.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        near.truncate(k);
        let total: f64 = near.iter().map(|n| n.0).sum();
        candidates
            .iter()
            .map(|c| {
                let Some(&item) = self.numbers.get(*c) else {
                    return 0.0;
                };
                let holders = &self.users_of[item as usize];
                near.iter()
                    .filter(|(_, v)| holders.binary_search(v).is_ok())
                    .map(|(s, _)| s / total)
                    .sum()
            })
            .collect()
    }
}

/// BM25 over item texts, as a forward index (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct ItemText {
    /// Item → its distinct terms (numbers) with their counts, and its length.
    docs: HashMap<Box<str>, (Vec<(u32, u32)>, u32)>,
    /// Term → its number.
    numbers: HashMap<Box<str>, u32>,
    /// Idf per term number.
    idf: Vec<f64>,
    avg_len: f64,
    params: Bm25Params,
}

impl ItemText {
    /// Indexes `(item, text)` pairs (a repeated item keeps its last text).
    pub fn new<'a>(
        texts: impl IntoIterator<Item = (&'a str, &'a str)>,
        params: Bm25Params,
    ) -> Self {
        let mut numbers: HashMap<Box<str>, u32> = HashMap::new();
        let mut docs: HashMap<Box<str>, (Vec<(u32, u32)>, u32)> = HashMap::new();
        for (item, text) in texts {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            let mut len = 0u32;
            for t in terms(text) {
                len += 1;
                let next = u32::try_from(numbers.len()).unwrap_or(u32::MAX);
                let n = *numbers.entry(t.into_boxed_str()).or_insert(next);
                *counts.entry(n).or_insert(0) += 1;
            }
            let mut counts: Vec<(u32, u32)> = counts.into_iter().collect();
            counts.sort_unstable();
            docs.insert(item.into(), (counts, len));
        }
        let mut df = vec![0usize; numbers.len()];
        for (counts, _) in docs.values() {
            for (t, _) in counts {
                df[*t as usize] += 1;
            }
        }
        let n = docs.len();
        let avg_len = if n == 0 {
            0.0
        } else {
            docs.values().map(|d| f64::from(d.1)).sum::<f64>() / n as f64
        };
        Self {
            idf: df.into_iter().map(|d| idf(n, d)).collect(),
            docs,
            numbers,
            avg_len,
            params,
        }
    }

    /// Items indexed.
    pub fn len(&self) -> usize {
        self.docs.len()
    }

    /// Whether no item is indexed.
    pub fn is_empty(&self) -> bool {
        self.docs.is_empty()
    }

    /// BM25 of each candidate's text against the texts of `history` (each
    /// term counts once per occurrence in them); 0 for an item without text.
    pub fn scores(&self, history: &[&str], candidates: &[&str]) -> Vec<f64> {
        let mut query: HashMap<u32, f64> = HashMap::new();
        for h in history {
            if let Some((counts, _)) = self.docs.get(*h) {
                for &(t, tf) in counts {
                    *query.entry(t).or_insert(0.0) += f64::from(tf);
                }
            }
        }
        let (k1, b) = (f64::from(self.params.k1), f64::from(self.params.b));
        candidates
            .iter()
            .map(|c| {
                let Some((counts, len)) = self.docs.get(*c) else {
                    return 0.0;
                };
                let norm = k1 * (1.0 - b + b * f64::from(*len) / self.avg_len);
                counts
                    .iter()
                    .filter_map(|&(t, tf)| {
                        let times = query.get(&t)?;
                        let tf = f64::from(tf);
                        Some(times * self.idf[t as usize] * tf * (k1 + 1.0) / (tf + norm))
                    })
                    .sum()
            })
            .collect()
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.docs
            .iter()
            .map(|(k, (c, _))| k.len() + c.capacity() * 8 + 64)
            .sum::<usize>()
            + self.numbers.keys().map(|k| k.len() + 48).sum::<usize>()
            + self.idf.capacity() * 8
    }
}

/// What the non-STEAM signals are computed from (a missing part scores 0).
#[derive(Debug, Clone, Copy, Default)]
pub struct Signals<'a> {
    /// Users per item.
    pub item_cf: Option<&'a ItemCf>,
    /// Item texts.
    pub text: Option<&'a ItemText>,
}

/// The most recent `max` distinct items of `history` (oldest first),
/// keeping each item's last occurrence.
pub fn recent_distinct<'a>(history: &[&'a str], max: usize) -> Vec<&'a str> {
    let mut seen = std::collections::HashSet::new();
    let mut out: Vec<&str> = history
        .iter()
        .rev()
        .filter(|h| seen.insert(**h))
        .take(max)
        .copied()
        .collect();
    out.reverse();
    out
}

/// `[candidate][signal]` in the order of [`SIGNALS`]: STEAM's score (given),
/// item-CF, BM25 and popularity of each candidate for a user whose
/// history is `history` (oldest first).
///
/// # Panics
/// If `steam` and `candidates` differ in length.
pub fn features(
    steam: &[f64],
    history: &[&str],
    candidates: &[&str],
    signals: Signals<'_>,
    params: RankParams,
) -> Vec<[f64; 4]> {
    features_until(steam, history, candidates, signals, params, &|| false)
        .unwrap_or_else(|| unreachable!("never stopped"))
}

/// [`features`], or `None` once `stop` says so (checked per candidate:
/// a popular item's item-CF compares user sets of any size, so one
/// request's ranking can take as long as its candidates' audiences make
/// it; the caller's deadline bounds it).
///
/// # Panics
/// If `steam` and `candidates` differ in length.
pub fn features_until(
    steam: &[f64],
    history: &[&str],
    candidates: &[&str],
    signals: Signals<'_>,
    params: RankParams,
    stop: &dyn Fn() -> bool,
) -> Option<Vec<[f64; 4]>> {
    assert_eq!(
        steam.len(),
        candidates.len(),
        "one STEAM score per candidate"
    );
    let history = recent_distinct(history, params.max_history);
    let text = signals.text.map_or_else(
        || vec![0.0; candidates.len()],
        |t| t.scores(&history, candidates),
    );
    if stop() {
        return None;
    }
    candidates
        .iter()
        .zip(steam)
        .zip(text)
        .map(|((c, &s), bm25)| {
            if stop() {
                return None;
            }
            let (cf, pop) = signals.item_cf.map_or((0.0, 0.0), |cf| {
                let Some(uc) = cf.users.get(*c) else {
                    return (0.0, 0.0);
                };
                let sum = history
                    .iter()
                    .filter_map(|h| cf.users.get(*h))
                    .map(|uh| cosine(uh, uc))
                    .sum();
                (sum, uc.len() as f64)
            });
            Some([s, cf, bm25, pop])
        })
        .collect()
}

/// The ranker's score of each candidate: STEAM's own score with
/// [`Weights::steam_only`], else [`fuse::fuse`] of the [`features`].
pub fn score(weights: &Weights, features: &[[f64; 4]]) -> Vec<f64> {
    if weights.steam_only() {
        return features.iter().map(|f| f[0]).collect();
    }
    let rows: Vec<Vec<f64>> = features.iter().map(|f| f.to_vec()).collect();
    fuse::fuse(&weights.as_array(), &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 44, items 9–10: globex's users make an item popular and tie
    /// it to another; acme's statistics do not move.
    #[test]
    fn item_statistics_count_the_asking_tenants_users_only() {
        let mut pairs = vec![("acme:ann", "a"), ("acme:ben", "a"), ("acme:ben", "b")];
        let globex: Vec<String> = (0..50).map(|n| format!("globex:u{n}")).collect();
        for u in &globex {
            pairs.push((u, "b"));
            pairs.push((u, "secret"));
        }
        let cf = TenantItemCf::new(pairs, Some(':'));
        let acme = cf.of("acme:zed").expect("acme has rows");
        assert_eq!(acme.popularity("a"), 2.0);
        assert_eq!(acme.popularity("b"), 1.0, "globex's 50 users do not count");
        assert_eq!(acme.popularity("secret"), 0.0);
        assert_eq!(acme.cosine("b", "secret"), 0.0);
        assert_eq!(cf.of("globex:u1").unwrap().popularity("b"), 50.0);
        assert!(cf.of("initech:x").is_none());
        // Without tenancy, one tenant.
        let one = TenantItemCf::new([("ann", "a"), ("acme:ben", "a")], None);
        assert_eq!(one.of("x").unwrap().popularity("a"), 2.0);
    }

    #[test]
    fn user_knn_votes_with_the_most_similar_users() {
        let pairs = [
            ("ann", "a"),
            ("ann", "b"),
            ("ben", "a"),
            ("ben", "b"),
            ("ben", "c"),
            ("cat", "a"),
            ("cat", "d"),
            ("dan", "e"),
        ];
        let knn = UserKnn::new(pairs);
        // Ben (cosine 2/√6) is nearer ann than cat (1/2); dan shares nothing.
        let one = knn.scores("ann", &["c", "d", "e", "zzz"], 1);
        assert_eq!(one, vec![1.0, 0.0, 0.0, 0.0]);
        let two = knn.scores("ann", &["c", "d", "e"], 20);
        let (ben, cat) = (2.0 / 6f64.sqrt(), 0.5);
        assert!((two[0] - ben / (ben + cat)).abs() < 1e-12);
        assert!((two[1] - cat / (ben + cat)).abs() < 1e-12);
        assert_eq!(two[2], 0.0);
        assert_eq!(knn.scores("nobody", &["a"], 5), vec![0.0]);
    }

    fn reference_intersection(x: &[u32], y: &[u32]) -> u32 {
        x.iter().filter(|v| y.contains(v)).count() as u32
    }

    #[test]
    fn intersections_agree_with_the_obvious_count_merging_and_galloping() {
        let big: Vec<u32> = (0..2000).filter(|v| v % 3 != 0).collect();
        for small in [
            vec![],
            vec![0],
            vec![1],
            vec![1999],
            vec![2, 3, 4, 5, 500, 1998, 1999],
            (0..100).map(|v| v * 19).collect(),
            (0..900).map(|v| v * 2).collect(),
        ] {
            assert_eq!(
                intersection(&small, &big),
                reference_intersection(&small, &big),
                "{small:?}"
            );
            assert_eq!(intersection(&big, &small), intersection(&small, &big));
        }
    }

    #[test]
    fn item_cf_counts_distinct_users_and_scores_cosines() {
        let cf = ItemCf::new([
            ("u1", "a"),
            ("u1", "a"),
            ("u1", "b"),
            ("u2", "a"),
            ("u2", "b"),
            ("u3", "a"),
            ("u3", "c"),
        ]);
        assert_eq!(cf.popularity("a"), 3.0);
        assert_eq!(cf.popularity("b"), 2.0);
        assert_eq!(cf.popularity("z"), 0.0);
        // a: {1,2,3}, b: {1,2}: 2 / sqrt(6).
        assert!((cf.cosine("a", "b") - 2.0 / 6f64.sqrt()).abs() < 1e-12);
        assert_eq!(cf.cosine("b", "c"), 0.0);
        assert_eq!(cf.cosine("a", "z"), 0.0);
    }

    #[test]
    fn bm25_prefers_the_candidate_that_shares_rare_words_with_the_history() {
        let t = ItemText::new(
            [
                ("1", "Giant Steps, a jazz album"),
                ("2", "Kind of Blue, a jazz album"),
                ("3", "Nevermind, a rock album"),
                ("4", "Blue Train, jazz"),
            ],
            Bm25Params::default(),
        );
        let s = t.scores(&["2"], &["3", "4", "9"]);
        assert!(s[1] > s[0], "{s:?}");
        assert_eq!(s[2], 0.0);
        // Nothing in the history: nothing scores.
        assert_eq!(t.scores(&[], &["1", "2"]), vec![0.0, 0.0]);
    }

    #[test]
    fn the_history_is_its_most_recent_distinct_items() {
        assert_eq!(
            recent_distinct(&["a", "b", "a", "c", "d"], 3),
            vec!["a", "c", "d"]
        );
        assert_eq!(recent_distinct(&["a", "a"], 10), vec!["a"]);
    }

    #[test]
    fn steam_alone_keeps_steams_scores_and_a_fused_ranker_follows_the_weighted_signal() {
        let cf = ItemCf::new([
            ("u1", "h"),
            ("u1", "x"),
            ("u2", "h"),
            ("u2", "x"),
            ("u3", "y"),
        ]);
        let f = features(
            &[0.9, 0.1],
            &["h"],
            &["y", "x"],
            Signals {
                item_cf: Some(&cf),
                text: None,
            },
            RankParams::default(),
        );
        assert_eq!(f[0], [0.9, 0.0, 0.0, 1.0]);
        assert_eq!(f[1][1], 1.0);
        assert_eq!(score(&Weights::default(), &f), vec![0.9, 0.1]);
        let cf_only = Weights::from_slice(&[0.0, 1.0]);
        let s = score(&cf_only, &f);
        assert!(s[1] > s[0], "{s:?}");
    }

    #[test]
    fn weights_name_the_bad_field() {
        let bad = Weights {
            bm25: -1.0,
            ..Weights::default()
        };
        assert_eq!(
            bad.problems("serve.ranker"),
            vec!["serve.ranker.bm25: must be a finite, non-negative number (got -1)"]
        );
        let zero = Weights::from_slice(&[]);
        assert_eq!(zero.problems("r").len(), 1);
        assert!(Weights::default().problems("r").is_empty());
    }
}
