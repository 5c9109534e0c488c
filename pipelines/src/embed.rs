//! The embed stage: between the source and the writer, embeds dialogue turns
//! (into the batch's `turn_vectors` rows), their passage windows (`passages`)
//! and new item versions (the `embedding` column of `items`).
//!
//! - Clicks and purchases are never embedded.
//! - A dialogue turn whose vector is already stored (a replay) is not
//!   embedded again: the batch carries the vector stored the first time, so
//!   that the STEAM stage, which runs after the write, observes it as it
//!   would have then.
//! - An item is embedded once per version: rows that are not newer than the
//!   stored item by `(timestamp, event_id)` are dropped from the batch before
//!   embedding (the write would not apply them).
//!
//! A failed embedding call fails the batch; the pipeline then stops without
//! committing its offsets, so nothing is lost (the remote engine retries
//! timeouts, 429 and 5xx itself before that). The exception is an endpoint
//! that refuses the input itself (HTTP 400, 413, 422): the call is split in
//! halves until the refused texts are isolated, their rows leave the batch
//! as [`RejectedRow`]s (the pipeline dead-letters them with the endpoint's
//! reason), and the rest of the batch goes on. A 401 or 404 (a configuration
//! fault that every text would meet) still stops the pipeline.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{Array, BooleanArray, RecordBatch, UInt32Array};
use steamrf_operators::embed::{
    Backend, EmbedError, Embedder, LocalEmbedder, MiniLm, MiniLmOptions, Precision, RemoteEmbedder,
    RemoteOptions, Splade, SpladeOptions,
};
use steamrf_schemas::TableName;
use steamrf_schemas::tables::{EMBEDDING_DIM, with_embeddings};

use crate::config::{EmbedBackend, EmbedConfig, EmbedEngine, EmbedPrecision};
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::sink::{LanceSink, dedup};

/// Local worker threads: `embed.workers`, or one per core when 0.
pub fn workers(cfg: &EmbedConfig) -> usize {
    if cfg.workers > 0 {
        cfg.workers
    } else {
        std::thread::available_parallelism().map_or(1, usize::from)
    }
}

/// `embed.precision` as the operators name it.
fn precision(cfg: &EmbedConfig) -> Precision {
    match cfg.precision {
        EmbedPrecision::Auto => Precision::Auto,
        EmbedPrecision::F32 => Precision::F32,
        EmbedPrecision::Int16 => Precision::Int16,
        EmbedPrecision::Int8 => Precision::Int8,
        EmbedPrecision::Bf16 => Precision::Bf16,
    }
}

/// Builds the configured embedder (`None` when embedding is off).
///
/// # Errors
/// [`Error::Config`] if the model cannot be loaded or has the wrong dimension.
pub fn embedder(cfg: &EmbedConfig) -> Result<Option<Arc<dyn Embedder>>> {
    let e: Arc<dyn Embedder> = match cfg.engine {
        EmbedEngine::Off => return Ok(None),
        EmbedEngine::Local => {
            let started = Instant::now();
            let model = MiniLm::load(
                Path::new(&cfg.model_dir),
                MiniLmOptions {
                    backend: match cfg.backend {
                        EmbedBackend::Native => Backend::Native,
                        EmbedBackend::Candle => Backend::Candle,
                    },
                    precision: precision(cfg),
                    max_tokens: cfg.max_tokens,
                    batch_size: cfg.batch_size,
                    ..MiniLmOptions::default()
                },
            )
            .map_err(|e| Error::Config {
                problems: vec![match e {
                    EmbedError::Unsupported(why) => format!("embed.precision: {why}"),
                    e => format!(
                        "embed.model_dir: {e} (run scripts/tools.sh to fetch all-MiniLM-L6-v2, or set embed.engine = \"remote\" or \"off\")"
                    ),
                }],
            })?;
            tracing::info!(
                model = model.model_id(),
                precision = model.precision().as_str(),
                configured = ?cfg.precision,
                took = ?started.elapsed(),
                "Embedding model loaded."
            );
            Arc::new(
                LocalEmbedder::start(model, workers(cfg), cfg.queue).map_err(|e| {
                    Error::Internal {
                        message: e.to_string(),
                    }
                })?,
            )
        }
        EmbedEngine::Remote => {
            let r = &cfg.remote;
            Arc::new(
                RemoteEmbedder::new(RemoteOptions {
                    url: r.url.clone(),
                    model: r.model.clone(),
                    api_key: (!r.api_key.is_empty()).then(|| r.api_key.clone()),
                    dim: EMBEDDING_DIM,
                    timeout: r.timeout,
                    max_attempts: r.max_attempts,
                    max_in_flight: r.max_in_flight,
                    max_batch: r.max_batch,
                    ..RemoteOptions::default()
                })
                .map_err(|e| Error::Config {
                    problems: vec![format!("embed.remote: {e}")],
                })?,
            )
        }
    };
    if e.dim() != EMBEDDING_DIM {
        return Err(Error::Config {
            problems: vec![format!(
                "embed: the model's vectors have {} dimensions; the tables store {EMBEDDING_DIM}",
                e.dim()
            )],
        });
    }
    Ok(Some(e))
}

/// Loads the configured sparse encoder (`None` when `embed.sparse_model_dir`
/// is empty or embedding is off).
///
/// # Errors
/// [`Error::Config`] if the model cannot be loaded.
pub fn sparse_encoder(cfg: &EmbedConfig) -> Result<Option<Arc<Splade>>> {
    if cfg.sparse_model_dir.is_empty() || cfg.engine == EmbedEngine::Off {
        return Ok(None);
    }
    let started = Instant::now();
    let model = Splade::load(
        Path::new(&cfg.sparse_model_dir),
        SpladeOptions {
            max_tokens: cfg.max_tokens,
            threads: workers(cfg),
            precision: precision(cfg),
            ..SpladeOptions::default()
        },
    )
    .map_err(|e| Error::Config {
        problems: vec![match e {
            EmbedError::Unsupported(why) => format!("embed.precision: {why}"),
            e => format!(
                "embed.sparse_model_dir: {e} (run scripts/tools.sh to fetch SPLADE-tiny, or set it to \"\" to switch sparse vectors off)"
            ),
        }],
    })?;
    tracing::info!(
        model = model.model_id(),
        precision = model.options().precision.as_str(),
        took = ?started.elapsed(),
        "Sparse encoder loaded."
    );
    Ok(Some(Arc::new(model)))
}

/// Renders an item as text with `template` (`{title}`, `{categories}`,
/// `{description}`), with surrounding whitespace trimmed.
pub fn item_text(template: &str, title: &str, categories: &[&str], description: &str) -> String {
    let text = template
        .replace("{title}", title)
        .replace("{categories}", &categories.join(", "))
        .replace("{description}", description);
    text.trim().to_owned()
}

/// The embed stage.
pub struct EmbedStage {
    embedder: Option<Arc<dyn Embedder>>,
    /// Each embedded dialogue turn's learned sparse vector, when set.
    sparse: Option<Arc<Splade>>,
    item_template: String,
    passage_turns: usize,
    /// The last turns of recently seen sessions: the embed stage runs ahead
    /// of the writer, so a turn from the previous batch may not be in the
    /// table yet when the next batch's windows need it.
    recent: std::sync::Mutex<Recent>,
    metrics: Metrics,
    retries_seen: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for EmbedStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbedStage")
            .field("model", &self.embedder.as_ref().map(|e| e.model_id()))
            .finish_non_exhaustive()
    }
}

impl EmbedStage {
    /// A stage running `embedder` (or doing nothing when `None`).
    pub fn new(
        embedder: Option<Arc<dyn Embedder>>,
        item_template: String,
        metrics: Metrics,
    ) -> Self {
        Self {
            embedder,
            sparse: None,
            item_template,
            passage_turns: 0,
            recent: Default::default(),
            metrics,
            retries_seen: Default::default(),
        }
    }

    /// Also embeds a passage window of `turns` turns ending at each new
    /// dialogue turn (0: none); see [`Self::apply`].
    #[must_use]
    pub fn with_passage_turns(mut self, turns: usize) -> Self {
        self.passage_turns = turns;
        self
    }

    /// Also stores each newly embedded dialogue turn's sparse vector from
    /// `encoder` (in `turn_vectors.terms` / `weights`).
    #[must_use]
    pub fn with_sparse(mut self, encoder: Option<Arc<Splade>>) -> Self {
        self.sparse = encoder;
        self
    }

    /// The sparse vectors of `texts` (on a blocking thread), as
    /// `(terms, weights)`.
    async fn encode_sparse(&self, texts: Vec<String>) -> Result<Vec<(Vec<u32>, Vec<f32>)>> {
        let Some(enc) = self.sparse.clone() else {
            return Ok(Vec::new());
        };
        let started = Instant::now();
        let n = texts.len();
        let out = tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            enc.encode(&refs)
        })
        .await
        .map_err(|e| Error::Internal {
            message: format!("the sparse encoder's thread failed: {e}"),
        })?
        .map_err(|e| Error::Internal {
            message: format!("sparse encoding: {e}"),
        })?;
        self.metrics
            .embed_texts
            .with_label_values(&["sparse"])
            .inc_by(n as u64);
        self.metrics
            .operator_duration
            .with_label_values(&["sparse"])
            .observe(started.elapsed().as_secs_f64());
        Ok(out.into_iter().map(|v| (v.terms, v.weights)).collect())
    }

    /// Embeds `texts`: the vectors of the accepted ones, in order, and the
    /// refused ones as (index, the endpoint's reason).
    async fn run(&self, kind: &'static str, texts: Vec<String>) -> Result<Embedded> {
        let Some(e) = &self.embedder else {
            return Ok(Embedded::default());
        };
        let started = Instant::now();
        let n = texts.len();
        let mut rows: Vec<Option<std::result::Result<Vec<f32>, String>>> = vec![None; n];
        // Ranges still to embed; a refused range of several texts is split.
        let mut todo = vec![(0, n)];
        while let Some((lo, hi)) = todo.pop() {
            let out = e.embed(texts[lo..hi].to_vec()).await;
            let retries = e.stats().retries.load(Ordering::Relaxed);
            let before = self.retries_seen.swap(retries, Ordering::Relaxed);
            self.metrics
                .embed_retries
                .inc_by(retries.saturating_sub(before));
            match out {
                Ok(out) => {
                    self.metrics.embed_tokens.inc_by(out.tokens);
                    self.metrics.embed_truncated.inc_by(out.truncated);
                    for (slot, v) in rows[lo..hi].iter_mut().zip(out.vectors.chunks(out.dim)) {
                        *slot = Some(Ok(v.to_vec()));
                    }
                }
                Err(EmbedError::Rejected { reason, .. }) if hi - lo == 1 => {
                    rows[lo] = Some(Err(reason));
                }
                Err(EmbedError::Rejected { .. }) => {
                    let mid = lo + (hi - lo) / 2;
                    todo.push((mid, hi));
                    todo.push((lo, mid));
                }
                Err(err) => {
                    self.metrics.embed_failures.inc();
                    return Err(Error::Embed {
                        retryable: err.retryable(),
                        source: Box::new(err),
                    });
                }
            }
        }
        self.metrics
            .embed_duration
            .observe(started.elapsed().as_secs_f64());
        let mut out = Embedded::default();
        for (i, r) in rows.into_iter().enumerate() {
            match r {
                Some(Ok(v)) => out.vectors.extend(v),
                Some(Err(reason)) => out.rejected.push((i, reason)),
                None => {
                    return Err(Error::Internal {
                        message: format!("text {i} of {n} was never embedded"),
                    });
                }
            }
        }
        self.metrics
            .embed_texts
            .with_label_values(&[kind])
            .inc_by((n - out.rejected.len()) as u64);
        self.metrics
            .embed_rejected
            .with_label_values(&[kind])
            .inc_by(out.rejected.len() as u64);
        Ok(out)
    }

    /// Fills the embedding columns of `tables` (see the module docs); rows
    /// whose text the endpoint refused leave `tables` and are returned.
    ///
    /// # Errors
    /// A failed lookup or embedding call; the batch must then not be committed.
    pub async fn apply(
        &self,
        sink: &LanceSink,
        tables: &mut steamrf_schemas::TableBatches,
    ) -> Result<Vec<RejectedRow>> {
        let mut rejected = Vec::new();
        if self.embedder.is_none() {
            return Ok(rejected);
        }
        let started = Instant::now();
        let texts_before = self.metrics.total_texts_embedded();
        let rows = tables
            .interactions
            .as_ref()
            .map_or(0, RecordBatch::num_rows)
            + tables.items.as_ref().map_or(0, RecordBatch::num_rows);
        if let Some(batch) = tables.interactions.take() {
            // The turns and their windows are embedded at once, so the
            // workers never wait for the end of one call to start the other.
            let mut refused = Vec::new();
            let (turns, windows) = tokio::join!(
                self.dialogue(sink, batch.clone(), &mut refused),
                self.passages(sink, &batch),
            );
            let (kept, vectors) = turns?;
            tables.passages = if refused.is_empty() {
                windows?
            } else {
                // A refused turn is dead-lettered, not stored, so no window
                // may hold it: the windows are made again without it (rare:
                // an endpoint refusing a text; their first embedding is lost).
                self.forget_recent(&batch, &kept)?;
                self.passages(sink, &kept).await?
            };
            rejected.extend(refused);
            tables.turn_vectors = vectors;
            tables.interactions = Some(kept);
        }
        if let Some(batch) = tables.items.take() {
            tables.items = self.items(sink, batch, &mut rejected).await?;
        }
        let op = |d: &str| self.metrics.operator_rows.with_label_values(&["embed", d]);
        op("in").inc_by(rows as u64);
        op("out").inc_by(self.metrics.total_texts_embedded() - texts_before);
        self.metrics
            .operator_duration
            .with_label_values(&["embed"])
            .observe(started.elapsed().as_secs_f64());
        Ok(rejected)
    }

    /// Embeds the batch's dialogue turns that have no stored vector; returns
    /// the batch (less the rows whose text the endpoint refused) and its
    /// `turn_vectors` rows: the new vectors and, for turns a replay finds
    /// stored, the stored ones.
    async fn dialogue(
        &self,
        sink: &LanceSink,
        batch: RecordBatch,
        rejected: &mut Vec<RejectedRow>,
    ) -> Result<(RecordBatch, Option<RecordBatch>)> {
        let col = |n: &str| column(&batch, n);
        let kind = col("kind")?.as_string::<i32>();
        let text = col("text")?.as_string::<i32>();
        let ids = col("event_id")?.as_string::<i32>();
        let users = col("user_id")?.as_string::<i32>();
        let all: Vec<usize> = (0..batch.num_rows())
            .filter(|&r| kind.value(r) == "dialogue_turn" && text.is_valid(r))
            .collect();
        // A turn is its user's: (user_id, event_id), as the tables key it.
        let key = |r: usize| (users.value(r), ids.value(r));
        let mut seen = std::collections::HashSet::new();
        let turns: Vec<usize> = all
            .iter()
            .copied()
            .filter(|&r| seen.insert(key(r)))
            .collect();
        if turns.is_empty() {
            return Ok((batch, None));
        }
        let keys: Vec<(&str, &str)> = turns.iter().map(|&r| key(r)).collect();
        // A replayed turn (a crash after the write, before the commit) keeps
        // the vector stored the first time: the STEAM stage, which runs after
        // the write, must still observe it, and nothing is embedded twice.
        // Only the same user's stored turn counts (docs/security.md).
        let stored = sink.stored_vectors(&keys).await?;
        let owned = |r: usize| (users.value(r).to_owned(), ids.value(r).to_owned());
        let (replayed, rows): (Vec<usize>, Vec<usize>) = turns
            .into_iter()
            .partition(|&r| stored.contains_key(&owned(r)));
        self.metrics
            .embed_skipped
            .with_label_values(&["dialogue_turn"])
            .inc_by((all.len() - rows.len()) as u64);
        let (mut at, mut flat) = (Vec::new(), Vec::new());
        for &r in &replayed {
            at.push(r);
            flat.extend_from_slice(&stored[&owned(r)]);
        }
        let mut refused = Vec::new();
        // Sparse vectors of the new turns (replayed ones are stored already:
        // the insert-if-absent write skips their rows).
        let mut sparse: Vec<Option<(Vec<u32>, Vec<f32>)>> = vec![None; at.len()];
        if !rows.is_empty() {
            let texts: Vec<String> = rows.iter().map(|&r| text.value(r).to_owned()).collect();
            let out = self.run("dialogue_turn", texts).await?;
            let (accepted, no) = out.by_row(&rows);
            let texts = accepted.iter().map(|&r| text.value(r).to_owned()).collect();
            let mut encoded = self.encode_sparse(texts).await?.into_iter();
            sparse.extend(accepted.iter().map(|_| encoded.next()));
            at.extend_from_slice(&accepted);
            flat.extend_from_slice(&out.vectors);
            refused = no;
        }
        let vectors = (!at.is_empty())
            .then(
                || -> std::result::Result<RecordBatch, arrow_schema::ArrowError> {
                    let tv = steamrf_schemas::tables::turn_vectors(&batch, &at, &flat)?;
                    if self.sparse.is_none() {
                        return Ok(tv);
                    }
                    let refs: Vec<Option<(&[u32], &[f32])>> = sparse
                        .iter()
                        .map(|s| s.as_ref().map(|(t, w)| (t.as_slice(), w.as_slice())))
                        .collect();
                    steamrf_schemas::tables::with_sparse_terms(&tv, &refs)
                },
            )
            .transpose()?;
        let batch = take_out(TableName::Interactions, batch, "text", refused, rejected)?;
        Ok((batch, vectors))
    }

    /// Drops from the recent turns the rows of `before` that `after` no
    /// longer has.
    fn forget_recent(&self, before: &RecordBatch, after: &RecordBatch) -> Result<()> {
        let ids = |b: &RecordBatch| -> Result<std::collections::HashSet<String>> {
            Ok(column(b, "event_id")?
                .as_string::<i32>()
                .iter()
                .flatten()
                .map(str::to_owned)
                .collect())
        };
        let (before, after) = (ids(before)?, ids(after)?);
        let gone: std::collections::HashSet<&String> = before.difference(&after).collect();
        let mut guard = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let recent = &mut *guard;
        for generation in [&mut recent.previous, &mut recent.current] {
            for turns in generation.values_mut() {
                turns.retain(|(_, id), _| !gone.contains(id));
            }
        }
        Ok(())
    }

    /// The `passages` rows of the batch's dialogue turns that have none
    /// stored: for each, the window of `passage_turns` turns of its session
    /// ending at it (by `(timestamp, event_id)`; the earlier turns from the
    /// batch or, when it lacks them, from `interactions`), rendered under a
    /// header naming who and the day, and embedded. A window the endpoint
    /// refuses is left out (its turn is stored; only the passage is
    /// missing, counted in `steamrf_embed_rejected_total{kind="passage"}`).
    async fn passages(&self, sink: &LanceSink, batch: &RecordBatch) -> Result<Option<RecordBatch>> {
        use std::collections::{BTreeMap, HashMap, HashSet};
        use steamrf_operators::passage::{header, render, utc_day};

        let n = self.passage_turns;
        if n == 0 || batch.num_rows() == 0 {
            return Ok(None);
        }
        let col = |c: &str| column(batch, c);
        let kind = col("kind")?.as_string::<i32>();
        let text = col("text")?.as_string::<i32>();
        let ids = col("event_id")?.as_string::<i32>();
        let users = col("user_id")?.as_string::<i32>();
        let sessions = col("session_id")?.as_string::<i32>();
        let roles = col("role")?.as_string::<i32>();
        let ts = col("timestamp")?.as_primitive::<TimestampMillisecondType>();
        let mut seen = HashSet::new();
        let turns: Vec<usize> = (0..batch.num_rows())
            .filter(|&r| {
                kind.value(r) == "dialogue_turn"
                    && text.is_valid(r)
                    && sessions.is_valid(r)
                    && seen.insert((users.value(r), ids.value(r)))
            })
            .collect();
        if turns.is_empty() {
            return Ok(None);
        }
        let keys: Vec<(&str, &str)> = turns
            .iter()
            .map(|&r| (users.value(r), ids.value(r)))
            .collect();
        let stored = sink.stored_turns(TableName::Passages, &keys).await?;
        let new: Vec<usize> = turns
            .iter()
            .copied()
            .filter(|&r| {
                !stored.contains_key(&(users.value(r).to_owned(), ids.value(r).to_owned()))
            })
            .collect();
        self.metrics
            .embed_skipped
            .with_label_values(&["passage"])
            .inc_by((turns.len() - new.len()) as u64);
        if new.is_empty() {
            return Ok(None);
        }
        // Every known turn of the sessions concerned: (timestamp, event id) → line.
        type Session = BTreeMap<(i64, String), String>;
        let line = |r: usize| {
            let role = if roles.is_valid(r) {
                roles.value(r)
            } else {
                "user"
            };
            format!("{role}: {}", text.value(r))
        };
        let mut known: HashMap<(&str, &str), Session> = HashMap::new();
        for &r in &new {
            known
                .entry((users.value(r), sessions.value(r)))
                .or_default();
        }
        for &r in &turns {
            if let Some(s) = known.get_mut(&(users.value(r), sessions.value(r))) {
                s.insert((ts.value(r), ids.value(r).to_owned()), line(r));
            }
        }
        // Turns of earlier batches the writer may not have written yet.
        {
            let recent = self
                .recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for ((u, s), turns) in known.iter_mut() {
                let key = ((*u).to_owned(), (*s).to_owned());
                for generation in [&recent.previous, &recent.current] {
                    if let Some(t) = generation.get(&key) {
                        for (k, l) in t {
                            turns.entry(k.clone()).or_insert_with(|| l.clone());
                        }
                    }
                }
            }
        }
        // Sessions where a new turn has fewer earlier turns known than its
        // window wants: read their stored turns.
        let short: Vec<(&str, &str)> = new
            .iter()
            .filter(|&&r| {
                let s = &known[&(users.value(r), sessions.value(r))];
                s.range(..(ts.value(r), ids.value(r).to_owned())).count() + 1 < n
            })
            .map(|&r| (users.value(r), sessions.value(r)))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let stored_turns = if short.is_empty() {
            Vec::new()
        } else {
            sink.session_turns(&short).await?
        };
        for (u, s, t, e, l) in &stored_turns {
            if let Some(k) = known.get_mut(&(u.as_str(), s.as_str())) {
                k.entry((*t, e.clone())).or_insert_with(|| l.clone());
            }
        }
        // Remember each session's last turns for the next batches.
        {
            let mut recent = self
                .recent
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for ((u, s), turns) in &known {
                let last: BTreeMap<(i64, String), String> = turns
                    .iter()
                    .rev()
                    .take(n)
                    .map(|(k, l)| (k.clone(), l.clone()))
                    .collect();
                recent
                    .current
                    .insert(((*u).to_owned(), (*s).to_owned()), last);
            }
            if recent.current.len() >= RECENT_SESSIONS {
                recent.previous = std::mem::take(&mut recent.current);
            }
        }
        let mut texts = Vec::with_capacity(new.len());
        let mut firsts = Vec::with_capacity(new.len());
        let mut counts = Vec::with_capacity(new.len());
        for &r in &new {
            let s = &known[&(users.value(r), sessions.value(r))];
            let end = (ts.value(r), ids.value(r).to_owned());
            let mut window: Vec<(&(i64, String), &String)> =
                s.range(..=end.clone()).rev().take(n).collect();
            window.reverse();
            let first = window.first().map_or(&end, |w| w.0);
            let lines: Vec<&str> = window.iter().map(|w| w.1.as_str()).collect();
            let who = if window.iter().any(|w| w.1.starts_with("assistant: ")) {
                "the assistant"
            } else {
                ""
            };
            texts.push(render(
                &header("Conversation", who, &utc_day(first.0)),
                &lines,
            ));
            firsts.push(first.1.clone());
            counts.push(window.len() as i32);
        }
        let out = self.run("passage", texts.clone()).await?;
        let (accepted, _refused) = out.by_row(&(0..new.len()).collect::<Vec<_>>());
        if accepted.is_empty() {
            return Ok(None);
        }
        let rows: Vec<u32> = accepted.iter().map(|&i| new[i] as u32).collect();
        let picked = arrow_select::take::take_record_batch(batch, &UInt32Array::from(rows))?;
        let pick = |c: &str| -> Result<arrow_array::ArrayRef> { Ok(column(&picked, c)?.clone()) };
        let schema = TableName::Passages.schema();
        let first_ids: arrow_array::StringArray =
            accepted.iter().map(|&i| Some(firsts[i].as_str())).collect();
        let turn_counts: arrow_array::Int32Array =
            accepted.iter().map(|&i| Some(counts[i])).collect();
        let window_texts: arrow_array::StringArray =
            accepted.iter().map(|&i| Some(texts[i].as_str())).collect();
        let embedding = steamrf_schemas::tables::embedding_array(&out.vectors, accepted.len())?;
        let b = RecordBatch::try_new(
            schema,
            vec![
                pick("event_id")?,
                pick("user_id")?,
                pick("session_id")?,
                pick("timestamp")?,
                Arc::new(first_ids),
                Arc::new(turn_counts),
                Arc::new(window_texts),
                embedding,
                pick("source_partition")?,
                pick("source_offset")?,
                pick("ingested_at")?,
            ],
        )?;
        Ok(Some(b))
    }

    async fn items(
        &self,
        sink: &LanceSink,
        batch: RecordBatch,
        rejected: &mut Vec<RejectedRow>,
    ) -> Result<Option<RecordBatch>> {
        let batch = dedup(TableName::Items, &batch)?;
        let keys: Vec<&str> = column(&batch, "item_id")?
            .as_string::<i32>()
            .iter()
            .map(Option::unwrap_or_default)
            .collect();
        let stored = sink.stored_versions(TableName::Items, &keys).await?;
        let ts = column(&batch, "timestamp")?.as_primitive::<TimestampMillisecondType>();
        let ev = column(&batch, "event_id")?.as_string::<i32>();
        let newer: Vec<u32> = (0..batch.num_rows())
            .filter(|&r| match stored.get(keys[r]) {
                None => true,
                Some((t, e)) => (ts.value(r), ev.value(r)) > (*t, e.as_str()),
            })
            .map(|r| r as u32)
            .collect();
        self.metrics
            .embed_skipped
            .with_label_values(&["item"])
            .inc_by((batch.num_rows() - newer.len()) as u64);
        if newer.is_empty() {
            return Ok(None);
        }
        let batch = if newer.len() == batch.num_rows() {
            batch
        } else {
            arrow_select::take::take_record_batch(&batch, &UInt32Array::from(newer))?
        };
        let title = column(&batch, "title")?.as_string::<i32>();
        let cats = column(&batch, "categories")?.as_list::<i32>();
        let desc = column(&batch, "description")?.as_string::<i32>();
        let texts: Vec<String> = (0..batch.num_rows())
            .map(|r| {
                let c = cats.value(r);
                let c = c.as_string::<i32>();
                let c: Vec<&str> = c.iter().flatten().collect();
                let d = if desc.is_valid(r) { desc.value(r) } else { "" };
                item_text(&self.item_template, title.value(r), &c, d)
            })
            .collect();
        let out = self.run("item", texts).await?;
        let rows: Vec<usize> = (0..batch.num_rows()).collect();
        let (accepted, refused) = out.by_row(&rows);
        let batch = with_embeddings(&batch, &accepted, &out.vectors)?;
        let batch = take_out(TableName::Items, batch, "title", refused, rejected)?;
        Ok((batch.num_rows() > 0).then_some(batch))
    }
}

/// Sessions' last turns, `(user, session)` → `(timestamp, event id)` →
/// `role: text`, in two generations: once the current one holds
/// [`RECENT_SESSIONS`] sessions it becomes the previous one and the one
/// before is dropped, so memory stays bounded and the last batches' turns
/// are always kept.
#[derive(Debug, Default)]
struct Recent {
    current: RecentTurns,
    previous: RecentTurns,
}

type RecentTurns =
    std::collections::HashMap<(String, String), std::collections::BTreeMap<(i64, String), String>>;

/// Sessions per generation of [`Recent`].
const RECENT_SESSIONS: usize = 50_000;

/// What [`EmbedStage::run`] made of a list of texts.
#[derive(Debug, Default)]
struct Embedded {
    /// The accepted texts' vectors, in order, `EMBEDDING_DIM` each.
    vectors: Vec<f32>,
    /// The refused texts: (index, the endpoint's reason).
    rejected: Vec<(usize, String)>,
}

impl Embedded {
    /// With `rows[i]` the batch row of text `i`: the accepted rows, and the
    /// refused ones with the endpoint's reason.
    fn by_row(&self, rows: &[usize]) -> (Vec<usize>, Vec<(usize, String)>) {
        let mut accepted = Vec::with_capacity(rows.len());
        let mut refused = Vec::new();
        // `rejected` is in text order.
        let mut rejected = self.rejected.iter().peekable();
        for (i, &row) in rows.iter().enumerate() {
            match rejected.next_if(|(j, _)| *j == i) {
                Some((_, why)) => refused.push((row, why.clone())),
                None => accepted.push(row),
            }
        }
        (accepted, refused)
    }
}

/// A row whose text the embedding endpoint refused (HTTP 400, 413, 422): it
/// is dead-lettered with the reason instead of written.
#[derive(Debug, Clone)]
pub struct RejectedRow {
    /// Its table.
    pub table: TableName,
    /// The field whose text was refused (`text` for a turn, `title` for the
    /// item text built from title, categories and description).
    pub field: &'static str,
    /// The endpoint's answer.
    pub reason: String,
    /// Kafka partition and offset of the event.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// The record key to dead-letter under (the user or the item id).
    pub key: String,
    /// The decoded row as JSON (values as text; the embedding left out):
    /// the original record is not kept past decoding.
    pub row: serde_json::Value,
}

/// Removes the `refused` rows (index, reason) from `batch`, describing each
/// in `out`.
fn take_out(
    table: TableName,
    batch: RecordBatch,
    field: &'static str,
    refused: Vec<(usize, String)>,
    out: &mut Vec<RejectedRow>,
) -> Result<RecordBatch> {
    if refused.is_empty() {
        return Ok(batch);
    }
    let partition =
        column(&batch, "source_partition")?.as_primitive::<arrow_array::types::Int32Type>();
    let offset = column(&batch, "source_offset")?.as_primitive::<arrow_array::types::Int64Type>();
    let key_col = match table {
        TableName::Items => "item_id",
        _ => "user_id",
    };
    let key = column(&batch, key_col)?.as_string::<i32>();
    let options = arrow_cast::display::FormatOptions::default();
    let formatters: Vec<(String, arrow_cast::display::ArrayFormatter<'_>)> = batch
        .schema()
        .fields()
        .iter()
        .zip(batch.columns())
        .filter(|(f, _)| {
            !matches!(
                f.name().as_str(),
                "embedding" | "source_partition" | "source_offset" | "ingested_at"
            )
        })
        .map(|(f, c)| {
            Ok((
                f.name().clone(),
                arrow_cast::display::ArrayFormatter::try_new(c.as_ref(), &options)?,
            ))
        })
        .collect::<std::result::Result<_, arrow_schema::ArrowError>>()?;
    let mut keep = vec![true; batch.num_rows()];
    for (r, reason) in refused {
        keep[r] = false;
        let mut row = serde_json::Map::new();
        for (name, f) in &formatters {
            if batch.column_by_name(name).is_some_and(|c| c.is_valid(r)) {
                row.insert(name.clone(), f.value(r).to_string().into());
            }
        }
        out.push(RejectedRow {
            table,
            field,
            reason,
            partition: partition.value(r),
            offset: offset.value(r),
            key: key.value(r).to_owned(),
            row: row.into(),
        });
    }
    Ok(arrow_select::filter::filter_record_batch(
        &batch,
        &BooleanArray::from(keep),
    )?)
}

fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a Arc<dyn Array>> {
    batch.column_by_name(name).ok_or_else(|| Error::Internal {
        message: format!("batch lacks {name}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_text_fills_the_template_and_trims_empty_parts() {
        let t = "{title}. Categories: {categories}. {description}";
        assert_eq!(
            item_text(t, "Kind of Blue", &["Jazz", "Modal"], "1959 album."),
            "Kind of Blue. Categories: Jazz, Modal. 1959 album."
        );
        assert_eq!(
            item_text(t, "Kind of Blue", &["Jazz"], ""),
            "Kind of Blue. Categories: Jazz."
        );
        let cd = "The CD is called '{title}'. The category of this CD is: '{categories}'.";
        assert_eq!(
            item_text(cd, "Blue", &["Jazz"], ""),
            "The CD is called 'Blue'. The category of this CD is: 'Jazz'."
        );
    }
}
