//! The service's error answer: a status, a machine-readable code, the
//! field a bad request got wrong, and the request id under which an
//! internal error's cause was logged.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use steamrf_schemas::api::FieldError;

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
