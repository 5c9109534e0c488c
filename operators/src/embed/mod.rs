//! Text embeddings: one interface, two real engines.
//!
//! - [`MiniLm`]: all-MiniLM-L6-v2 in process (the `tokenizers` crate, and
//!   either steamrf's own forward pass on the kernels crate or candle's
//!   `BertModel`), loaded from a local Hugging Face-style directory.
//!   It is CPU-bound, so [`LocalEmbedder`] runs it on dedicated threads behind
//!   a bounded queue: callers on the async runtime only ever await.
//! - [`RemoteEmbedder`]: a client for OpenAI-compatible `/v1/embeddings`
//!   endpoints (text-embeddings-inference, vLLM, OpenAI) with a timeout,
//!   retries with backoff, and a cap on requests in flight.
//!
//! Every vector an [`Embedder`] returns is L2-normalised, so a dot product is
//! a cosine similarity (the kernels crate relies on this).

mod minilm;
mod native;
mod remote;
mod sparse;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::future::BoxFuture;

pub use minilm::{Backend, MiniLm, MiniLmOptions, Precision};
pub use remote::{RemoteEmbedder, RemoteOptions};
pub use sparse::{SparseVec, Splade, SpladeOptions};

/// The dimension of all-MiniLM-L6-v2, and of every embedding column.
pub const MINILM_DIM: usize = 384;

/// Embeddings of a batch of texts, in input order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Embeddings {
    /// Vector length.
    pub dim: usize,
    /// `len × dim` values, row-major, each row L2-normalised.
    pub vectors: Vec<f32>,
    /// Tokens consumed (after truncation; special tokens included).
    pub tokens: u64,
    /// Texts that were cut to the model's maximum length.
    pub truncated: u64,
}

impl Embeddings {
    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.vectors.len().checked_div(self.dim).unwrap_or(0)
    }

    /// Whether there are no vectors.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th vector.
    ///
    /// # Panics
    /// If `i >= self.len()`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.vectors[i * self.dim..(i + 1) * self.dim]
    }
}

/// Why a batch could not be embedded.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The options cannot run on this machine or backend (named in the message).
    #[error("{0}")]
    Unsupported(String),
    /// The model directory is missing a file or holds something unreadable.
    #[error("loading the model from {path}: {reason}")]
    Load {
        /// The file or directory.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The forward pass or tokenizer failed.
    #[error("embedding failed: {0}")]
    Model(String),
    /// The remote endpoint refused the input itself (HTTP 400, 413, 422: a
    /// text over its context length, a string it cannot take). Other texts
    /// may succeed; the caller can isolate the refused ones.
    #[error("embedding endpoint {url} rejected the input: {reason}")]
    Rejected {
        /// The endpoint.
        url: String,
        /// Its answer.
        reason: String,
    },
    /// The remote endpoint failed after retries, or answered something unusable.
    #[error("embedding endpoint {url}: {reason}")]
    Remote {
        /// The endpoint.
        url: String,
        /// What went wrong.
        reason: String,
        /// Whether a later attempt may succeed (timeouts, 429, 5xx).
        retryable: bool,
    },
    /// The embedder was shut down.
    #[error("the embedder is shut down")]
    Closed,
}

impl EmbedError {
    /// Whether the same call may succeed later.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Remote { retryable, .. } => *retryable,
            Self::Unsupported(_)
            | Self::Load { .. }
            | Self::Model(_)
            | Self::Rejected { .. }
            | Self::Closed => false,
        }
    }
}

/// Counters every embedder keeps; the pipeline exports them as metrics.
#[derive(Debug, Default)]
pub struct EmbedStats {
    /// Texts embedded.
    pub texts: AtomicU64,
    /// Tokens consumed.
    pub tokens: AtomicU64,
    /// Texts cut to the model's maximum length.
    pub truncated: AtomicU64,
    /// Remote calls retried (timeouts, 429, 5xx).
    pub retries: AtomicU64,
    /// Batches that failed for good.
    pub failures: AtomicU64,
}

impl EmbedStats {
    fn record(&self, e: &Embeddings) {
        self.texts.fetch_add(e.len() as u64, Ordering::Relaxed);
        self.tokens.fetch_add(e.tokens, Ordering::Relaxed);
        self.truncated.fetch_add(e.truncated, Ordering::Relaxed);
    }
}

/// Turns texts into L2-normalised vectors.
///
/// Implementations never block the caller's thread: CPU work runs elsewhere
/// and network calls are async.
pub trait Embedder: Send + Sync + 'static {
    /// Vector length.
    fn dim(&self) -> usize;

    /// A name for logs and provenance, e.g. `all-MiniLM-L6-v2`.
    fn model_id(&self) -> &str;

    /// The number format vectors are computed in (`f32`, `int8`), or
    /// `remote` when another process computes them.
    fn precision(&self) -> &'static str;

    /// Embeds `texts`; the result has one row per text, in order.
    fn embed(&self, texts: Vec<String>) -> BoxFuture<'static, Result<Embeddings, EmbedError>>;

    /// Counters since start.
    fn stats(&self) -> &EmbedStats;
}

/// L2-normalises `v` in place (a zero vector stays zero).
pub fn normalize(v: &mut [f32]) {
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let inv = 1.0 / norm.max(1e-12);
    for x in v {
        *x *= inv;
    }
}

/// Cuts `text` to at most `max_bytes` bytes at a character boundary.
///
/// Used before tokenizing so a megabyte of text costs no more than the model
/// can read: see [`MiniLmOptions::max_tokens`].
pub fn clip_bytes(text: &str, max_bytes: usize) -> &str {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

struct Job {
    texts: Vec<String>,
    reply: tokio::sync::oneshot::Sender<Result<Embeddings, EmbedError>>,
}

/// Runs a [`MiniLm`] on dedicated worker threads behind a bounded queue.
///
/// `embed` cuts its texts into jobs of one forward pass each (shortest
/// texts together, so a pass pads little), awaits free slots in the queue
/// (back-pressure) and then the results; so one call keeps every worker
/// busy, and the async runtime's threads never run the model.
pub struct LocalEmbedder {
    model_id: String,
    precision: Precision,
    dim: usize,
    batch_size: usize,
    jobs: tokio::sync::mpsc::Sender<Job>,
    stats: Arc<EmbedStats>,
}

impl std::fmt::Debug for LocalEmbedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalEmbedder")
            .field("model_id", &self.model_id)
            .field("dim", &self.dim)
            .finish_non_exhaustive()
    }
}

impl LocalEmbedder {
    /// Starts `workers` threads sharing `model`, with room for `queue` waiting jobs.
    ///
    /// # Errors
    /// If a thread cannot be spawned.
    pub fn start(model: MiniLm, workers: usize, queue: usize) -> Result<Self, EmbedError> {
        let model = Arc::new(model);
        let (tx, rx) = tokio::sync::mpsc::channel::<Job>(queue.max(1));
        let rx = Arc::new(std::sync::Mutex::new(rx));
        let stats = Arc::new(EmbedStats::default());
        for i in 0..workers.max(1) {
            let model = model.clone();
            let rx = rx.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name(format!("steamrf-embed-{i}"))
                .spawn(move || {
                    loop {
                        // One worker waits on the queue at a time; the others
                        // are busy or queued on the lock.
                        let job = {
                            let Ok(mut guard) = rx.lock() else { return };
                            guard.blocking_recv()
                        };
                        let Some(job) = job else { return };
                        let texts: Vec<&str> = job.texts.iter().map(String::as_str).collect();
                        let out = model.embed_sync(&texts);
                        match &out {
                            Ok(e) => stats.record(e),
                            Err(_) => {
                                stats.failures.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        // A caller that stopped waiting has dropped its receiver.
                        job.reply.send(out).ok();
                    }
                })
                .map_err(|e| EmbedError::Model(format!("spawning an embedding worker: {e}")))?;
        }
        Ok(Self {
            model_id: model.model_id().to_owned(),
            precision: model.precision(),
            dim: model.dim(),
            batch_size: model.batch_size(),
            jobs: tx,
            stats,
        })
    }
}

impl Embedder for LocalEmbedder {
    fn dim(&self) -> usize {
        self.dim
    }

    fn model_id(&self) -> &str {
        &self.model_id
    }

    fn precision(&self) -> &'static str {
        self.precision.as_str()
    }

    fn embed(&self, texts: Vec<String>) -> BoxFuture<'static, Result<Embeddings, EmbedError>> {
        let jobs = self.jobs.clone();
        let (dim, batch) = (self.dim, self.batch_size);
        Box::pin(async move {
            let n = texts.len();
            let mut out = Embeddings {
                dim,
                vectors: vec![0.0; n * dim],
                ..Embeddings::default()
            };
            if n == 0 {
                return Ok(out);
            }
            // Jobs of one forward pass, by length (bytes stand in for tokens).
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by_key(|&i| texts[i].len());
            let mut texts: Vec<Option<String>> = texts.into_iter().map(Some).collect();
            let mut pending = Vec::with_capacity(n.div_ceil(batch));
            for rows in order.chunks(batch) {
                let (reply, rx) = tokio::sync::oneshot::channel();
                let job: Vec<String> = rows.iter().filter_map(|&i| texts[i].take()).collect();
                jobs.send(Job { texts: job, reply })
                    .await
                    .map_err(|_| EmbedError::Closed)?;
                pending.push((rows, rx));
            }
            for (rows, rx) in pending {
                let part = rx.await.map_err(|_| EmbedError::Closed)??;
                out.tokens += part.tokens;
                out.truncated += part.truncated;
                for (&i, v) in rows.iter().zip(part.vectors.chunks(dim)) {
                    out.vectors[i * dim..(i + 1) * dim].copy_from_slice(v);
                }
            }
            Ok(out)
        })
    }

    fn stats(&self) -> &EmbedStats {
        &self.stats
    }
}
