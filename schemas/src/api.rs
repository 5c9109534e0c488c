//! The retrieval service's request bodies (`POST /v1/retrieve`,
//! `POST /v1/recommend`) and their parsing. Like the event decoder, it never
//! panics and every error names the field at fault (`options.alpha`,
//! `candidates[3]`, `query_vector`); the service turns it into a 400. A fuzz
//! target (`fuzz/fuzz_targets/http_request.rs`) feeds it arbitrary bytes.
//!
//! Policy: unknown fields are rejected (a typo must not be silently
//! ignored), NaN and infinite values in a query vector are rejected (JSON
//! has no NaN; a number beyond f32's range would become infinite), and
//! strings are UTF-8 (anything else is a `body` error).

use serde::Deserialize;
use serde::de::DeserializeOwned;

/// The longest text query, in bytes.
pub const MAX_QUERY_BYTES: usize = 16 * 1024;
/// The most candidates one `/v1/recommend` request may rank.
pub const MAX_CANDIDATES: usize = 1000;
/// The longest user id, in bytes (as for events).
pub const MAX_USER_ID_BYTES: usize = crate::event::MAX_ID_BYTES;

/// A request field that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// The JSON path (`user_id`, `options.alpha`, `candidates[1]`), or
    /// `body` when the document as a whole is at fault.
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl FieldError {
    /// An error of `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for FieldError {}

/// Parses a JSON body; errors name the field.
///
/// # Errors
/// Malformed JSON (`body`), a missing, unknown or mistyped field.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, FieldError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        let field = if path == "." || path == "?" {
            root_field(&message).unwrap_or_else(|| "body".to_owned())
        } else {
            path
        };
        FieldError::new(field, message)
    })?;
    de.end()
        .map_err(|e| FieldError::new("body", format!("trailing characters: {e}")))?;
    Ok(value)
}

/// The field an error at the document's root names: serde reports unknown
/// and missing fields there, with the name in backticks.
pub fn root_field(message: &str) -> Option<String> {
    if message.starts_with("unknown field") || message.starts_with("missing field") {
        message.split('`').nth(1).map(str::to_owned)
    } else {
        None
    }
}

/// A user id: 1 to [`MAX_USER_ID_BYTES`] bytes, no control characters.
///
/// # Errors
/// A `user_id` error.
pub fn check_user(user_id: &str) -> Result<(), FieldError> {
    if user_id.is_empty() || user_id.len() > MAX_USER_ID_BYTES {
        return Err(FieldError::new(
            "user_id",
            format!("must be 1 to {MAX_USER_ID_BYTES} bytes"),
        ));
    }
    if user_id.chars().any(char::is_control) {
        return Err(FieldError::new(
            "user_id",
            "must not contain control characters",
        ));
    }
    Ok(())
}

/// A query embedding: `dim` finite values, not all zero.
///
/// # Errors
/// A `query_vector` error.
pub fn check_query_vector(query: &[f32], dim: usize) -> Result<(), FieldError> {
    if query.len() != dim {
        return Err(FieldError::new(
            "query_vector",
            format!("has {} values, expected {dim}", query.len()),
        ));
    }
    if let Some(i) = query.iter().position(|v| !v.is_finite()) {
        return Err(FieldError::new(
            "query_vector",
            format!("value {i} is not finite (NaN and infinities are rejected)"),
        ));
    }
    if query.iter().all(|v| *v == 0.0) {
        return Err(FieldError::new("query_vector", "is all zeros"));
    }
    // The service normalises the vector in f32: a norm whose square
    // overflows f32, or underflows it, would become a zero or non-unit
    // vector and score every memory alike.
    let norm = query
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum::<f64>()
        .sqrt();
    if !(QUERY_NORM_MIN..=QUERY_NORM_MAX).contains(&norm) {
        return Err(FieldError::new(
            "query_vector",
            format!(
                "has length {norm:.3e}; the service normalises it in f32, which needs a length between {QUERY_NORM_MIN:e} and {QUERY_NORM_MAX:e}"
            ),
        ));
    }
    Ok(())
}

/// The shortest `query_vector` accepted (its squared length must stay a
/// normal f32).
pub const QUERY_NORM_MIN: f64 = 1e-6;
/// The longest `query_vector` accepted (its squared length must stay
/// finite in f32).
pub const QUERY_NORM_MAX: f64 = 1e6;

/// `POST /v1/retrieve`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrieveRequest {
    /// Whose memory.
    pub user_id: String,
    /// A text query (embedded by the service).
    #[serde(default)]
    pub query: Option<String>,
    /// Or a query embedding.
    #[serde(default)]
    pub query_vector: Option<Vec<f32>>,
    /// Rows to return (overrides `options.k`); with passage windows,
    /// evidence units at most (without a `k`, only `max_turns` bounds
    /// them).
    #[serde(default)]
    pub k: Option<usize>,
    /// Turns the answer hands over at most (default: `serve.max_turns`, at
    /// most `serve.max_k`).
    #[serde(default)]
    pub max_turns: Option<usize>,
    /// Evidence units one session may give at most (default: `[serve.units]
    /// per_row`; 0: no cap). 1 spreads the answer over as many sessions as
    /// it can, with fewer turns of each.
    #[serde(default)]
    pub per_session: Option<usize>,
    /// RF-Mem overrides, by name (`mode`, `alpha`, `tau`, …); the service
    /// checks them against its parameters.
    #[serde(default)]
    pub options: Option<serde_json::Map<String, serde_json::Value>>,
    /// Include the local-to-global step (default: `serve.collaborative`).
    #[serde(default)]
    pub collaborative: Option<bool>,
}

impl RetrieveRequest {
    /// Checks everything that needs no service state: the user id, exactly
    /// one of `query` and `query_vector`, the text's length, the vector
    /// (for embeddings of `dim` values).
    ///
    /// # Errors
    /// The first field at fault.
    pub fn check(&self, dim: usize) -> Result<(), FieldError> {
        check_user(&self.user_id)?;
        match (&self.query, &self.query_vector) {
            (Some(_), Some(_)) => Err(FieldError::new(
                "query",
                "send either query or query_vector, not both",
            )),
            (None, None) => Err(FieldError::new(
                "query",
                "query or query_vector is required",
            )),
            (None, Some(v)) => check_query_vector(v, dim),
            (Some(text), None) => {
                if text.trim().is_empty() || text.len() > MAX_QUERY_BYTES {
                    Err(FieldError::new(
                        "query",
                        format!("must be 1 to {MAX_QUERY_BYTES} bytes of text"),
                    ))
                } else {
                    Ok(())
                }
            }
        }
    }
}

/// `POST /v1/recommend`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecommendRequest {
    /// For whom.
    pub user_id: String,
    /// Item ids to rank.
    pub candidates: Vec<String>,
    /// Return only the best k (default: all).
    #[serde(default)]
    pub k: Option<usize>,
}

impl RecommendRequest {
    /// Checks the user id, the candidates (1 to [`MAX_CANDIDATES`], none
    /// empty) and `k` (> 0).
    ///
    /// # Errors
    /// The first field at fault.
    pub fn check(&self) -> Result<(), FieldError> {
        check_user(&self.user_id)?;
        if self.candidates.is_empty() || self.candidates.len() > MAX_CANDIDATES {
            return Err(FieldError::new(
                "candidates",
                format!("must hold 1 to {MAX_CANDIDATES} item ids"),
            ));
        }
        if let Some(i) = self.candidates.iter().position(|c| c.is_empty()) {
            return Err(FieldError::new(
                format!("candidates[{i}]"),
                "must not be empty",
            ));
        }
        if self.k == Some(0) {
            return Err(FieldError::new("k", "must be > 0"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retrieve(body: &str) -> Result<RetrieveRequest, FieldError> {
        let r: RetrieveRequest = parse(body.as_bytes())?;
        r.check(3)?;
        Ok(r)
    }

    #[track_caller]
    fn field(r: Result<impl std::fmt::Debug, FieldError>) -> String {
        r.expect_err("should fail").field
    }

    #[test]
    fn every_error_names_its_field() {
        assert!(retrieve(r#"{"user_id":"u","query":"jazz"}"#).is_ok());
        assert!(retrieve(r#"{"user_id":"u","query_vector":[1,0,0]}"#).is_ok());
        assert_eq!(field(retrieve("{")), "body");
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query":"x"} trailing"#)),
            "body"
        );
        assert_eq!(field(retrieve(r#"{"query":"x"}"#)), "user_id");
        assert_eq!(field(retrieve(r#"{"user_id":"u","quer":"x"}"#)), "quer");
        assert_eq!(field(retrieve(r#"{"user_id":"","query":"x"}"#)), "user_id");
        assert_eq!(
            field(retrieve("{\"user_id\":\"a\\u0000b\",\"query\":\"x\"}")),
            "user_id"
        );
        assert_eq!(field(retrieve(r#"{"user_id":"u"}"#)), "query");
        assert_eq!(field(retrieve(r#"{"user_id":"u","query":"  "}"#)), "query");
        assert_eq!(
            field(retrieve(
                r#"{"user_id":"u","query":"x","query_vector":[1,0,0]}"#
            )),
            "query"
        );
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query_vector":[1,0]}"#)),
            "query_vector"
        );
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query_vector":[0,0,0]}"#)),
            "query_vector"
        );
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query_vector":[1e39,0,0]}"#)),
            "query_vector"
        );
        // Finite, not all zero, but of a length f32 normalisation cannot
        // make unit: 400 naming the field (issue 44).
        for v in ["[3e20,0,0]", "[1e-30,1e-30,0]", "[1e-7,0,0]", "[2e6,0,0]"] {
            assert_eq!(
                field(retrieve(&format!(
                    r#"{{"user_id":"u","query_vector":{v}}}"#
                ))),
                "query_vector",
                "{v}"
            );
        }
        assert!(retrieve(r#"{"user_id":"u","query_vector":[1e-5,0,0]}"#).is_ok());
        assert!(retrieve(r#"{"user_id":"u","query_vector":[3e5,4e5,0]}"#).is_ok());
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query_vector":[1,"a",0]}"#)),
            "query_vector[1]"
        );
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query":"x","k":-1}"#)),
            "k"
        );
        assert_eq!(
            field(retrieve(r#"{"user_id":"u","query":"x","options":[]}"#)),
            "options"
        );
        let long = format!(r#"{{"user_id":"{}","query":"x"}}"#, "u".repeat(257));
        assert_eq!(field(retrieve(&long)), "user_id");
        // Invalid UTF-8 inside a string.
        let mut bad = br#"{"user_id":"u","query":"#.to_vec();
        bad.extend([b'"', 0xff, 0xfe, b'"', b'}']);
        assert_eq!(parse::<RetrieveRequest>(&bad).unwrap_err().field, "query");
    }

    #[test]
    fn recommend_checks_candidates_and_k() {
        let rec = |b: &str| parse::<RecommendRequest>(b.as_bytes()).and_then(|r| r.check());
        assert!(rec(r#"{"user_id":"u","candidates":["a","b"],"k":1}"#).is_ok());
        assert_eq!(
            field(rec(r#"{"user_id":"u","candidates":[]}"#)),
            "candidates"
        );
        assert_eq!(
            field(rec(r#"{"user_id":"u","candidates":["a",""]}"#)),
            "candidates[1]"
        );
        assert_eq!(
            field(rec(r#"{"user_id":"u","candidates":["a"],"k":0}"#)),
            "k"
        );
        assert_eq!(
            field(rec(r#"{"user_id":"u","candidates":["a",1]}"#)),
            "candidates[1]"
        );
    }
}
