//! `POST /v1/recommend`: candidates ranked by the user's memories and the
//! collaborative signal (STEAM's inference phase), or by the fused ranker,
//! within the request's deadline, each with its reason.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::Response;
use serde::Serialize;
use steamrf_operators::rank;
use steamrf_operators::steam::retrieve::{self as steam_retrieve, MemoryView, RecommendParams};
pub(super) use steamrf_schemas::api::RecommendRequest;
use steamrf_schemas::api::{self};

use super::api_error::ApiError;
use super::auth::Scope;
use super::cache::View;
use super::request::{authenticate, authorize, read_body, respond};
use super::state::AppState;
use crate::error::Result;

/// One ranked candidate.
#[derive(Debug, Serialize)]
pub struct RankedItem {
    /// The item.
    pub item_id: String,
    /// The ranker's score (higher is better): STEAM's with the default
    /// `serve.ranker`, else the weighted sum of the signals' z-scores.
    pub score: f32,
    /// Cosine with the user's best-matching memory.
    pub local: f32,
    /// Cosine with the best collaborative memory.
    pub collab: f32,
    /// Share of collaborative memories whose users chose this item.
    pub seen: f32,
    /// The share of the votes of the users most like this one (the nearest
    /// other users' memories in the matched memory's community) that chose
    /// this item.
    pub neighbours: f32,
    /// Each signal's raw value, when `serve.ranker` fuses several.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub signals: Option<SignalValues>,
    /// The user's memory that matched best.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_id: Option<String>,
    /// Why, in words.
    pub reason: String,
}

/// The ranker's signals for one candidate (docs/retrieval.md).
#[derive(Debug, Serialize)]
pub struct SignalValues {
    /// STEAM's `recommend` score.
    pub steam: f32,
    /// Item-item CF: summed cosines with the history's items.
    pub item_cf: f32,
    /// BM25 against the history's item texts.
    pub bm25: f32,
    /// Distinct users of the item.
    pub popularity: f32,
}

/// The answer of `/v1/recommend`.
#[derive(Debug, Serialize)]
pub struct RecommendResponse {
    /// The user.
    pub user_id: String,
    /// Best first; unknown items last.
    pub ranked: Vec<RankedItem>,
    /// The ranker's fusion stopped at `serve.request_timeout`: the order is
    /// STEAM's alone and `signals` are absent.
    pub truncated: bool,
}

pub(super) async fn recommend(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let started = Instant::now();
    let id = st.request_id();
    let result = recommend_inner(&st, req).await;
    respond(&st, "recommend", &id, started, result)
}

pub(super) async fn recommend_inner(
    st: &Arc<AppState>,
    req: Request,
) -> Result<RecommendResponse, ApiError> {
    let (parts, body) = req.into_parts();
    let scope = authenticate(st, &parts.headers)?;
    let body = read_body(st, body).await?;
    let req: RecommendRequest = api::parse(&body)?;
    recommend_as(st, &scope, req).await
}

/// `/v1/recommend` (and MCP's `recommend`) for a caller with `scope`.
pub(super) async fn recommend_as(
    st: &Arc<AppState>,
    scope: &Scope,
    req: RecommendRequest,
) -> Result<RecommendResponse, ApiError> {
    req.check()?;
    authorize(st, scope, &req.user_id, "user_id")?;
    let permit = st.admit()?;
    let deadline = Instant::now() + st.cfg.request_timeout;
    let view = st.view(&req.user_id, true, deadline).await?;
    let st2 = st.clone();
    // Up to MAX_CANDIDATES retrievals: off the async workers.
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        rank(&st2, &view, req, deadline)
    })
    .await
    .map_err(|e| ApiError::internal(format!("ranking panicked: {e}")))
}

pub(super) fn rank(
    st: &AppState,
    view: &View,
    req: RecommendRequest,
    deadline: Instant,
) -> RecommendResponse {
    let mut known = Vec::new();
    let mut unknown = Vec::new();
    for c in &req.candidates {
        match view.snap.items.get(c) {
            Some(info) => known.push((c.clone(), info.embedding.clone())),
            None => unknown.push(c.clone()),
        }
    }
    let params = RecommendParams {
        k_collab: st.cfg.collaborative_k,
        ..RecommendParams::default()
    };
    let steam = steam_retrieve::recommend(view, &req.user_id, &known, &params);
    // The ranker (`serve.ranker`, the one `eval steam` measures): STEAM's
    // order, or STEAM fused with item-CF, BM25 and popularity.
    // Past the request's deadline the fusion stops and the answer keeps
    // STEAM's order (`truncated`), as recollection answers with what it has.
    let weights = st.cfg.ranker.weights();
    let mut truncated = false;
    let fused = (!weights.steam_only())
        .then(|| {
            let cands: Vec<&str> = steam.iter().map(|r| r.item_id.as_str()).collect();
            let history: Vec<&str> = view.user.history.iter().map(String::as_str).collect();
            let scores: Vec<f64> = steam.iter().map(|r| f64::from(r.score)).collect();
            let features = rank::features_until(
                &scores,
                &history,
                &cands,
                view.snap.signals(&req.user_id),
                st.cfg.ranker.params(),
                &|| Instant::now() >= deadline,
            );
            truncated = features.is_none();
            let features = features?;
            let fused = rank::score(&weights, &features);
            Some((features, fused))
        })
        .flatten();
    if truncated {
        st.metrics.cut.with_label_values(&["rank_deadline"]).inc();
    }
    let mut ranked: Vec<RankedItem> = steam
        .into_iter()
        .enumerate()
        .map(|(c, r)| {
            let memory = r.memory_id.and_then(|id| view.memory(id));
            let mut reason = match memory {
                Some(m) => format!("close to your memory \"{}\" ({:.2})", m.content, r.local),
                None => "no memories yet".to_owned(),
            };
            if r.neighbours > 0.0 {
                reason.push_str(&format!(
                    "; chosen by users like you ({:.0}% of their votes)",
                    r.neighbours * 100.0
                ));
            }
            if r.seen > 0.0 {
                reason.push_str(&format!(
                    "; chosen by {:.0}% of similar users in your community",
                    r.seen * 100.0
                ));
            }
            let (score, signals) = match &fused {
                Some((features, fused)) => {
                    let [steam, item_cf, bm25, popularity] = features[c];
                    if item_cf > 0.0 {
                        reason.push_str(&format!(
                            "; often chosen with items you chose (item-CF {item_cf:.2})"
                        ));
                    }
                    (
                        fused[c] as f32,
                        Some(SignalValues {
                            steam: steam as f32,
                            item_cf: item_cf as f32,
                            bm25: bm25 as f32,
                            popularity: popularity as f32,
                        }),
                    )
                }
                None => (r.score, None),
            };
            RankedItem {
                item_id: r.item_id,
                score,
                local: r.local,
                collab: r.collab,
                seen: r.seen,
                neighbours: r.neighbours,
                signals,
                memory_id: r.memory_id.map(|m| m.to_string()),
                reason,
            }
        })
        .collect();
    // Best first; ties keep STEAM's order (the sort is stable).
    ranked.sort_by(|a, b| b.score.total_cmp(&a.score));
    ranked.extend(unknown.into_iter().map(|item_id| RankedItem {
        item_id,
        score: f32::MIN,
        local: 0.0,
        collab: 0.0,
        seen: 0.0,
        neighbours: 0.0,
        signals: None,
        memory_id: None,
        reason: "unknown item (not in the items table, or not embedded)".to_owned(),
    }));
    if let Some(k) = req.k {
        ranked.truncate(k);
    }
    RecommendResponse {
        user_id: req.user_id,
        ranked,
        truncated,
    }
}
