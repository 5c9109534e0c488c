//! HTTP for every process: the accept loop both the pipeline's endpoint
//! and `steamrf serve` run on ([`serve_connections`]: header timeout,
//! connection cap, graceful shutdown), and the pipeline's and the
//! community writer's `/metrics`, `/healthz`, `/readyz` ([`metrics_server`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::error::{Chain, Error, Result};
use crate::metrics::Metrics;

/// The router.
pub fn router(metrics: Metrics, ready: Arc<AtomicBool>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "text/plain; version=0.0.4; charset=utf-8",
                        )],
                        body,
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let ok = ready.load(Ordering::Relaxed);
                async move {
                    if ok {
                        (StatusCode::OK, "ready\n").into_response()
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
                    }
                }
            }),
        )
}

/// Open connections the metrics server holds at most (scrapers and probes).
const METRICS_CONNECTIONS: usize = 256;

/// Serves the router until the task is aborted, closing connections that
/// do not send their headers within 5 s (as `steamrf serve` does), with at
/// most [`METRICS_CONNECTIONS`] open.
///
/// # Errors
/// An I/O error from the listener.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
) -> std::io::Result<()> {
    serve_connections(
        listener,
        router(metrics, ready),
        Duration::from_secs(5),
        METRICS_CONNECTIONS,
        std::future::pending(),
    )
    .await
}

/// Serves `/metrics`, `/healthz`, `/readyz` on `addr` until aborted.
///
/// # Errors
/// The address cannot be bound.
pub async fn metrics_server(
    addr: Option<SocketAddr>,
    metrics: &Metrics,
    ready: &Arc<AtomicBool>,
) -> Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let listener = TcpListener::bind(addr).await.map_err(|source| Error::Io {
        context: format!("binding the metrics address {addr}"),
        source,
    })?;
    tracing::info!(addr = %listener.local_addr().map_err(|source| Error::Io { context: "metrics address".into(), source })?, "Serving /metrics.");
    Ok(Some(tokio::spawn(serve(
        listener,
        metrics.clone(),
        ready.clone(),
    ))))
}

/// Serves `app` on `listener` until `shutdown` completes, then lets open
/// requests finish (10 s at most). Unlike `axum::serve`, a client must send
/// its request headers within `header_timeout` (hyper's header-read timer),
/// so connections that trickle or never finish their headers are closed.
/// At most `max_connections` are open at once: past that it accepts none
/// until one closes (new ones wait in the kernel's listen backlog).
///
/// # Errors
/// None today: accept errors (out of file descriptors) are logged and
/// retried after a pause.
pub async fn serve_connections(
    listener: TcpListener,
    app: Router,
    header_timeout: Duration,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = open.clone().acquire_owned() => slot.expect("never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %Chain(&e), "Accepting a connection failed; retrying in 100 ms.");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %Chain(&e), "Setting TCP_NODELAY failed.");
        }
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = conn.await {
                tracing::trace!(error = %Chain(&e), "Connection ended with an error.");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(Duration::from_secs(10), graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("Requests still open 10 s after shutdown began; closing them.");
    }
    Ok(())
}
