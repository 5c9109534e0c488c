//! Decode errors: which field, what went wrong, and a closed `kind` for metrics.

use std::fmt;

/// Why an event could not be decoded. A closed set: it is used as a metric
/// label and as the `steamrf-error-kind` dead-letter header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// The payload is not valid JSON (or not valid UTF-8).
    InvalidJson,
    /// A required field is absent.
    MissingField,
    /// A field is present but has the wrong type or an invalid value.
    InvalidField,
    /// `type` names no known event type.
    UnknownType,
    /// `schema_version` is not one this build reads.
    UnsupportedVersion,
    /// The payload is larger than `max_event_bytes`.
    Oversize,
}

impl DecodeErrorKind {
    /// Every kind, for pre-registering metric label values.
    pub const ALL: [Self; 6] = [
        Self::InvalidJson,
        Self::MissingField,
        Self::InvalidField,
        Self::UnknownType,
        Self::UnsupportedVersion,
        Self::Oversize,
    ];

    /// The snake_case name used in metrics and dead-letter headers.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidJson => "invalid_json",
            Self::MissingField => "missing_field",
            Self::InvalidField => "invalid_field",
            Self::UnknownType => "unknown_type",
            Self::UnsupportedVersion => "unsupported_version",
            Self::Oversize => "oversize",
        }
    }
}

impl fmt::Display for DecodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event that could not be decoded: the field (empty when the payload as a
/// whole is at fault) and a human-readable reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {}{reason}", if field.is_empty() { String::new() } else { format!("field `{field}`: ") })]
pub struct DecodeError {
    /// The closed classification.
    pub kind: DecodeErrorKind,
    /// The JSON path of the offending field, e.g. `user_id` or `categories[2]`.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl DecodeError {
    pub(crate) fn new(
        kind: DecodeErrorKind,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn missing(field: &str) -> Self {
        Self::new(
            DecodeErrorKind::MissingField,
            field,
            "required field is missing",
        )
    }

    pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Self::new(DecodeErrorKind::InvalidField, field, reason)
    }

    /// A payload over the size limit.
    pub fn oversize(len: usize, max: usize) -> Self {
        Self::new(
            DecodeErrorKind::Oversize,
            "",
            format!("payload is {len} bytes, more than max_event_bytes = {max}"),
        )
    }
}
