//! What every route shares: authentication and the tenant check, the
//! request's time budget, reading a bounded body within it, and answering
//! (a [`super::ApiError`] with its status, or the JSON body).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use steamrf_schemas::tenancy::tenant_of;

use super::api_error::{ApiError, json};
use super::auth::Scope;
use super::state::AppState;
use crate::error::Result;

/// Checks the bearer token before anything else is looked at.
pub(super) fn authenticate(st: &AppState, headers: &HeaderMap) -> Result<Scope, ApiError> {
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
pub(super) fn authorize(
    st: &AppState,
    scope: &Scope,
    user_id: &str,
    field: &str,
) -> Result<(), ApiError> {
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

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What a request may still spend: its deadline (`serve.request_timeout`
/// from arrival), and whether its client is still waiting.
#[derive(Debug, Clone)]
pub(super) struct Budget {
    pub(super) deadline: Instant,
    pub(super) gone: Arc<AtomicBool>,
}

impl Budget {
    pub(super) fn exhausted(&self) -> bool {
        self.gone.load(Ordering::Relaxed) || Instant::now() >= self.deadline
    }
}

/// Sets its flag when dropped: hyper drops a request's future when its
/// connection closes, and the blocking retrieval sees the flag between rounds.
pub(super) struct SetOnDrop(pub(super) Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Reads a request body within `serve.body_timeout` and `max_request_bytes`.
pub(super) async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
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
pub(super) fn respond<T: Serialize>(
    st: &AppState,
    route: &str,
    id: &str,
    started: Instant,
    result: Result<T, ApiError>,
) -> Response {
    respond_with(st, route, id, started, StatusCode::OK, result)
}

/// [`respond`] with `ok` as the success status.
pub(super) fn respond_with<T: Serialize>(
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
