//! `steamrf serve`: the RF-Mem retrieval service over the tables the
//! pipeline writes (docs/retrieval.md).
//!
//! - `POST /v1/retrieve`: RF-Mem over the user's corpus (probe, gate,
//!   familiarity top-k or recollection), then STEAM's local-to-global step
//!   through published prototypes; every answer explains itself.
//! - `POST /v1/recommend`: candidates ranked by the user's memories and the
//!   collaborative signal (STEAM's inference phase), with reasons.
//! - `GET /healthz`, `/readyz` (after the first snapshot), `/metrics`,
//!   `/openapi.json` (the checked-in `docs/openapi.json`).
//!
//! Reads come from an immutable [`cache::Snapshot`] swapped in by a refresh
//! task; see [`cache`].

pub mod auth;
pub mod cache;
mod metrics;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use steamrf_operators::embed::Embedder;
use steamrf_operators::rfmem::{self, RfMemParams};
use steamrf_operators::steam::relations::tenant_of;
use steamrf_operators::steam::retrieve::RecommendParams;
use steamrf_operators::steam::{MemoryId, SteamParams};
use steamrf_schemas::api::{self, FieldError};
pub use steamrf_schemas::api::{
    MAX_CANDIDATES, MAX_QUERY_BYTES, RecommendRequest, RetrieveRequest,
};
use tokio::net::TcpListener;

use self::auth::{Auth, Scope};
use self::cache::{Snapshot, Tables};
pub use self::metrics::ServeMetrics;
use crate::config::{Config, ServeConfig};
use crate::error::{Error, Result};

/// The checked-in OpenAPI document, served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

/// Shared by every request.
pub struct AppState {
    snapshot: RwLock<Arc<Snapshot>>,
    ready: AtomicBool,
    cfg: ServeConfig,
    separator: Option<char>,
    embedder: Option<Arc<dyn Embedder>>,
    auth: Auth,
    metrics: ServeMetrics,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("ready", &self.ready)
            .field("auth", &self.auth)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// A service over `snapshot` (tests and benchmarks build one directly).
    pub fn new(
        cfg: ServeConfig,
        separator: Option<char>,
        embedder: Option<Arc<dyn Embedder>>,
        auth: Auth,
        metrics: ServeMetrics,
        snapshot: Snapshot,
    ) -> Self {
        Self {
            snapshot: RwLock::new(Arc::new(snapshot)),
            ready: AtomicBool::new(false),
            cfg,
            separator,
            embedder,
            auth,
            metrics,
        }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Swaps in a new snapshot and marks the service ready.
    pub fn publish(&self, s: Snapshot) {
        self.metrics.observe_snapshot(&s);
        *self
            .snapshot
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(s);
        self.ready.store(true, Ordering::Release);
    }
}

/// An API error: a status, a machine-readable code, the offending field.
#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    status: StatusCode,
    /// `invalid_request`, `unauthenticated`, `forbidden`, `payload_too_large`, `internal`.
    pub code: &'static str,
    /// The field at fault (`user_id`, `options.alpha`, `candidates[3]`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

impl ApiError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            field: Some(field.into()),
            message: message.into(),
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: "internal",
            field: None,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        json(status, &serde_json::json!({ "error": self }))
    }
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_vec(body) {
        Ok(b) => (status, [(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

impl From<FieldError> for ApiError {
    fn from(e: FieldError) -> Self {
        Self::invalid(e.field, e.message)
    }
}

/// Checks the bearer token before anything else is looked at.
fn authenticate(st: &AppState, headers: &HeaderMap) -> Result<Scope, ApiError> {
    let h = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    st.auth.scope(h).map_err(|_| ApiError {
        status: StatusCode::UNAUTHORIZED,
        code: "unauthenticated",
        field: None,
        message: "a valid bearer token is required (Authorization: Bearer <token>)".into(),
    })
}

/// Whether `scope` may read `user_id`'s tenant.
fn authorize(st: &AppState, scope: &Scope, user_id: &str) -> Result<(), ApiError> {
    let tenant = tenant_of(user_id, st.separator);
    if scope.allows(tenant) {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::FORBIDDEN,
            code: "forbidden",
            field: Some("user_id".into()),
            message: format!("this token may not read tenant {tenant:?}"),
        })
    }
}

/// Where a result came from.
#[derive(Debug, Serialize)]
pub struct Provenance {
    /// Table.
    pub table: &'static str,
    /// Key(s) in it.
    pub ids: Vec<String>,
    /// Source events.
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
    /// Its text.
    pub content: String,
    /// Cosine with the query.
    pub score: f32,
    /// The recollection round that found it (0 for familiarity).
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
    /// Trailing rows added by the top-up of a short recollection.
    pub filled: usize,
    /// Rows in the user's corpus.
    pub corpus_rows: usize,
    /// Whether the corpus is searched approximately (IVF).
    pub approximate: bool,
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn params_for(cfg: &ServeConfig, req: &RetrieveRequest) -> Result<RfMemParams, ApiError> {
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

async fn query_vector(
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

async fn retrieve(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let result = retrieve_inner(&st, &headers, &body, started).await;
    st.metrics
        .finish("retrieve", started, result.as_ref().err().map(|e| e.status));
    match result {
        Ok(r) => json(StatusCode::OK, &r),
        Err(e) => e.into_response(),
    }
}

async fn retrieve_inner(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
    started: Instant,
) -> Result<RetrieveResponse, ApiError> {
    let scope = authenticate(st, headers)?;
    let mut req: RetrieveRequest = api::parse(body)?;
    req.check(steamrf_schemas::tables::EMBEDDING_DIM)?;
    authorize(st, &scope, &req.user_id)?;
    let p = params_for(&st.cfg, &req)?;
    let (q, embed_time) = query_vector(st, &mut req).await?;
    let collaborative = req.collaborative.unwrap_or(st.cfg.collaborative);
    let snap = st.snapshot();
    let st2 = st.clone();
    let user_id = req.user_id;
    tokio::task::spawn_blocking(move || {
        answer(
            &st2,
            &snap,
            user_id,
            &q,
            &p,
            collaborative,
            embed_time,
            started,
        )
    })
    .await
    .map_err(|e| ApiError::internal(format!("retrieval panicked: {e}")))?
}

#[allow(clippy::too_many_arguments)]
fn answer(
    st: &AppState,
    snap: &Snapshot,
    user_id: String,
    q: &[f32],
    p: &RfMemParams,
    collaborative: bool,
    embed_time: Duration,
    started: Instant,
) -> Result<RetrieveResponse, ApiError> {
    let empty;
    let corpus = match snap.users.get(&user_id) {
        Some(c) => &c.store,
        None => {
            empty = rfmem::VectorStore::flat(
                steamrf_kernels::Corpus::new(steamrf_schemas::tables::EMBEDDING_DIM),
                steamrf_kernels::cpu::CpuKernel::default(),
            );
            &empty
        }
    };
    let a = rfmem::retrieve(corpus, q, p).map_err(|e| match e {
        rfmem::Error::Invalid { field, reason } => ApiError::invalid(field, reason),
        other => ApiError::internal(other.to_string()),
    })?;
    st.metrics.observe_answer(&a);
    let entries = snap.users.get(&user_id).map(|c| &c.entries);
    let items = a
        .hits
        .iter()
        .filter_map(|h| {
            let e = entries?.get(h.index as usize)?;
            Some(Item {
                kind: e.kind,
                id: e.id.clone(),
                content: e.content.clone(),
                score: h.score,
                round: h.round,
                provenance: Provenance {
                    table: e.table,
                    ids: vec![e.id.clone()],
                    source_event_ids: e.source_event_ids.clone(),
                    partition: e.source.map(|s| s.0),
                    offset: e.source.map(|s| s.1),
                },
            })
        })
        .collect();
    let c_started = Instant::now();
    let collab = if collaborative {
        local_to_global(st, snap, &user_id, q)
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
            corpus_rows: corpus.len(),
            approximate: corpus.is_approximate(),
            table_versions: snap.versions.clone(),
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

/// STEAM's local-to-global step, limited to the user's tenant and to
/// published prototypes; other users appear only as memory and item ids.
fn local_to_global(st: &AppState, snap: &Snapshot, user_id: &str, q: &[f32]) -> Vec<Collaborative> {
    let mut qn = q.to_vec();
    steamrf_operators::embed::normalize(&mut qn);
    let params = RecommendParams {
        k_collab: st.cfg.collaborative_k,
        ..RecommendParams::default()
    };
    let r = snap.steam.retrieve(user_id, &qn, &params);
    let tenant = tenant_of(user_id, st.separator);
    let mut by_proto: BTreeMap<MemoryId, Collaborative> = BTreeMap::new();
    for h in r.collaborative {
        if tenant_of(&h.user_id, st.separator) != tenant {
            continue;
        }
        let Some(pid) = h.via_prototype else { continue };
        let Some(proto) = snap.steam.prototype(pid) else {
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
        if let Some(m) = snap.steam.memory(h.memory_id) {
            for i in &m.items {
                if !c.item_ids.contains(i) {
                    c.item_ids.push(i.clone());
                }
            }
        }
    }
    let mut out: Vec<Collaborative> = by_proto.into_values().collect();
    out.sort_by(|a, b| b.score.total_cmp(&a.score));
    out
}

/// One ranked candidate.
#[derive(Debug, Serialize)]
pub struct RankedItem {
    /// The item.
    pub item_id: String,
    /// The score (higher is better).
    pub score: f32,
    /// Cosine with the user's best-matching memory.
    pub local: f32,
    /// Cosine with the best collaborative memory.
    pub collab: f32,
    /// Share of collaborative memories whose users chose this item.
    pub seen: f32,
    /// The user's memory that matched best.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_id: Option<String>,
    /// Why, in words.
    pub reason: String,
}

/// The answer of `/v1/recommend`.
#[derive(Debug, Serialize)]
pub struct RecommendResponse {
    /// The user.
    pub user_id: String,
    /// Best first; unknown items last.
    pub ranked: Vec<RankedItem>,
}

async fn recommend(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let result = recommend_inner(&st, &headers, &body);
    st.metrics.finish(
        "recommend",
        started,
        result.as_ref().err().map(|e| e.status),
    );
    match result {
        Ok(r) => json(StatusCode::OK, &r),
        Err(e) => e.into_response(),
    }
}

fn recommend_inner(
    st: &AppState,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<RecommendResponse, ApiError> {
    let scope = authenticate(st, headers)?;
    let req: RecommendRequest = api::parse(body)?;
    req.check()?;
    authorize(st, &scope, &req.user_id)?;
    let snap = st.snapshot();
    let mut known = Vec::new();
    let mut unknown = Vec::new();
    for c in &req.candidates {
        match snap.items.get(c) {
            Some(info) => known.push((c.clone(), info.embedding.clone())),
            None => unknown.push(c.clone()),
        }
    }
    let params = RecommendParams {
        k_collab: st.cfg.collaborative_k,
        ..RecommendParams::default()
    };
    let mut ranked: Vec<RankedItem> = snap
        .steam
        .recommend(&req.user_id, &known, &params)
        .into_iter()
        .map(|r| {
            let memory = r.memory_id.and_then(|id| snap.steam.memory(id));
            let mut reason = match memory {
                Some(m) => format!("close to your memory \"{}\" ({:.2})", m.content, r.local),
                None => "no memories yet".to_owned(),
            };
            if r.seen > 0.0 {
                reason.push_str(&format!(
                    "; chosen by {:.0}% of similar users in your community",
                    r.seen * 100.0
                ));
            }
            RankedItem {
                item_id: r.item_id,
                score: r.score,
                local: r.local,
                collab: r.collab,
                seen: r.seen,
                memory_id: r.memory_id.map(|m| m.to_string()),
                reason,
            }
        })
        .collect();
    ranked.extend(unknown.into_iter().map(|item_id| RankedItem {
        item_id,
        score: f32::MIN,
        local: 0.0,
        collab: 0.0,
        seen: 0.0,
        memory_id: None,
        reason: "unknown item (not in the items table, or not embedded)".to_owned(),
    }));
    if let Some(k) = req.k {
        ranked.truncate(k);
    }
    Ok(RecommendResponse {
        user_id: req.user_id,
        ranked,
    })
}

/// The router.
pub fn router(st: Arc<AppState>) -> Router {
    let limit = st.cfg.max_request_bytes.0;
    Router::new()
        .route("/v1/retrieve", post(retrieve))
        .route("/v1/recommend", post(recommend))
        .route(
            "/openapi.json",
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
        )
        .route(
            "/metrics",
            get(|State(st): State<Arc<AppState>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    st.metrics.render(),
                )
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(st): State<Arc<AppState>>| async move {
                if st.ready.load(Ordering::Acquire) {
                    (StatusCode::OK, "ready\n").into_response()
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "loading\n").into_response()
                }
            }),
        )
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                code: "not_found",
                field: None,
                message: "no such route (see /openapi.json)".into(),
            }
        })
        .layer(DefaultBodyLimit::max(limit))
        .with_state(st)
}

/// Checks the tables every `refresh_interval` and publishes new snapshots
/// until `stop`.
async fn refresh_loop(
    st: Arc<AppState>,
    mut tables: Tables,
    params: SteamParams,
    stop: Arc<AtomicBool>,
) {
    let mut tick = tokio::time::interval(st.cfg.refresh_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let current = st.snapshot();
        let versions = match tables.versions().await {
            Ok(v) => v,
            Err(e) => {
                st.metrics.refreshes.with_label_values(&["error"]).inc();
                tracing::warn!(error = %e, "Checking table versions failed; serving the previous snapshot.");
                continue;
            }
        };
        if versions == current.versions && st.ready.load(Ordering::Acquire) {
            continue;
        }
        match tables.load(&st.cfg, params, versions).await {
            Ok(s) => {
                st.metrics.refreshes.with_label_values(&["ok"]).inc();
                tracing::debug!(rows = s.rows(), users = s.users.len(), took = ?s.load_time, "Snapshot loaded.");
                st.publish(s);
            }
            Err(e) => {
                st.metrics.refreshes.with_label_values(&["error"]).inc();
                tracing::warn!(error = %e, "Loading a snapshot failed; serving the previous one.");
            }
        }
    }
}

/// Runs the service until `stop` is set.
///
/// # Errors
/// Configuration, binding, or LanceDB connection failures.
pub async fn run(config: Config, listen: Option<SocketAddr>, stop: Arc<AtomicBool>) -> Result<()> {
    let addr: SocketAddr = match listen {
        Some(a) => a,
        None => config.serve.listen.parse().map_err(|_| Error::Config {
            problems: vec![format!(
                "serve.listen: {:?} is not an address",
                config.serve.listen
            )],
        })?,
    };
    let auth = Auth::load(&config.serve.tokens_file)?;
    if !auth.enabled() {
        tracing::warn!(
            "serve.tokens_file is empty: the API is open to anyone who can reach {addr}."
        );
    }
    let embedder = crate::embed::embedder(&config.embed)?;
    let params = config.steam_params();
    let db = crate::sink::connect(&config.lancedb).await?;
    let st = Arc::new(AppState::new(
        config.serve.clone(),
        config.tenancy.separator(),
        embedder,
        auth,
        ServeMetrics::new(),
        Snapshot::empty(params),
    ));
    let listener = TcpListener::bind(addr).await.map_err(|source| Error::Io {
        context: format!("binding {addr}"),
        source,
    })?;
    tracing::info!(%addr, "Retrieval service listening.");
    let refresher = tokio::spawn(refresh_loop(
        st.clone(),
        Tables::new(db),
        params,
        stop.clone(),
    ));
    let app = router(st);
    let shutdown = {
        let stop = stop.clone();
        async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await;
    refresher.abort();
    served.map_err(|source| Error::Io {
        context: "serving the API".into(),
        source,
    })
}

#[cfg(test)]
mod tests;
