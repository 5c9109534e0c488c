//! The pipeline's error type.

use std::time::Duration;

/// Where an error comes from, for retry decisions and the `error_type` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad configuration: fix the file, retrying will not help.
    Config,
    /// A dependency (Kafka, LanceDB, the object store) failed.
    External,
    /// A bug in steamrf.
    Internal,
}

impl ErrorKind {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Config => "config",
            Self::External => "external",
            Self::Internal => "internal",
        }
    }
}

/// `e` and its sources, one line each, as they add something: a cause whose
/// message the line before already holds (a foreign error that prints its
/// source and also returns it) is left out. The workspace's own errors
/// follow the rule that a message does not repeat its source, so this is
/// how they are printed whole: the CLI's `error:` / `caused by:` lines and
/// the logs' `error` field ([`Chain`]).
pub fn causes(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut out: Vec<String> = vec![e.to_string()];
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !text.trim().is_empty() && !out.last().is_some_and(|last| last.contains(text.trim())) {
            out.push(text);
        }
        next = cause.source();
    }
    out
}

/// Displays an error with its causes on one line (`a: b: c`), each said
/// once ([`causes`]): for logs, where `%e` alone would drop the causes.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&causes(self.0).join(": "))
    }
}

/// Errors of the ingest pipeline, the SQL command and the benchmarks.
/// A message says what steamrf was doing; the cause is its `source()`,
/// never repeated in the message ([`causes`] prints both).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The configuration is invalid; every problem is listed.
    #[error("invalid configuration:\n  - {}", .problems.join("\n  - "))]
    Config {
        /// One line per problem.
        problems: Vec<String>,
    },
    /// A Kafka operation failed.
    #[error("kafka: {context}")]
    Kafka {
        /// What steamrf was doing.
        context: String,
        /// The client error.
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// A LanceDB operation failed.
    #[error("lancedb: {context}")]
    Lance {
        /// What steamrf was doing.
        context: String,
        /// The LanceDB error.
        #[source]
        source: Box<lancedb::Error>,
    },
    /// Arrow rejected a batch.
    #[error("arrow rejected a batch")]
    Arrow(#[from] arrow_schema::ArrowError),
    /// A SQL query failed.
    #[error("the SQL query failed")]
    Sql(#[from] Box<datafusion::error::DataFusionError>),
    /// A file or socket operation failed.
    #[error("{context}")]
    Io {
        /// What steamrf was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Embedding a batch failed (after the engine's own retries).
    #[error("embedding")]
    Embed {
        /// Whether a later attempt may succeed.
        retryable: bool,
        /// The embedder's error.
        #[source]
        source: Box<steamrf_operators::embed::EmbedError>,
    },
    /// A bug.
    #[error("internal error: {message}")]
    Internal {
        /// What went wrong.
        message: String,
    },
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The error's domain.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Config { .. } => ErrorKind::Config,
            Self::Kafka { .. } | Self::Lance { .. } | Self::Io { .. } | Self::Embed { .. } => {
                ErrorKind::External
            }
            Self::Arrow(_) | Self::Sql(_) | Self::Internal { .. } => ErrorKind::Internal,
        }
    }

    /// Whether retrying the same operation may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Kafka { .. } | Self::Io { .. } => true,
            Self::Embed { retryable, .. } => *retryable,
            Self::Lance { source, .. } => !matches!(
                **source,
                lancedb::Error::InvalidInput { .. }
                    | lancedb::Error::InvalidTableName { .. }
                    | lancedb::Error::Schema { .. }
            ),
            _ => false,
        }
    }

    /// Wraps a LanceDB error with what was being done.
    pub fn lance(context: impl Into<String>) -> impl FnOnce(lancedb::Error) -> Self {
        let context = context.into();
        move |source| Self::Lance {
            context,
            source: Box::new(source),
        }
    }

    /// Wraps a Kafka error with what was being done.
    pub fn kafka(context: impl Into<String>) -> impl FnOnce(rdkafka::error::KafkaError) -> Self {
        let context = context.into();
        move |source| Self::Kafka { context, source }
    }
}

impl From<datafusion::error::DataFusionError> for Error {
    fn from(e: datafusion::error::DataFusionError) -> Self {
        Self::Sql(Box::new(e))
    }
}

/// Runs `op` until it succeeds, fails with a non-retryable error, or has
/// been tried `attempts` times, sleeping [`backoff`] between tries; every
/// retried error goes to `on_retry` (metrics) and the log, as `what` failed.
pub(crate) async fn retry<T, Fut>(
    attempts: u32,
    what: &str,
    on_retry: impl Fn(&Error),
    mut op: impl FnMut() -> Fut,
) -> Result<T>
where
    Fut: Future<Output = Result<T>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Err(e) if e.retryable() && attempt + 1 < attempts => {
                on_retry(&e);
                let wait = backoff(attempt);
                tracing::warn!(attempt, error = %Chain(&e), ?wait, "{what} failed; retrying.");
                tokio::time::sleep(wait).await;
                attempt += 1;
            }
            r => return r,
        }
    }
}

/// Exponential backoff for retryable errors: 100 ms doubling to 10 s.
pub(crate) fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << attempt.min(7))).min(Duration::from_secs(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A foreign error that prints its source and also returns it.
    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let io = || std::io::Error::other("disk full");
        let e = Error::Io {
            context: "writing the receipt".into(),
            source: io(),
        };
        assert_eq!(causes(&e), ["writing the receipt", "disk full"]);
        assert_eq!(Chain(&e).to_string(), "writing the receipt: disk full");
        // The foreign error's cause is in its own message: not repeated.
        assert_eq!(causes(&Repeats(io())), ["outer: disk full"]);
        // The workspace's own messages do not repeat their source.
        let sql = Error::from(datafusion::error::DataFusionError::Plan("no".into()));
        let all = causes(&sql);
        assert_eq!(all[0], "the SQL query failed");
        assert_eq!(all.len(), 2, "{all:?}");
        let embed = Error::Embed {
            retryable: false,
            source: Box::new(steamrf_operators::embed::EmbedError::Model("bad".into())),
        };
        assert_eq!(causes(&embed), ["embedding", "embedding failed: bad"]);
    }
}
