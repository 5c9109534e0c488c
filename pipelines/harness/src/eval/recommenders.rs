//! What `steamrf eval steam` ranks with: STEAM states built from the
//! histories through the operators, and the baselines (popularity,
//! item-CF, user-kNN, BM25 over item texts), each a [`Ranker`]; the fused
//! ranker's features and its fit on the validation split.

use std::collections::HashMap;

use steamrf_kernels::RowPrecision;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_operators::fuse::{self, Fit};
use steamrf_operators::lexical::Bm25Params;
use steamrf_operators::rank::{self, ItemCf, ItemText, RankParams, UserKnn};
use steamrf_operators::steam::memory::{EvolveParams, Observation};
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_operators::steam::retrieve::{MemoryView, RecommendParams, recommend};
use steamrf_operators::steam::{MemoryId, Prototype};
use steamrf_operators::steam::{SteamParams, SteamState};
use steamrf_pipelines::error::{Error, Result};
use steamrf_schemas::{Event, decode};

use super::Scoring;
use super::datasets::{Items, Sample, User, bad};

/// A ranker: candidates (in the shuffled order) → scores (higher is better;
/// ties keep the shuffled order).
pub(super) type Ranker<'a> = Box<dyn Fn(&User, &[String]) -> Vec<f64> + 'a>;

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

/// The STEAM states of the full method, w/o MC and w/o AMU.
pub(super) fn steam_states(
    users: &[User],
    items: &Items,
    (tau, precision): (Option<f32>, RowPrecision),
) -> Result<[SteamState; 3]> {
    let [full, no_mc, no_amu] = ablations(tau, precision);
    Ok([
        steam_state(users, items, full)?,
        steam_state(users, items, no_mc)?,
        steam_state(users, items, no_amu)?,
    ])
}

/// A deterministic pseudo-random score in [0, 1) of (seed, user, item).
pub(super) fn noise(seed: u64, user: &str, item: &str) -> f64 {
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
pub(super) fn signal<'a>(
    cf: Option<&'a ItemCf>,
    text: Option<&'a ItemText>,
    column: usize,
) -> Ranker<'a> {
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

/// Ranks by the candidates' users in the training interactions.
pub(super) fn popularity(cf: &ItemCf) -> Ranker<'_> {
    Box::new(|_u: &User, c: &[String]| c.iter().map(|i| cf.popularity(i)).collect())
}

/// The fused ranker's signals alone, in the order of [`FUSED_FEATURES`]:
/// what a fit needs, without the ablation states.
pub(super) fn feature_rankers<'a>(
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

/// The rankers the fused ranker combines, in the order of [`rank::SIGNALS`].
pub(super) const FUSED_FEATURES: [&str; 4] = [
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
pub(super) const USER_KNN_K: usize = 20;

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
    (tau, precision, rec): (Option<f32>, RowPrecision, RecommendParams),
) -> Result<Fitted> {
    let learners: Vec<User> = valid.users.iter().chain(&valid.others).cloned().collect();
    // Only the full state: the ablations are table rows, not features.
    let state = steam_state(&learners, items, ablations(tau, precision)[0])?;
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

/// Mean and population standard deviation.
pub(super) fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// The paper's ablations as parameters: full, w/o MC, w/o AMU.
/// With `tau`, one τ for formation and links (the paper uses one τ); the
/// relation index in `precision` (`steam.index_precision`).
pub(super) fn ablations(tau: Option<f32>, precision: RowPrecision) -> [SteamParams; 3] {
    let mut full = SteamParams {
        index_precision: precision,
        ..SteamParams::default()
    };
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
pub(super) fn without_cc(rec: RecommendParams) -> RecommendParams {
    RecommendParams {
        collab_weight: 0.0,
        seen_weight: 0.0,
        neighbour_weight: 0.0,
        ..rec
    }
}

/// STEAM with the paper's score: no neighbours(c) term (δ = 0).
pub(super) const NO_NEIGHBOURS: &str = "steamrf w/o neighbours (δ = 0, the paper's score)";

/// Every method's scores for each user's candidates: `[method][user][candidate]`.
pub(super) fn score_all(
    rankers: &[(&'static str, Ranker<'_>)],
    users: &[User],
    cands: &[Vec<String>],
) -> Vec<Vec<Vec<f64>>> {
    rankers
        .iter()
        .map(|(_, rank)| users.iter().zip(cands).map(|(u, c)| rank(u, c)).collect())
        .collect()
}
