//! The service's shared state: configuration, tokens, the cache and its
//! snapshot, metrics, the producer of `/v1/events`, and the single-flight
//! fills (one read per user or prototype at a time, joined by every miss
//! that arrives meanwhile).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use steamrf_operators::embed::Embedder;
use steamrf_operators::steam::MemoryId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::api_error::ApiError;
use super::auth::Auth;
use super::cache::{Cache, Loader, Members, Snapshot, UserData, View};
use super::events;
use super::metrics::ServeMetrics;
use crate::config::ServeConfig;
use crate::error::{Chain, Result};

/// A cache fill running as its own task.
pub(super) type Fill<T> = BoxFuture<'static, Result<T, FillError>>;

/// Why a fill gave no value (cloneable: waiters of one fill share it).
#[derive(Debug, Clone)]
pub(super) enum FillError {
    Failed(String),
    Panicked(String),
}

/// Shared by every request.
pub struct AppState {
    pub(super) snapshot: RwLock<Arc<Snapshot>>,
    /// Users and prototype members, bounded by `serve.cache_bytes`.
    pub(super) cache: Cache,
    /// Where the cache reads a miss from.
    pub(super) loader: Arc<dyn Loader>,
    /// `POST /v1/events`, when `serve.accept_events`.
    pub(super) events: Option<events::EventSink>,
    /// Permits for cache fills in flight (`serve.max_in_flight`). A fill
    /// runs on as its own task when the request that began it gives up, so
    /// its result is kept for the next one.
    pub(super) fills: Arc<Semaphore>,
    /// User fills in flight, by user: concurrent misses for one user wait on
    /// one read instead of each reading and building the same corpus.
    pub(super) user_fills: Mutex<HashMap<String, Shared<Fill<Arc<UserData>>>>>,
    pub(super) ready: AtomicBool,
    pub(super) cfg: ServeConfig,
    pub(super) separator: Option<char>,
    /// `steam.min_users`: an item is named to a community's members only
    /// when at least this many of them chose it.
    pub(super) min_users: usize,
    pub(super) embedder: Option<Arc<dyn Embedder>>,
    /// The learned sparse encoder of queries (`embed.sparse_model_dir`).
    pub(super) sparse: Option<Arc<steamrf_operators::embed::Splade>>,
    pub(super) auth: RwLock<Arc<Auth>>,
    pub(super) metrics: ServeMetrics,
    /// Permits for requests being answered (`serve.max_in_flight`).
    pub(super) in_flight: Arc<Semaphore>,
    /// When this state was made; `last_refresh_ms` counts from it.
    pub(super) born: Instant,
    /// Milliseconds after `born` of the last successful refresh.
    pub(super) last_refresh_ms: AtomicU64,
    /// Request ids: a per-process prefix and a counter.
    pub(super) id_prefix: u32,
    pub(super) next_id: AtomicU64,
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
            sparse: None,
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

    /// Encodes text queries with `encoder` too, for evidence units whose
    /// windows carry sparse vectors.
    #[must_use]
    pub fn with_sparse(mut self, encoder: Option<Arc<steamrf_operators::embed::Splade>>) -> Self {
        self.sparse = encoder;
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

    pub(super) fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{:08x}-{n:x}", self.id_prefix)
    }

    /// A permit to do a request's work, or a 503 when `max_in_flight`
    /// requests are already being answered (load shedding: the client is
    /// told to come back rather than queued behind work it cannot see).
    pub(super) fn admit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        self.in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.shed("requests are being answered"))
    }

    pub(super) fn shed(&self, what: &str) -> ApiError {
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
    pub(super) fn spawn_fill<T: Send + 'static>(
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
    pub(super) async fn wait_fill<T>(
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
    pub(super) fn epoch(&self) -> (u64, Arc<Snapshot>) {
        let since = self.cache.generation();
        (since, self.snapshot())
    }

    /// What a request for `user_id` reads: the current snapshot, the user,
    /// and with `collaborative` the members of the user's prototypes, all
    /// of one [`Self::epoch`].
    pub(super) async fn view(
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
    pub(super) async fn user_data(
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
    pub(super) async fn members_of(
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
