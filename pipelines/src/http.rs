//! The pipeline's HTTP endpoint: `/metrics`, `/healthz`, `/readyz`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

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
    crate::serve::serve_connections(
        listener,
        router(metrics, ready),
        std::time::Duration::from_secs(5),
        METRICS_CONNECTIONS,
        std::future::pending(),
    )
    .await
}
