//! `POST /v1/retrieve`: RF-Mem over the user's corpus (probe, gate,
//! familiarity top-k or recollection), STEAM's local-to-global step through
//! published prototypes, and the answer with its provenance and
//! explanation.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::response::Response;
use serde::Serialize;
use steamrf_operators::passage::{self, UnitBudget, UnitParams};
use steamrf_operators::rfmem::{self, RfMemParams};
use steamrf_operators::steam::MemoryId;
use steamrf_operators::steam::retrieve::{self as steam_retrieve, MemoryView, RecommendParams};
pub(super) use steamrf_schemas::api::RetrieveRequest;
use steamrf_schemas::api::{self};

use super::api_error::ApiError;
use super::auth::Scope;
use super::cache;
use super::cache::View;
use super::request::{Budget, SetOnDrop, authenticate, authorize, ms, read_body, respond};
use super::state::AppState;
use crate::config::ServeConfig;
use crate::error::Result;

/// Where a result came from.
#[derive(Debug, Serialize)]
pub struct Provenance {
    /// Table.
    pub table: &'static str,
    /// Key(s) in it.
    pub ids: Vec<String>,
    /// The events behind `content` (a session's: the turns it hands over).
    pub source_event_ids: Vec<String>,
    /// Kafka partition of the (first) source event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<i32>,
    /// Its offset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<i64>,
}

/// One retrieved row.
#[derive(Debug, Serialize)]
pub struct Item {
    /// memory, dialogue, session, interaction.
    pub kind: cache::EntryKind,
    /// Its id.
    pub id: String,
    /// Its text: a session's matched passage window (its turns), any row
    /// at most `serve.max_item_bytes`.
    pub content: String,
    /// `content` was cut at `serve.max_item_bytes`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub content_truncated: bool,
    /// The fused score (the order): `dense + lexical_weight · lexical +
    /// sparse_weight · sparse` for an evidence unit (`[serve.units]`),
    /// `dense + lexical_weight · lexical` for a row (`[serve.hybrid]`).
    pub score: f32,
    /// The dense part: `mix ·` the best window's cosine `+ (1 − mix) ·` the
    /// whole row's (the row's cosine when it has no windows).
    pub dense: f32,
    /// The lexical part: the row's BM25 score for the query text over the
    /// most any row could score for it (0–1; 0 without query text).
    pub lexical: f32,
    /// The learned sparse part of an evidence unit: its window's SPLADE
    /// score for the query text over the most any window could score for it
    /// (0–1; 0 on the row path, without query text or sparse vectors).
    pub sparse: f32,
    /// For a session: the turns handed over (an evidence unit's span, or
    /// on the row path the window that scored best).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub passage: Option<cache::Window>,
    /// The recollection round that found it (0 for familiarity or a row
    /// only the lexical side proposed).
    pub round: u32,
    /// Provenance.
    pub provenance: Provenance,
}

/// A community reached through one of the user's memories.
#[derive(Debug, Serialize)]
pub struct Collaborative {
    /// The prototype.
    pub prototype_id: String,
    /// Its published summary.
    pub content: String,
    /// Best cosine between the query and a reached memory.
    pub score: f32,
    /// Distinct users in the community.
    pub users: usize,
    /// Other users' memories reached (ids only; never their text).
    pub memory_ids: Vec<String>,
    /// Items those memories link to.
    pub item_ids: Vec<String>,
}

/// Milliseconds per stage.
#[derive(Debug, Serialize, Default)]
pub struct Latency {
    /// Embedding the text query.
    pub embed_ms: f64,
    /// Probe and gate.
    pub probe_ms: f64,
    /// The chosen path.
    pub path_ms: f64,
    /// The local-to-global step.
    pub collaborative_ms: f64,
    /// The whole request.
    pub total_ms: f64,
}

/// Why the answer is what it is.
#[derive(Debug, Serialize)]
pub struct Explanation {
    /// familiarity or recollection.
    pub path: rfmem::Path,
    /// The gate's rule.
    pub rule: rfmem::Rule,
    /// The probe's statistics.
    pub probe: rfmem::Probe,
    /// Recollection rounds.
    pub rounds: u32,
    /// Rows searched.
    pub candidates: usize,
    /// Windows (or rows) a short recollection was topped up with.
    pub filled: usize,
    /// Rows among the answer's candidates that only the lexical side
    /// proposed.
    pub lexical_only: usize,
    /// Windows among the answer's candidates that only the learned sparse
    /// side proposed.
    pub sparse_only: usize,
    /// Rows in the user's corpus.
    pub corpus_rows: usize,
    /// The user's interactions older than the `serve.max_user_rows` most
    /// recent ones: in the tables, not searched.
    pub user_rows_cut: usize,
    /// Whether the corpus is searched approximately (IVF).
    pub approximate: bool,
    /// Recollection stopped early at `serve.request_timeout`: the rows are
    /// those found by then, topped up from the probe.
    pub truncated: bool,
    /// The table versions read.
    pub table_versions: BTreeMap<&'static str, u64>,
    /// Per-stage latency.
    pub latency: Latency,
}

/// The answer of `/v1/retrieve`.
#[derive(Debug, Serialize)]
pub struct RetrieveResponse {
    /// The user.
    pub user_id: String,
    /// The rows, in the path's order.
    pub items: Vec<Item>,
    /// Communities reached (empty without published prototypes).
    pub collaborative: Vec<Collaborative>,
    /// Why.
    pub explanation: Explanation,
}

pub(super) fn params_for(
    cfg: &ServeConfig,
    req: &RetrieveRequest,
) -> Result<RfMemParams, ApiError> {
    let mut p = cfg.rfmem;
    if let Some(o) = &req.options {
        let mut base = serde_json::to_value(p).map_err(|e| ApiError::internal(e.to_string()))?;
        if let serde_json::Value::Object(m) = &mut base {
            for (k, v) in o {
                m.insert(k.clone(), v.clone());
            }
        }
        p = serde_path_to_error::deserialize(base).map_err(|e| {
            let inner = e.inner().to_string();
            // Unknown keys surface as a root error naming the key.
            let field = match e.path().to_string().as_str() {
                "." => {
                    api::root_field(&inner).map_or("options".to_owned(), |k| format!("options.{k}"))
                }
                path => format!("options.{path}"),
            };
            ApiError::invalid(field, inner)
        })?;
    }
    if let Some(k) = req.k {
        p.k = k;
    }
    check_bounds(cfg, &p, req.k.is_some())?;
    p.validate().map_err(|e| match e {
        rfmem::Error::Invalid { field, reason } => {
            let field = if field == "options.k" && req.k.is_some() {
                "k"
            } else {
                field
            };
            ApiError::invalid(field, reason)
        }
        other => ApiError::internal(other.to_string()),
    })?;
    Ok(p)
}

/// What an answer of evidence units may hand over: a request that names a
/// `k` (or `options.k`) gets at most k units; one that does not is bounded
/// by its `max_turns` alone (each unit holds at least one turn), so an
/// answer of short units, spread over sessions, still fills its turn budget.
pub(super) fn unit_budget(req: &RetrieveRequest, p: &RfMemParams, max_turns: usize) -> UnitBudget {
    let asked_k = req.k.is_some() || req.options.as_ref().is_some_and(|o| o.contains_key("k"));
    UnitBudget {
        units: if asked_k { p.k } else { p.k.max(max_turns) },
        turns: max_turns,
    }
}

/// The work a request may ask for: the configured cost keys are ceilings,
/// and `k` and `probe_k` stop at `serve.max_k`.
pub(super) fn check_bounds(
    cfg: &ServeConfig,
    p: &RfMemParams,
    k_at_top: bool,
) -> Result<(), ApiError> {
    let c = &cfg.rfmem;
    let k_field = if k_at_top { "k" } else { "options.k" };
    for (field, asked, limit, what) in [
        ("options.beam", p.beam, c.beam, "[serve.rfmem] beam"),
        ("options.fanout", p.fanout, c.fanout, "[serve.rfmem] fanout"),
        ("options.depth", p.depth, c.depth, "[serve.rfmem] depth"),
        (
            "options.max_candidates",
            p.max_candidates,
            c.max_candidates,
            "[serve.rfmem] max_candidates",
        ),
        (
            "options.kmeans_iters",
            p.kmeans_iters,
            c.kmeans_iters,
            "[serve.rfmem] kmeans_iters",
        ),
        (k_field, p.k, cfg.max_k, "serve.max_k"),
        ("options.probe_k", p.probe_k, cfg.max_k, "serve.max_k"),
    ] {
        if asked > limit {
            return Err(ApiError::invalid(
                field,
                format!("{asked} is over this server's limit of {limit} ({what})"),
            ));
        }
    }
    Ok(())
}

pub(super) async fn query_vector(
    st: &AppState,
    req: &mut RetrieveRequest,
) -> Result<(Vec<f32>, Duration), ApiError> {
    // RetrieveRequest::check has vetted the shape: one of the two, valid.
    match (req.query.take(), req.query_vector.take()) {
        (_, Some(v)) => Ok((v, Duration::ZERO)),
        (None, None) => Err(ApiError::invalid(
            "query",
            "query or query_vector is required",
        )),
        (Some(text), None) => {
            let Some(e) = &st.embedder else {
                return Err(ApiError::invalid(
                    "query",
                    "text queries need an embedder (embed.engine is off); send query_vector",
                ));
            };
            let started = Instant::now();
            let out = e
                .embed(vec![text])
                .await
                .map_err(|e| ApiError::internal(format!("embedding the query: {e}")))?;
            let took = started.elapsed();
            st.metrics.query_embed.observe(took.as_secs_f64());
            Ok((out.vectors, took))
        }
    }
}

pub(super) async fn retrieve(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let started = Instant::now();
    let id = st.request_id();
    let result = retrieve_inner(&st, req, started).await;
    respond(&st, "retrieve", &id, started, result)
}

pub(super) async fn retrieve_inner(
    st: &Arc<AppState>,
    req: Request,
    started: Instant,
) -> Result<RetrieveResponse, ApiError> {
    let (parts, body) = req.into_parts();
    let scope = authenticate(st, &parts.headers)?;
    let body = read_body(st, body).await?;
    let req: RetrieveRequest = api::parse(&body)?;
    retrieve_as(st, &scope, req, started).await
}

/// `/v1/retrieve` (and MCP's `retrieve`) for a caller with `scope`.
pub(super) async fn retrieve_as(
    st: &Arc<AppState>,
    scope: &Scope,
    mut req: RetrieveRequest,
    started: Instant,
) -> Result<RetrieveResponse, ApiError> {
    req.check(steamrf_schemas::tables::EMBEDDING_DIM)?;
    authorize(st, scope, &req.user_id, "user_id")?;
    let p = params_for(&st.cfg, &req)?;
    let max_turns = match req.max_turns {
        None => st.cfg.max_turns,
        Some(0) => return Err(ApiError::invalid("max_turns", "must be at least 1")),
        Some(n) if n > st.cfg.max_k => {
            return Err(ApiError::invalid(
                "max_turns",
                format!(
                    "{n} is over this server's limit of {} (serve.max_k)",
                    st.cfg.max_k
                ),
            ));
        }
        Some(n) => n,
    };
    let units = UnitParams {
        per_row: req.per_session.unwrap_or(st.cfg.units.per_row),
        ..st.cfg.units
    };
    let unit_budget = unit_budget(&req, &p, max_turns);
    let permit = st.admit()?;
    let gone = Arc::new(AtomicBool::new(false));
    let _gone_on_drop = SetOnDrop(gone.clone());
    let budget = Budget {
        deadline: started + st.cfg.request_timeout,
        gone,
    };
    let query_text = req.query.clone();
    let (q, embed_time) = query_vector(st, &mut req).await?;
    let collaborative = req.collaborative.unwrap_or(st.cfg.collaborative);
    let view = st
        .view(&req.user_id, collaborative, budget.deadline)
        .await?;
    let st2 = st.clone();
    let user_id = req.user_id;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        answer(
            &st2,
            &view,
            user_id,
            &q,
            query_text.as_deref(),
            &p,
            &units,
            unit_budget,
            collaborative,
            embed_time,
            started,
            &budget,
        )
    })
    .await
    .map_err(|e| ApiError::internal(format!("retrieval panicked: {e}")))?
}

#[allow(clippy::too_many_arguments)]
pub(super) fn answer(
    st: &AppState,
    view: &View,
    user_id: String,
    q: &[f32],
    query_text: Option<&str>,
    p: &RfMemParams,
    unit_params: &UnitParams,
    unit_budget: UnitBudget,
    collaborative: bool,
    embed_time: Duration,
    started: Instant,
    budget: &Budget,
) -> Result<RetrieveResponse, ApiError> {
    let corpus = &view.user.corpus.index;
    let mut embed_time = embed_time;
    let mut sparse_only = 0;
    let (a, spans) = if corpus.has_units() {
        let units = unit_budget;
        // The query's sparse vector, where the windows carry sparse vectors.
        let query_sparse = match (&st.sparse, query_text) {
            (Some(enc), Some(text))
                if corpus.has_sparse_units() && unit_params.sparse_weight > 0.0 =>
            {
                let t = Instant::now();
                let v = enc
                    .encode(&[text])
                    .map_err(|e| ApiError::internal(format!("sparse-encoding the query: {e}")))?
                    .pop();
                embed_time += t.elapsed();
                v
            }
            _ => None,
        };
        let u = passage::retrieve_units_until(
            corpus,
            q,
            query_text,
            query_sparse.as_ref(),
            p,
            unit_params,
            units,
            &|| budget.exhausted(),
        )
        .map_err(api_error)?;
        sparse_only = u.sparse_only;
        let spans: Vec<(u32, u32, f32)> =
            u.hits.iter().map(|h| (h.start, h.end, h.sparse)).collect();
        (as_rows(u), spans)
    } else {
        let a = passage::retrieve_until(corpus, q, query_text, p, &st.cfg.hybrid, &|| {
            budget.exhausted()
        })
        .map_err(api_error)?;
        (a, Vec::new())
    };
    st.metrics
        .observe_answer(a.path, a.rule, a.rounds, a.probe_time, a.path_time);
    if a.truncated {
        let reason = if budget.gone.load(Ordering::Relaxed) {
            "client_gone"
        } else {
            "deadline"
        };
        st.metrics.cut.with_label_values(&[reason]).inc();
    }
    let entries = &view.user.corpus.entries;
    let items = a
        .hits
        .iter()
        .enumerate()
        .filter_map(|(i, h)| {
            let e = entries.get(h.row as usize)?;
            // Units have spans; rows (`spans` empty) name their best window.
            let passage = match spans.get(i) {
                // An evidence unit: its turns (merged windows), named by
                // its last turn.
                Some(&(start, end, _)) if end > 0 => Some(cache::Window {
                    event_id: e.source_event_ids.get(end as usize - 1)?.clone(),
                    start,
                    end,
                }),
                Some(_) => None,
                None => h.passage.and_then(|w| {
                    let first = corpus.first_window(h.row)?;
                    e.windows.get(w.checked_sub(first)? as usize).cloned()
                }),
            };
            let text = e.answer_text(passage.as_ref(), st.cfg.max_item_bytes.0);
            Some(Item {
                kind: e.kind,
                id: e.id.clone(),
                content: text.content,
                content_truncated: text.truncated,
                score: h.score,
                dense: h.dense,
                lexical: h.lexical,
                sparse: spans.get(i).map_or(0.0, |s| s.2),
                passage,
                round: h.round,
                provenance: Provenance {
                    table: e.table,
                    ids: vec![e.id.clone()],
                    source_event_ids: text.source_event_ids,
                    partition: e.source.map(|s| s.0),
                    offset: e.source.map(|s| s.1),
                },
            })
        })
        .collect();
    let c_started = Instant::now();
    let collab = if collaborative {
        local_to_global(st, view, &user_id, q)
    } else {
        Vec::new()
    };
    let collaborative_time = c_started.elapsed();
    Ok(RetrieveResponse {
        explanation: Explanation {
            path: a.path,
            rule: a.rule,
            probe: a.probe,
            rounds: a.rounds,
            candidates: a.candidates,
            filled: a.filled,
            lexical_only: a.lexical_only,
            sparse_only,
            corpus_rows: corpus.len(),
            user_rows_cut: view.user.rows_cut,
            approximate: corpus.rows().is_approximate(),
            truncated: a.truncated,
            table_versions: view.snap.versions.clone(),
            latency: Latency {
                embed_ms: ms(embed_time),
                probe_ms: ms(a.probe_time),
                path_ms: ms(a.path_time),
                collaborative_ms: ms(collaborative_time),
                total_ms: ms(started.elapsed()),
            },
        },
        user_id,
        items,
        collaborative: collab,
    })
}

fn api_error(e: rfmem::Error) -> ApiError {
    match e {
        rfmem::Error::Invalid { field, reason } => ApiError::invalid(field, reason),
        other => ApiError::internal(other.to_string()),
    }
}

/// Evidence units as the rows an answer lists (each unit's span is kept
/// beside them).
fn as_rows(u: passage::UnitAnswer) -> passage::HybridAnswer {
    let d = u.dense;
    passage::HybridAnswer {
        hits: u
            .hits
            .iter()
            .map(|h| passage::RowHit {
                row: h.row,
                score: h.score,
                dense: h.dense,
                lexical: h.lexical,
                passage: Some(h.window),
                round: h.round,
            })
            .collect(),
        path: d.path,
        rule: d.rule,
        probe: d.probe,
        rounds: d.rounds,
        candidates: d.candidates,
        lexical_only: u.lexical_only,
        filled: d.filled,
        probe_time: d.probe_time,
        path_time: d.path_time,
        truncated: d.truncated,
    }
}

/// STEAM's local-to-global step, limited to the user's tenant and to
/// published prototypes; other users appear only as memory ids, and their
/// items only when at least `min_users` of the community's users chose
/// them (an item fewer chose would single them out: docs/security.md).
pub(super) fn local_to_global(
    st: &AppState,
    view: &View,
    user_id: &str,
    q: &[f32],
) -> Vec<Collaborative> {
    let mut qn = q.to_vec();
    steamrf_operators::embed::normalize(&mut qn);
    let params = RecommendParams {
        k_collab: st.cfg.collaborative_k,
        ..RecommendParams::default()
    };
    // `retrieve` takes other users of the asking user's tenant only
    // (`steam::retrieve::peer`).
    let r = steam_retrieve::retrieve(view, user_id, &qn, &params);
    let mut by_proto: BTreeMap<MemoryId, Collaborative> = BTreeMap::new();
    for h in r.collaborative {
        let Some(pid) = h.via_prototype else { continue };
        let Some(proto) = view.prototype(pid) else {
            continue;
        };
        let c = by_proto.entry(pid).or_insert_with(|| Collaborative {
            prototype_id: pid.to_string(),
            content: proto.content.clone(),
            score: h.score,
            users: proto.users,
            memory_ids: Vec::new(),
            item_ids: Vec::new(),
        });
        c.score = c.score.max(h.score);
        c.memory_ids.push(h.memory_id.to_string());
        let shared = view.shared_items(pid);
        if let Some(m) = view.memory(h.memory_id) {
            for i in &m.items {
                if shared.is_some_and(|s| s.contains(i)) && !c.item_ids.contains(i) {
                    c.item_ids.push(i.clone());
                }
            }
        }
    }
    let mut out: Vec<Collaborative> = by_proto.into_values().collect();
    out.sort_by(|a, b| b.score.total_cmp(&a.score));
    out
}
