//! `steamrf serve`: the RF-Mem retrieval service over the tables the
//! pipeline writes (docs/retrieval.md).
//!
//! - `POST /v1/retrieve`: RF-Mem over the user's corpus (probe, gate,
//!   familiarity top-k or recollection), then STEAM's local-to-global step
//!   through published prototypes; every answer explains itself.
//! - `POST /v1/recommend`: candidates ranked by the user's memories and the
//!   collaborative signal (STEAM's inference phase), with reasons.
//! - `POST /v1/events` (with `serve.accept_events`): events into the
//!   pipeline's input topic, for clients that do not speak Kafka; see
//!   [`events`].
//! - `/mcp`: the same as Model Context Protocol tools for LLM agents
//!   (`retrieve`, `recommend`, `remember`, `forget`); see `mcp.rs`.
//! - `GET /healthz`, `/readyz` (after the first snapshot), `/metrics`,
//!   `/openapi.json` (the checked-in `docs/openapi.json`).
//!
//! Reads come from a bounded per-user cache filled from the tables on a
//! miss, and a small shared [`cache::Snapshot`] swapped in by a refresh task
//! that also evicts what changed; see [`cache`].

pub mod auth;
pub mod cache;
pub mod events;
mod mcp;
mod metrics;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use serde::Serialize;
use steamrf_operators::embed::Embedder;
use steamrf_operators::passage;
use steamrf_operators::rank;
use steamrf_operators::rfmem::{self, RfMemParams};
use steamrf_operators::steam::MemoryId;
use steamrf_operators::steam::retrieve::{self as steam_retrieve, MemoryView, RecommendParams};
use steamrf_schemas::api::{self, FieldError};
pub use steamrf_schemas::api::{
    MAX_CANDIDATES, MAX_QUERY_BYTES, RecommendRequest, RetrieveRequest,
};
use steamrf_schemas::tenancy::tenant_of;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use self::auth::{Auth, Scope};
use self::cache::{Cache, Changes, Loader, Members, Snapshot, Tables, UserData, View};
pub use self::metrics::ServeMetrics;
use crate::config::{Config, ServeConfig};
use crate::error::{Chain, Error, Result};

/// A cache fill running as its own task.
type Fill<T> = BoxFuture<'static, Result<T, FillError>>;

/// Why a fill gave no value (cloneable: waiters of one fill share it).
#[derive(Debug, Clone)]
enum FillError {
    Failed(String),
    Panicked(String),
}

/// The checked-in OpenAPI document, served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

/// Shared by every request.
pub struct AppState {
    snapshot: RwLock<Arc<Snapshot>>,
    /// Users and prototype members, bounded by `serve.cache_bytes`.
    cache: Cache,
    /// Where the cache reads a miss from.
    loader: Arc<dyn Loader>,
    /// `POST /v1/events`, when `serve.accept_events`.
    events: Option<events::EventSink>,
    /// Permits for cache fills in flight (`serve.max_in_flight`). A fill
    /// runs on as its own task when the request that began it gives up, so
    /// its result is kept for the next one.
    fills: Arc<Semaphore>,
    /// User fills in flight, by user: concurrent misses for one user wait on
    /// one read instead of each reading and building the same corpus.
    user_fills: Mutex<HashMap<String, Shared<Fill<Arc<UserData>>>>>,
    ready: AtomicBool,
    cfg: ServeConfig,
    separator: Option<char>,
    /// `steam.min_users`: an item is named to a community's members only
    /// when at least this many of them chose it.
    min_users: usize,
    embedder: Option<Arc<dyn Embedder>>,
    auth: RwLock<Arc<Auth>>,
    metrics: ServeMetrics,
    /// Permits for requests being answered (`serve.max_in_flight`).
    in_flight: Arc<Semaphore>,
    /// When this state was made; `last_refresh_ms` counts from it.
    born: Instant,
    /// Milliseconds after `born` of the last successful refresh.
    last_refresh_ms: AtomicU64,
    /// Request ids: a per-process prefix and a counter.
    id_prefix: u32,
    next_id: AtomicU64,
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
    /// A service over `snapshot`, reading users from `loader` (tests build
    /// both directly).
    pub fn new(
        cfg: ServeConfig,
        separator: Option<char>,
        embedder: Option<Arc<dyn Embedder>>,
        auth: Auth,
        metrics: ServeMetrics,
        snapshot: Snapshot,
        loader: Arc<dyn Loader>,
    ) -> Self {
        Self {
            snapshot: RwLock::new(Arc::new(snapshot)),
            cache: Cache::new(cfg.cache_bytes.0),
            loader,
            events: None,
            fills: Arc::new(Semaphore::new(cfg.max_in_flight)),
            user_fills: Mutex::default(),
            ready: AtomicBool::new(false),
            in_flight: Arc::new(Semaphore::new(cfg.max_in_flight)),
            cfg,
            separator,
            min_users: steamrf_operators::steam::SteamParams::default().min_users,
            embedder,
            auth: RwLock::new(Arc::new(auth)),
            metrics,
            born: Instant::now(),
            last_refresh_ms: AtomicU64::new(0),
            id_prefix: rand::random(),
            next_id: AtomicU64::new(0),
        }
    }

    /// Names to a community's members only the items at least `min_users`
    /// of its users chose (`steam.min_users`; default 3).
    #[must_use]
    pub fn with_min_users(mut self, min_users: usize) -> Self {
        self.min_users = min_users;
        self
    }

    /// Accepts `POST /v1/events` into `sink`.
    #[must_use]
    pub fn with_events(mut self, sink: events::EventSink) -> Self {
        self.events = Some(sink);
        self
    }

    /// The tokens in force.
    pub fn auth(&self) -> Arc<Auth> {
        self.auth
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the tokens (a reloaded tokens file).
    pub fn set_auth(&self, auth: Auth) {
        *self
            .auth
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(auth);
    }

    /// Records a successful refresh: the snapshot is current as of now.
    pub fn refreshed(&self) {
        let ms = u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_refresh_ms.store(ms, Ordering::Release);
    }

    /// Time since the last successful refresh.
    pub fn staleness(&self) -> Duration {
        let last = Duration::from_millis(self.last_refresh_ms.load(Ordering::Acquire));
        self.born.elapsed().saturating_sub(last)
    }

    /// Whether `/readyz` says yes: a snapshot is loaded and a refresh has
    /// succeeded within `serve.max_staleness`.
    pub fn is_ready(&self) -> Result<(), String> {
        if !self.ready.load(Ordering::Acquire) {
            return Err("loading".into());
        }
        let stale = self.staleness();
        if stale > self.cfg.max_staleness {
            return Err(format!(
                "stale: no successful refresh of the tables for {:.1}s (serve.max_staleness {:?})",
                stale.as_secs_f64(),
                self.cfg.max_staleness
            ));
        }
        Ok(())
    }

    fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{:08x}-{n:x}", self.id_prefix)
    }

    /// A permit to do a request's work, or a 503 when `max_in_flight`
    /// requests are already being answered (load shedding: the client is
    /// told to come back rather than queued behind work it cannot see).
    fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.shed("requests are being answered"))
    }

    fn shed(&self, what: &str) -> ApiError {
        self.metrics.shed.inc();
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "overloaded",
            field: None,
            message: format!(
                "{} {what} (serve.max_in_flight); retry shortly",
                self.cfg.max_in_flight
            ),
            request_id: None,
        }
    }

    /// Runs `fill` as its own task, which outlives a request that gives up
    /// (so its result is cached for the next), under a fill permit.
    fn spawn_fill<T: Send + 'static>(
        &self,
        kind: &'static str,
        fill: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<Fill<T>, ApiError> {
        let permit = self
            .fills
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.shed("cache fills are running"))?;
        let hist = self.metrics.cache_fill_duration.with_label_values(&[kind]);
        let task = tokio::spawn(async move {
            let _permit = permit;
            let started = Instant::now();
            let r = fill.await;
            hist.observe(started.elapsed().as_secs_f64());
            r
        });
        Ok(async move {
            match task.await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(FillError::Failed(Chain(&e).to_string())),
                Err(e) => Err(FillError::Panicked(e.to_string())),
            }
        }
        .boxed())
    }

    /// Waits for a fill until `deadline`.
    async fn wait_fill<T>(
        kind: &'static str,
        deadline: Instant,
        fill: impl Future<Output = Result<T, FillError>>,
    ) -> Result<T, ApiError> {
        match tokio::time::timeout_at(deadline.into(), fill).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(FillError::Failed(e))) => Err(ApiError::internal(format!(
                "reading a {kind} from the tables: {e}"
            ))),
            Ok(Err(FillError::Panicked(e))) => Err(ApiError::internal(format!(
                "reading a {kind} panicked: {e}"
            ))),
            Err(_) => Err(ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                code: "overloaded",
                field: None,
                message: format!(
                    "reading this {kind} from the tables took longer than serve.request_timeout; it goes on, retry shortly"
                ),
                request_id: None,
            }),
        }
    }

    /// The cache generation and the snapshot a view reads, in that order.
    /// The refresh publishes a snapshot before it starts the generation that
    /// evicts what changed, so whatever a view reads from this snapshot is
    /// cached under a generation no newer than it: a fill that finishes
    /// after the next eviction is refused instead of caching rows of the old
    /// snapshot (members who left a prototype) under the new generation.
    fn epoch(&self) -> (u64, Arc<Snapshot>) {
        let since = self.cache.generation();
        (since, self.snapshot())
    }

    /// What a request for `user_id` reads: the current snapshot, the user,
    /// and with `collaborative` the members of the user's prototypes, all
    /// of one [`Self::epoch`].
    async fn view(
        self: &Arc<Self>,
        user_id: &str,
        collaborative: bool,
        deadline: Instant,
    ) -> Result<View, ApiError> {
        let (since, snap) = self.epoch();
        let user = self.user_data(&snap, since, user_id, deadline).await?;
        let members = if collaborative {
            self.members_of(&snap, since, &user, deadline).await?
        } else {
            Vec::new()
        };
        Ok(View {
            snap,
            user,
            members,
            separator: self.separator,
        })
    }

    /// A user's rows and memories: cached, or read from the tables.
    async fn user_data(
        self: &Arc<Self>,
        snap: &Arc<Snapshot>,
        since: u64,
        user_id: &str,
        deadline: Instant,
    ) -> Result<Arc<UserData>, ApiError> {
        if let Some(u) = self.cache.user(user_id) {
            self.metrics
                .cache_lookups
                .with_label_values(&["user", "hit"])
                .inc();
            return Ok(u);
        }
        let flight = {
            let mut flights = self
                .user_fills
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(f) = flights.get(user_id) {
                self.metrics
                    .cache_lookups
                    .with_label_values(&["user", "joined"])
                    .inc();
                f.clone()
            } else {
                self.metrics
                    .cache_lookups
                    .with_label_values(&["user", "miss"])
                    .inc();
                let (st, snap, id) = (self.clone(), snap.clone(), user_id.to_owned());
                let f = self
                    .spawn_fill("user", async move {
                        let read = async {
                            let u = Arc::new(st.loader.user(&st.cfg, &snap, &id).await?);
                            let evicted = st.cache.insert_user(&id, u.clone(), since);
                            st.metrics
                                .cache_evictions
                                .with_label_values(&["capacity"])
                                .inc_by(evicted as u64);
                            Ok(u)
                        };
                        let r = read.await;
                        // Kept (or refused) by the cache first, so a miss
                        // after this finds it there or starts a new read.
                        st.user_fills
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .remove(&id);
                        r
                    })?
                    .shared();
                flights.insert(user_id.to_owned(), f.clone());
                f
            }
        };
        Self::wait_fill("user", deadline, flight).await
    }

    /// The members of the published prototypes `user`'s memories are in:
    /// cached, or read from the tables (one read for all that are missing).
    async fn members_of(
        self: &Arc<Self>,
        snap: &Arc<Snapshot>,
        since: u64,
        user: &UserData,
        deadline: Instant,
    ) -> Result<Vec<Arc<Members>>, ApiError> {
        let mut out = Vec::new();
        let mut missing = Vec::new();
        for p in snap.prototypes_of(user) {
            match self.cache.members(p) {
                Some(m) => {
                    self.metrics
                        .cache_lookups
                        .with_label_values(&["prototype", "hit"])
                        .inc();
                    out.push(m);
                }
                None => {
                    self.metrics
                        .cache_lookups
                        .with_label_values(&["prototype", "miss"])
                        .inc();
                    missing.push(p);
                }
            }
        }
        if missing.is_empty() {
            return Ok(out);
        }
        let (st, snap) = (self.clone(), snap.clone());
        let fill = self.spawn_fill("prototype", async move {
            let ids: Vec<MemoryId> = missing
                .iter()
                .filter_map(|p| snap.prototypes.get(p))
                .flat_map(|p| p.members.iter().copied())
                .collect();
            let mut by_proto: BTreeMap<MemoryId, Vec<_>> =
                missing.iter().map(|&p| (p, Vec::new())).collect();
            for m in st.loader.memories(&ids).await? {
                if let Some(list) = snap
                    .community_of
                    .get(&m.id)
                    .and_then(|p| by_proto.get_mut(p))
                {
                    list.push(m);
                }
            }
            let mut out = Vec::with_capacity(by_proto.len());
            for (p, mems) in by_proto {
                let m = Arc::new(Members::new(p, mems, st.min_users));
                let evicted = st.cache.insert_members(p, m.clone(), since);
                st.metrics
                    .cache_evictions
                    .with_label_values(&["capacity"])
                    .inc_by(evicted as u64);
                out.push(m);
            }
            Ok(out)
        })?;
        out.extend(Self::wait_fill("prototype", deadline, fill).await?);
        Ok(out)
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Swaps in a new snapshot and marks the service ready (and fresh).
    pub fn publish(&self, s: Snapshot) {
        self.refreshed();
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
    /// `invalid_request`, `unauthenticated`, `forbidden`, `payload_too_large`,
    /// `request_timeout`, `overloaded`, `unavailable` (the broker did not acknowledge), `internal`, `not_found`.
    pub code: &'static str,
    /// The field at fault (`user_id`, `options.alpha`, `candidates[3]`), if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// What is wrong. For `internal` only a pointer to the server log: the
    /// cause (an upstream URL or body, a panic) stays there.
    pub message: String,
    /// The request's id (also the `x-request-id` header), under which the
    /// server logged the details of an internal error.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl ApiError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            field: Some(field.into()),
            message: message.into(),
            request_id: None,
        }
    }

    /// An internal error; `message` is logged, never sent.
    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            code: "internal",
            field: None,
            message: message.into(),
            request_id: None,
        }
    }

    /// Ties the error to a request: an internal error's cause is logged
    /// under the id and replaced by a pointer to it.
    fn for_request(mut self, route: &str, id: &str) -> Self {
        if self.status.is_server_error() && self.code == "internal" {
            tracing::error!(request_id = id, route, error = %self.message, "Request failed.");
            self.message =
                format!("internal error; the server logged its cause under request id {id}");
        }
        self.request_id = Some(id.to_owned());
        self
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let mut r = json(status, &serde_json::json!({ "error": self }));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
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
    st.auth().scope(h).map_err(|_| ApiError {
        status: StatusCode::UNAUTHORIZED,
        code: "unauthenticated",
        field: None,
        message: "a valid bearer token is required (Authorization: Bearer <token>)".into(),
        request_id: None,
    })
}

/// Whether `scope` may read `user_id`'s tenant; a 403 names `field`.
fn authorize(st: &AppState, scope: &Scope, user_id: &str, field: &str) -> Result<(), ApiError> {
    let tenant = tenant_of(user_id, st.separator);
    if scope.allows(tenant) {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::FORBIDDEN,
            code: "forbidden",
            field: Some(field.to_owned()),
            message: format!("this token may not read tenant {tenant:?}"),
            request_id: None,
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
    /// The fused score: `dense + lexical_weight · lexical` (the order).
    pub score: f32,
    /// The dense part: `mix ·` the best window's cosine `+ (1 − mix) ·` the
    /// whole row's (the row's cosine when it has no windows).
    pub dense: f32,
    /// The lexical part: the row's BM25 score for the query text over the
    /// most any row could score for it (0–1; 0 without query text).
    pub lexical: f32,
    /// The passage window that scored best, for a session with windows.
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

/// The work a request may ask for: the configured cost keys are ceilings,
/// and `k` and `probe_k` stop at `serve.max_k`.
fn check_bounds(cfg: &ServeConfig, p: &RfMemParams, k_at_top: bool) -> Result<(), ApiError> {
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

/// What a request may still spend: its deadline (`serve.request_timeout`
/// from arrival), and whether its client is still waiting.
#[derive(Debug, Clone)]
struct Budget {
    deadline: Instant,
    gone: Arc<AtomicBool>,
}

impl Budget {
    fn exhausted(&self) -> bool {
        self.gone.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }
}

/// Sets its flag when dropped: hyper drops a request's future when its
/// connection closes, and the blocking retrieval sees the flag between rounds.
struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Reads a request body within `serve.body_timeout` and `max_request_bytes`.
async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    use http_body_util::BodyExt;
    let limit = st.cfg.max_request_bytes.0;
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        code: "payload_too_large",
        field: None,
        message: format!("the request body is over serve.max_request_bytes ({limit} bytes)"),
        request_id: None,
    };
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Err(too_large());
    }
    let limited = http_body_util::Limited::new(body, limit);
    match tokio::time::timeout(st.cfg.body_timeout, limited.collect()).await {
        Err(_) => Err(ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            code: "request_timeout",
            field: None,
            message: format!(
                "the request body did not arrive within serve.body_timeout ({:?})",
                st.cfg.body_timeout
            ),
            request_id: None,
        }),
        Ok(Err(e))
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(too_large())
        }
        Ok(Err(e)) => Err(ApiError {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            field: None,
            message: format!("reading the request body: {e}"),
            request_id: None,
        }),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
    }
}

/// Counts a finished request and turns its result into the response, with
/// its `x-request-id`.
fn respond<T: Serialize>(
    st: &AppState,
    route: &str,
    id: &str,
    started: Instant,
    result: Result<T, ApiError>,
) -> Response {
    respond_with(st, route, id, started, StatusCode::OK, result)
}

/// [`respond`] with `ok` as the success status.
fn respond_with<T: Serialize>(
    st: &AppState,
    route: &str,
    id: &str,
    started: Instant,
    ok: StatusCode,
    result: Result<T, ApiError>,
) -> Response {
    st.metrics
        .finish(route, started, result.as_ref().err().map(|e| e.status));
    let mut r = match result {
        Ok(v) => json(ok, &v),
        Err(e) => e.for_request(route, id).into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

async fn retrieve(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let started = Instant::now();
    let id = st.request_id();
    let result = retrieve_inner(&st, req, started).await;
    respond(&st, "retrieve", &id, started, result)
}

async fn retrieve_inner(
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
async fn retrieve_as(
    st: &Arc<AppState>,
    scope: &Scope,
    mut req: RetrieveRequest,
    started: Instant,
) -> Result<RetrieveResponse, ApiError> {
    req.check(steamrf_schemas::tables::EMBEDDING_DIM)?;
    authorize(st, scope, &req.user_id, "user_id")?;
    let p = params_for(&st.cfg, &req)?;
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
fn answer(
    st: &AppState,
    view: &View,
    user_id: String,
    q: &[f32],
    query_text: Option<&str>,
    p: &RfMemParams,
    collaborative: bool,
    embed_time: Duration,
    started: Instant,
    budget: &Budget,
) -> Result<RetrieveResponse, ApiError> {
    let corpus = &view.user.corpus.index;
    let a = passage::retrieve_until(corpus, q, query_text, p, &st.cfg.hybrid, &|| {
        budget.exhausted()
    })
    .map_err(|e| match e {
        rfmem::Error::Invalid { field, reason } => ApiError::invalid(field, reason),
        other => ApiError::internal(other.to_string()),
    })?;
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
        .filter_map(|h| {
            let e = entries.get(h.row as usize)?;
            let passage = h.passage.and_then(|w| {
                let first = corpus.first_window(h.row)?;
                e.windows.get(w.checked_sub(first)? as usize).cloned()
            });
            let text = e.answer_text(passage.as_ref(), st.cfg.max_item_bytes.0);
            Some(Item {
                kind: e.kind,
                id: e.id.clone(),
                content: text.content,
                content_truncated: text.truncated,
                score: h.score,
                dense: h.dense,
                lexical: h.lexical,
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

/// STEAM's local-to-global step, limited to the user's tenant and to
/// published prototypes; other users appear only as memory ids, and their
/// items only when at least `min_users` of the community's users chose
/// them (an item fewer chose would single them out: docs/security.md).
fn local_to_global(st: &AppState, view: &View, user_id: &str, q: &[f32]) -> Vec<Collaborative> {
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

async fn recommend(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let started = Instant::now();
    let id = st.request_id();
    let result = recommend_inner(&st, req).await;
    respond(&st, "recommend", &id, started, result)
}

async fn recommend_inner(st: &Arc<AppState>, req: Request) -> Result<RecommendResponse, ApiError> {
    let (parts, body) = req.into_parts();
    let scope = authenticate(st, &parts.headers)?;
    let body = read_body(st, body).await?;
    let req: RecommendRequest = api::parse(&body)?;
    recommend_as(st, &scope, req).await
}

/// `/v1/recommend` (and MCP's `recommend`) for a caller with `scope`.
async fn recommend_as(
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

fn rank(st: &AppState, view: &View, req: RecommendRequest, deadline: Instant) -> RecommendResponse {
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

/// The router.
pub fn router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/retrieve", post(retrieve))
        .route("/v1/recommend", post(recommend))
        .route("/v1/events", post(events::events))
        .route("/mcp", mcp::route(&st))
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
                match st.is_ready() {
                    Ok(()) => (StatusCode::OK, "ready\n").into_response(),
                    Err(why) => {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response()
                    }
                }
            }),
        )
        .fallback(|| async {
            ApiError {
                status: StatusCode::NOT_FOUND,
                code: "not_found",
                field: None,
                message: "no such route (see /openapi.json)".into(),
                request_id: None,
            }
        })
        .with_state(st)
}

/// The longest a read of the tokens file may take (see [`TokensFile::poll`]).
const TOKENS_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Every `serve.refresh_interval` (at most every second) until `stop`:
/// reloads a changed tokens file. Its own task, so no refresh of the tables,
/// however slow, keeps a revoked token valid.
async fn tokens_loop(st: Arc<AppState>, mut tokens: TokensFile, stop: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(st.cfg.refresh_interval.min(Duration::from_secs(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        tokens.poll(&st).await;
    }
}

/// The tokens file, reloaded when its content changes (a rotated
/// Kubernetes Secret appears in the mounted file within a minute or so).
#[derive(Debug)]
struct TokensFile {
    path: String,
    last: Vec<u8>,
    last_error: Option<String>,
}

impl TokensFile {
    /// Reads and parses the file once; an empty path means no tokens. A
    /// file without a single token is refused (it would lock everyone out).
    fn load(path: &str) -> Result<(Self, Auth)> {
        let mut f = Self {
            path: path.to_owned(),
            last: Vec::new(),
            last_error: None,
        };
        if path.is_empty() {
            return Ok((f, Auth::open()));
        }
        f.last = std::fs::read(path).map_err(|e| Error::Config {
            problems: vec![format!("serve.tokens_file {path}: {e}")],
        })?;
        let auth = Auth::parse_in_force(&String::from_utf8_lossy(&f.last))?;
        Ok((f, auth))
    }

    /// Swaps in the file's tokens if its content changed and parses to at
    /// least one token; keeps the tokens in force otherwise (a half-written,
    /// emptied or broken file must not open the API or lock everyone out).
    /// A read that takes longer than [`TOKENS_READ_TIMEOUT`] (a stuck
    /// volume) counts as failed.
    async fn poll(&mut self, st: &AppState) {
        if self.path.is_empty() {
            return;
        }
        let read = tokio::time::timeout(TOKENS_READ_TIMEOUT, tokio::fs::read(&self.path)).await;
        let bytes = match read {
            Ok(Ok(b)) => Ok(b),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {TOKENS_READ_TIMEOUT:?}")),
        };
        let bytes = match bytes {
            Ok(b) => b,
            Err(e) => {
                if self.last_error.as_ref() != Some(&e) {
                    st.metrics.token_reloads.with_label_values(&["error"]).inc();
                    tracing::warn!(path = %self.path, error = %e, "Reading the tokens file failed; keeping the tokens in force.");
                    self.last_error = Some(e);
                }
                return;
            }
        };
        if bytes == self.last {
            return;
        }
        match Auth::parse_in_force(&String::from_utf8_lossy(&bytes)) {
            Ok(auth) => {
                st.metrics.token_reloads.with_label_values(&["ok"]).inc();
                tracing::info!(path = %self.path, tokens = auth.len(), "Tokens file reloaded.");
                st.set_auth(auth);
                self.last_error = None;
            }
            Err(e) => {
                st.metrics.token_reloads.with_label_values(&["error"]).inc();
                tracing::warn!(path = %self.path, error = %Chain(&e), "The tokens file changed but does not parse; keeping the tokens in force.");
                self.last_error = Some(e.to_string());
            }
        }
        self.last = bytes;
    }
}

/// Every `refresh_interval` until `stop`: checks the tables' versions and, when they moved, re-reads the shared
/// part if its tables changed, evicts the users and prototypes whose rows
/// changed, and publishes the new versions. A successful check marks the
/// service current (`/readyz`).
async fn refresh_loop(st: Arc<AppState>, tables: Arc<Tables>, stop: Arc<AtomicBool>) {
    let mut tick = tokio::time::interval(st.cfg.refresh_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        st.metrics.observe_cache(st.cache.stats());
        let current = st.snapshot();
        let versions = match tables.versions().await {
            Ok(v) => v,
            Err(e) => {
                st.metrics.refreshes.with_label_values(&["error"]).inc();
                tracing::warn!(error = %Chain(&e), stale_s = st.staleness().as_secs_f64(), "Checking table versions failed; serving the previous snapshot.");
                continue;
            }
        };
        let ready = st.ready.load(Ordering::Acquire);
        if versions == current.versions && ready {
            st.refreshed();
            continue;
        }
        let started = Instant::now();
        match refresh(&tables, &current, versions, ready).await {
            Ok((mut snap, changes)) => {
                snap.load_time = started.elapsed();
                st.metrics.refreshes.with_label_values(&["ok"]).inc();
                // Publish first, then evict: a fill that starts after the
                // eviction reads the new catalogue and rows.
                st.publish(snap);
                let evicted = st.cache.invalidate(&changes);
                st.metrics
                    .cache_evictions
                    .with_label_values(&["changed"])
                    .inc_by(evicted as u64);
                // Freed entries (and a replaced catalogue): hand the pages
                // back. Without this, glibc's per-thread arenas kept the
                // garbage and RSS grew with each swap (`bench soak`: 125 ->
                // 780 MiB in 3 minutes; docs/reliability.md).
                if (evicted > 0 || changes.all)
                    && let Err(e) = tokio::task::spawn_blocking(crate::alloc::trim).await
                {
                    tracing::warn!(error = %Chain(&e), "Trimming the heap failed.");
                }
                tracing::debug!(
                    users = changes.users.len(),
                    prototypes = changes.prototypes.len(),
                    all = changes.all,
                    evicted,
                    took = ?started.elapsed(),
                    "Tables changed."
                );
            }
            Err(e) => {
                st.metrics.refreshes.with_label_values(&["error"]).inc();
                tracing::warn!(error = %Chain(&e), stale_s = st.staleness().as_secs_f64(), "Refreshing from the tables failed; serving the previous snapshot.");
            }
        }
    }
}

/// The snapshot for `versions`, and what changed since `current`.
async fn refresh(
    tables: &Tables,
    current: &Snapshot,
    versions: BTreeMap<&'static str, u64>,
    ready: bool,
) -> Result<(Snapshot, Changes)> {
    let moved = |t: &str| versions.get(t) != current.versions.get(t);
    let mut changes = Changes {
        all: !ready,
        ..Changes::default()
    };
    let mut snap = if !ready || moved("items") || moved("prototypes") {
        tables.load_shared().await?
    } else {
        Snapshot {
            items: current.items.clone(),
            prototypes: current.prototypes.clone(),
            community_of: current.community_of.clone(),
            text: current.text.clone(),
            ..Snapshot::default()
        }
    };
    // Users per item: kept, or re-read once the table moved and the
    // interval passed (the first refresh always reads them).
    if let Some(interval) = tables.item_cf_interval() {
        let at = versions.get("interactions").copied().unwrap_or(0);
        let due = match (&current.item_cf, current.item_cf_at) {
            (Some(_), Some((read, version))) => {
                !ready || (version != at && read.elapsed() >= interval)
            }
            _ => true,
        };
        if due {
            snap.item_cf = Some(Arc::new(tables.item_cf().await?));
            snap.item_cf_at = Some((Instant::now(), at));
        } else {
            snap.item_cf = current.item_cf.clone();
            snap.item_cf_at = current.item_cf_at;
        }
    }
    if ready {
        // A changed item changes every row that shows it; a new one may
        // resolve clicks that were left out.
        if !Arc::ptr_eq(&snap.items, &current.items) {
            for (id, new) in snap.items.iter() {
                match current.items.get(id) {
                    Some(old) if old != new => changes.all = true,
                    Some(_) => {}
                    None => changes.unresolved = true,
                }
            }
        }
        // A prototype whose members or content changed, or that went.
        if !Arc::ptr_eq(&snap.prototypes, &current.prototypes) {
            for (id, old) in current.prototypes.iter() {
                if snap
                    .prototypes
                    .get(id)
                    .is_none_or(|new| new.members != old.members)
                {
                    changes.prototypes.insert(*id);
                }
            }
        }
        for (table, columns) in [
            ("interactions", &["user_id"][..]),
            ("turn_vectors", &["user_id"][..]),
            ("memories", &["user_id", "memory_id"][..]),
            ("passages", &["user_id"][..]),
        ] {
            if !moved(table) || changes.all {
                continue;
            }
            let from = current.versions.get(table).copied().unwrap_or(0);
            let Some(rows) = tables.changed_rows(table, from, columns).await? else {
                changes.all = true;
                continue;
            };
            for b in &rows {
                let users = b.column(0).as_string::<i32>();
                changes
                    .users
                    .extend(users.iter().flatten().map(str::to_owned));
                if table == "memories" {
                    // A member's content or vector changed: the prototypes it
                    // was and is in.
                    if crate::sink::ids::is_legacy(b.column(1)) {
                        // Until `steamrf migrate` has run: no members to find.
                        continue;
                    }
                    for m in crate::sink::ids::read_ids(b.column(1), "memories.memory_id")? {
                        for snap_ in [current, &snap] {
                            if let Some(p) = snap_.community_of.get(&m) {
                                changes.prototypes.insert(*p);
                            }
                        }
                    }
                }
            }
        }
    }
    snap.versions = versions;
    Ok((snap, changes))
}

/// Runs the service until `stop` is set.
///
/// # Errors
/// Configuration, binding, or LanceDB connection failures.
pub async fn run(config: Config, listen: Option<SocketAddr>, stop: Arc<AtomicBool>) -> Result<()> {
    crate::alloc::limit_arenas(config.serve.malloc_arenas);
    let addr: SocketAddr = match listen {
        Some(a) => a,
        None => config.serve.listen.parse().map_err(|_| Error::Config {
            problems: vec![format!(
                "serve.listen: {:?} is not an address",
                config.serve.listen
            )],
        })?,
    };
    let (tokens, auth) = TokensFile::load(&config.serve.tokens_file)?;
    if !auth.enabled() {
        tracing::warn!(
            "serve.tokens_file is empty: the API is open to anyone who can reach {addr}."
        );
    }
    let embedder = crate::embed::embedder(&config.embed)?;
    let db = crate::sink::connect(&config.lancedb).await?;
    // In the background: a slow store must not hold the listener back
    // (health checks and token reloads work before the first refresh).
    tokio::spawn({
        let db = db.clone();
        async move { crate::sink::admin::warn_if_pending(&db).await }
    });
    let weights = config.serve.ranker.weights();
    let tables = Arc::new(Tables::new(
        db,
        cache::SignalSources {
            item_template: weights
                .needs_text()
                .then(|| config.embed.item_template.clone()),
            item_cf: weights
                .needs_item_cf()
                .then_some(config.serve.ranker.stats_interval),
            tenant_separator: config.tenancy.separator(),
        },
    ));
    let mut st = AppState::new(
        config.serve.clone(),
        config.tenancy.separator(),
        embedder,
        auth,
        ServeMetrics::new(),
        Snapshot::default(),
        tables.clone(),
    )
    .with_min_users(config.steam.min_users);
    if config.serve.accept_events {
        let sink = events::EventSink::new(&config)?;
        tracing::info!(?sink, "POST /v1/events is on.");
        st = st.with_events(sink);
    }
    let st = Arc::new(st);
    let listener = TcpListener::bind(addr).await.map_err(|source| Error::Io {
        context: format!("binding {addr}"),
        source,
    })?;
    tracing::info!(%addr, "Retrieval service listening.");
    let refresher = tokio::spawn(refresh_loop(st.clone(), tables, stop.clone()));
    let reloader = tokio::spawn(tokens_loop(st.clone(), tokens, stop.clone()));
    let (header_timeout, max_connections) = (st.cfg.header_timeout, st.cfg.max_connections);
    let app = router(st);
    let shutdown = {
        let stop = stop.clone();
        async move {
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let served =
        crate::http::serve_connections(listener, app, header_timeout, max_connections, shutdown)
            .await;
    refresher.abort();
    reloader.abort();
    served.map_err(|source| Error::Io {
        context: "serving the API".into(),
        source,
    })
}

#[cfg(test)]
mod tests;
