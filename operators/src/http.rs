//! HTTP plumbing shared by the OpenAI-compatible clients (embeddings in
//! `embed::remote`, chat in `llm`): endpoint URLs, one JSON POST with its
//! failure classified, and the backoff between attempts. Each client keeps
//! its own retry loop (the chat client checks its token budget per attempt)
//! and its own response parsing.

use std::time::Duration;

/// `base` if it already ends with `/{path}`, else `base/{path}` or
/// `base/v1/{path}`.
pub(crate) fn endpoint(base: &str, path: &str) -> String {
    let url = base.trim_end_matches('/');
    if url.ends_with(&format!("/{path}")) {
        url.to_owned()
    } else if url.ends_with("/v1") {
        format!("{url}/{path}")
    } else {
        format!("{url}/v1/{path}")
    }
}

/// A client with a per-request timeout.
pub(crate) fn client(timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| format!("building the HTTP client: {e}"))
}

/// A failed attempt.
#[derive(Debug)]
pub(crate) struct Failure {
    /// What went wrong, for the error message.
    pub(crate) reason: String,
    /// Timeouts, connection errors, 429 and 5xx.
    pub(crate) retryable: bool,
    /// The server refused the request's content (400, 413, 422): the same
    /// input will always fail, other input may not.
    pub(crate) input_rejected: bool,
    /// The server's `Retry-After`, in seconds, if it sent one.
    pub(crate) retry_after: Option<Duration>,
}

/// POSTs `body` as JSON once; the body of a 2xx answer, or the failure.
pub(crate) async fn post_json(
    client: &reqwest::Client,
    url: &str,
    api_key: Option<&str>,
    body: &[u8],
) -> Result<Vec<u8>, Failure> {
    let fail = |reason: String, retryable: bool| Failure {
        reason,
        retryable,
        input_rejected: false,
        retry_after: None,
    };
    let mut req = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_vec());
    if let Some(key) = api_key {
        req = req.header("authorization", format!("Bearer {key}"));
    }
    let resp = req.send().await.map_err(|e| {
        let kind = if e.is_timeout() {
            "timed out"
        } else {
            "failed"
        };
        fail(format!("request {kind}: {e}"), true)
    })?;
    let status = resp.status();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| fail(format!("reading the response: {e}"), true))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
        return Err(Failure {
            reason: format!("HTTP {status}: {text}"),
            retryable: status.as_u16() == 429 || status.is_server_error(),
            input_rejected: matches!(status.as_u16(), 400 | 413 | 422),
            retry_after,
        });
    }
    Ok(bytes.to_vec())
}

/// Exponential backoff with jitter in [base/2, base], base = initial · 2^attempt ≤ max.
pub(crate) fn backoff(initial: Duration, max: Duration, attempt: u32) -> Duration {
    let base = initial.saturating_mul(1u32 << attempt.min(16)).min(max);
    base.mul_f64(rand::random::<f64>() * 0.5 + 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint("http://h:8080", "embeddings"),
            "http://h:8080/v1/embeddings"
        );
        assert_eq!(
            endpoint("http://h/v1/", "embeddings"),
            "http://h/v1/embeddings"
        );
        assert_eq!(
            endpoint("http://h/v1/chat/completions", "chat/completions"),
            "http://h/v1/chat/completions"
        );
    }

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        let (i, m) = (Duration::from_millis(100), Duration::from_secs(1));
        for attempt in 0..8 {
            let b = backoff(i, m, attempt);
            let base = (i * (1 << attempt)).min(m);
            assert!(b >= base / 2 && b <= base, "{attempt}: {b:?}");
        }
    }
}
