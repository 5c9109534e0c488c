//! A client for OpenAI-compatible `POST /v1/embeddings` endpoints
//! (text-embeddings-inference, vLLM, OpenAI).
//!
//! A batch is split into requests of at most `max_batch` inputs, sent
//! concurrently under a cap of `max_in_flight` requests (callers wait for a
//! slot: back-pressure). Timeouts, connection errors, 429 and 5xx are retried
//! with exponential backoff and jitter (a `Retry-After` header is honoured, up
//! to `max_backoff`); other 4xx answers fail at once with the server's reason.
//! A batch that still fails is returned as an error, never dropped.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::BoxFuture;
use serde::Deserialize;

use super::{EmbedError, EmbedStats, Embedder, Embeddings, normalize};

/// Endpoint settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteOptions {
    /// Base URL (`http://tei:8080`) or the full `…/v1/embeddings` URL.
    pub url: String,
    /// The `model` field sent with each request.
    pub model: String,
    /// Sent as `Authorization: Bearer …` when set.
    pub api_key: Option<String>,
    /// Expected vector length; answers of another length are errors.
    pub dim: usize,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// First backoff; doubles per attempt, with jitter.
    pub initial_backoff: Duration,
    /// Longest wait between attempts (also caps `Retry-After`).
    pub max_backoff: Duration,
    /// Requests in flight at once, over all callers.
    pub max_in_flight: usize,
    /// Inputs per request.
    pub max_batch: usize,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8080".into(),
            model: "sentence-transformers/all-MiniLM-L6-v2".into(),
            api_key: None,
            dim: super::MINILM_DIM,
            timeout: Duration::from_secs(30),
            max_attempts: 6,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            max_in_flight: 4,
            max_batch: 128,
        }
    }
}

/// The OpenAI-compatible embeddings client.
#[derive(Debug, Clone)]
pub struct RemoteEmbedder {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: reqwest::Client,
    endpoint: String,
    opts: RemoteOptions,
    permits: tokio::sync::Semaphore,
    stats: EmbedStats,
}

#[derive(Deserialize)]
struct Response {
    data: Vec<Datum>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Datum {
    embedding: Vec<f32>,
    #[serde(default)]
    index: Option<usize>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
}

impl RemoteEmbedder {
    /// Builds the client (no request is made).
    ///
    /// # Errors
    /// If the HTTP client cannot be built or the URL is empty.
    pub fn new(opts: RemoteOptions) -> Result<Self, EmbedError> {
        if opts.url.trim().is_empty() {
            return Err(EmbedError::Remote {
                url: String::new(),
                reason: "no URL configured".into(),
                retryable: false,
            });
        }
        let endpoint = crate::http::endpoint(&opts.url, "embeddings");
        let client = crate::http::client(opts.timeout).map_err(|reason| EmbedError::Remote {
            url: endpoint.clone(),
            reason,
            retryable: false,
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                endpoint,
                permits: tokio::sync::Semaphore::new(opts.max_in_flight.max(1)),
                opts,
                stats: EmbedStats::default(),
            }),
        })
    }

    /// The URL requests go to.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }
}

impl Inner {
    fn err(&self, reason: impl Into<String>, retryable: bool) -> EmbedError {
        EmbedError::Remote {
            url: self.endpoint.clone(),
            reason: reason.into(),
            retryable,
        }
    }

    /// One request with retries.
    async fn request(&self, texts: &[String]) -> Result<Embeddings, EmbedError> {
        let body = serde_json::to_vec(&serde_json::json!({
            "model": self.opts.model,
            "input": texts,
            "encoding_format": "float",
        }))
        .map_err(|e| self.err(format!("serialising the request: {e}"), false))?;
        let mut attempt = 0u32;
        loop {
            let result = {
                let _permit = self
                    .permits
                    .acquire()
                    .await
                    .map_err(|_| EmbedError::Closed)?;
                self.attempt(&body, texts.len()).await
            };
            match result {
                Ok(e) => return Ok(e),
                Err((e, retry_after)) if e.retryable() && attempt + 1 < self.opts.max_attempts => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    let wait = retry_after
                        .unwrap_or_else(|| self.backoff(attempt))
                        .min(self.opts.max_backoff);
                    tracing::warn!(endpoint = %self.endpoint, attempt, error = %e, ?wait, "Embedding request failed; retrying.");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    fn backoff(&self, attempt: u32) -> Duration {
        crate::http::backoff(self.opts.initial_backoff, self.opts.max_backoff, attempt)
    }

    async fn attempt(
        &self,
        body: &[u8],
        n: usize,
    ) -> Result<Embeddings, (EmbedError, Option<Duration>)> {
        let bytes = crate::http::post_json(
            &self.client,
            &self.endpoint,
            self.opts.api_key.as_deref(),
            body,
        )
        .await
        .map_err(|f| {
            let e = if f.input_rejected {
                EmbedError::Rejected {
                    url: self.endpoint.clone(),
                    reason: f.reason,
                }
            } else {
                self.err(f.reason, f.retryable)
            };
            (e, f.retry_after)
        })?;
        let parsed: Response = serde_json::from_slice(&bytes)
            .map_err(|e| (self.err(format!("unreadable response: {e}"), false), None))?;
        if parsed.data.len() != n {
            return Err((
                self.err(
                    format!("asked for {n} embeddings, got {}", parsed.data.len()),
                    false,
                ),
                None,
            ));
        }
        let dim = self.opts.dim;
        let mut out = Embeddings {
            dim,
            vectors: vec![0.0; n * dim],
            tokens: parsed.usage.map_or(0, |u| u.prompt_tokens),
            truncated: 0,
        };
        let mut seen = vec![false; n];
        for (pos, d) in parsed.data.into_iter().enumerate() {
            let i = d.index.unwrap_or(pos);
            if i >= n || seen[i] {
                return Err((self.err(format!("bad or repeated index {i}"), false), None));
            }
            if d.embedding.len() != dim {
                return Err((
                    self.err(
                        format!(
                            "embedding of length {}, expected {dim} (check embed.dim)",
                            d.embedding.len()
                        ),
                        false,
                    ),
                    None,
                ));
            }
            if d.embedding.iter().any(|x| !x.is_finite()) {
                return Err((self.err("embedding with NaN or infinity", false), None));
            }
            seen[i] = true;
            let dst = &mut out.vectors[i * dim..(i + 1) * dim];
            dst.copy_from_slice(&d.embedding);
            normalize(dst);
        }
        Ok(out)
    }
}

impl Embedder for RemoteEmbedder {
    fn dim(&self) -> usize {
        self.inner.opts.dim
    }

    fn model_id(&self) -> &str {
        &self.inner.opts.model
    }

    fn precision(&self) -> &'static str {
        "remote"
    }

    fn embed(&self, texts: Vec<String>) -> BoxFuture<'static, Result<Embeddings, EmbedError>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let dim = inner.opts.dim;
            let chunks = texts.chunks(inner.opts.max_batch.max(1));
            let parts = futures::future::join_all(chunks.map(|c| inner.request(c))).await;
            let mut out = Embeddings {
                dim,
                vectors: Vec::with_capacity(texts.len() * dim),
                tokens: 0,
                truncated: 0,
            };
            for part in parts {
                match part {
                    Ok(p) => {
                        out.vectors.extend_from_slice(&p.vectors);
                        out.tokens += p.tokens;
                    }
                    Err(e) => {
                        inner.stats.failures.fetch_add(1, Ordering::Relaxed);
                        return Err(e);
                    }
                }
            }
            inner.stats.record(&out);
            Ok(out)
        })
    }

    fn stats(&self) -> &EmbedStats {
        &self.inner.stats
    }
}
