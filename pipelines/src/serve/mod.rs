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

mod api_error;
pub mod auth;
pub mod cache;
pub mod events;
mod mcp;
mod metrics;
mod recommend;
mod refresh;
mod request;
mod retrieve;
mod state;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
pub use steamrf_schemas::api::{
    MAX_CANDIDATES, MAX_QUERY_BYTES, RecommendRequest, RetrieveRequest,
};
use tokio::net::TcpListener;

pub use self::api_error::ApiError;
use self::cache::{Snapshot, Tables};
pub use self::metrics::ServeMetrics;
pub use self::recommend::{RankedItem, RecommendResponse, SignalValues};
use self::recommend::{recommend, recommend_as};
use self::refresh::{TokensFile, refresh_loop, tokens_loop};
use self::request::{authenticate, authorize, read_body, respond_with};
pub use self::retrieve::{Collaborative, Explanation, Item, Latency, Provenance, RetrieveResponse};
use self::retrieve::{retrieve, retrieve_as};
pub use self::state::AppState;
use crate::config::Config;
use crate::error::{Error, Result};

/// The checked-in OpenAPI document, served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../docs/openapi.json");

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
    let metrics = ServeMetrics::new();
    if let Some(e) = &embedder {
        metrics
            .embed_precision
            .with_label_values(&[e.precision()])
            .set(1);
    }
    let mut st = AppState::new(
        config.serve.clone(),
        config.tenancy.separator(),
        embedder,
        auth,
        metrics,
        Snapshot::default(),
        tables.clone(),
    )
    .with_min_users(config.steam.min_users)
    .with_sparse(crate::embed::sparse_encoder(&config.embed)?);
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
