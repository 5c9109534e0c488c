//! What every route shares: the JSON error that names the field,
//! authentication and the tenant check, the request's time budget, reading
//! a bounded body within it, and answering with a status per error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use steamrf_schemas::api::FieldError;
use steamrf_schemas::tenancy::tenant_of;

use super::auth::Scope;
use super::state::AppState;
use crate::error::Result;

/// An API error: a status, a machine-readable code, the offending field.
#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    pub(super) status: StatusCode,
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
    pub(super) fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            code: "invalid_request",
            field: Some(field.into()),
            message: message.into(),
            request_id: None,
        }
    }

    /// An internal error; `message` is logged, never sent.
    pub(super) fn internal(message: impl Into<String>) -> Self {
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
    pub(super) fn for_request(mut self, route: &str, id: &str) -> Self {
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

pub(super) fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
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
