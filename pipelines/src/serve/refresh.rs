//! The service's background tasks: the tokens file reloaded on its own
//! task (a stalled store never keeps a revoked token valid), and the
//! refresh that swaps in a new snapshot and evicts what changed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arrow_array::cast::AsArray;

use super::auth::Auth;
use super::cache::{Changes, Snapshot, Tables};
use super::state::AppState;
use crate::error::{Chain, Error, Result};

/// The longest a read of the tokens file may take (see [`TokensFile::poll`]).
pub(super) const TOKENS_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Every `serve.refresh_interval` (at most every second) until `stop`:
/// reloads a changed tokens file. Its own task, so no refresh of the tables,
/// however slow, keeps a revoked token valid.
pub(super) async fn tokens_loop(st: Arc<AppState>, mut tokens: TokensFile, stop: Arc<AtomicBool>) {
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
pub(super) struct TokensFile {
    pub(super) path: String,
    pub(super) last: Vec<u8>,
    pub(super) last_error: Option<String>,
}

impl TokensFile {
    /// Reads and parses the file once; an empty path means no tokens. A
    /// file without a single token is refused (it would lock everyone out).
    pub(super) fn load(path: &str) -> Result<(Self, Auth)> {
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
    pub(super) async fn poll(&mut self, st: &AppState) {
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
pub(super) async fn refresh_loop(st: Arc<AppState>, tables: Arc<Tables>, stop: Arc<AtomicBool>) {
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
pub(super) async fn refresh(
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
