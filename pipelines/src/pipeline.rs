//! Wires the ingest pipeline: Kafka source thread → bounded queue → embed
//! stage (dialogue turns, new item versions) → LanceDB writer → offset commit.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use steamrf_operators::batch::BatchTracker;
use tokio::sync::mpsc;

use crate::config::Config;
use crate::embed::EmbedStage;
use crate::error::{Chain, Error, Result};
use crate::forget;
use crate::metrics::Metrics;
use crate::sink::LanceSink;
use crate::source::{self, KafkaConsumer, SourceBatch, SourceLoop};
use crate::steam::SteamStage;

/// How many times a retryable write is attempted before the pipeline stops.
const WRITE_ATTEMPTS: u32 = 8;

/// Run-time options that are not pipeline configuration.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Serve `/metrics`, `/healthz`, `/readyz` here.
    pub metrics_addr: Option<SocketAddr>,
    /// Stop by itself after this long without records once partitions are assigned.
    pub exit_when_idle: Option<Duration>,
}

/// What a finished run did.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunSummary {
    /// Records whose offsets were committed (valid and dead-lettered).
    pub records: u64,
    /// Rows inserted or updated.
    pub rows_written: u64,
    /// Batches written.
    pub batches: u64,
}

/// Runs the pipeline until `stop` is set (or the idle timeout fires), then
/// drains: flushes the open batch, writes it, waits for dead letters, commits
/// synchronously, and returns.
///
/// # Errors
/// Start-up failures (configuration, broker, LanceDB) and writes that still
/// fail after retries. Nothing unwritten is ever committed, so a restart
/// replays from the last durable point.
pub async fn run(
    config: Config,
    opts: RunOptions,
    metrics: Metrics,
    stop: Arc<AtomicBool>,
) -> Result<RunSummary> {
    let ready = Arc::new(AtomicBool::new(false));
    let server = crate::http::metrics_server(opts.metrics_addr, &metrics, &ready).await?;
    let result = run_inner(config, opts, metrics, stop, ready).await;
    if let Some(s) = server {
        s.abort();
    }
    result
}

async fn run_inner(
    config: Config,
    opts: RunOptions,
    metrics: Metrics,
    stop: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
) -> Result<RunSummary> {
    source::check_brokers(&config.kafka).await?;
    let sink = LanceSink::open(&config.lancedb, metrics.clone()).await?;
    let embedder = crate::embed::embedder(&config.embed)?;
    if let Some(e) = &embedder {
        metrics
            .embed_precision
            .with_label_values(&[e.precision()])
            .set(1);
    }
    let stage = Arc::new(
        EmbedStage::new(
            embedder.clone(),
            config.embed.item_template.clone(),
            metrics.clone(),
        )
        .with_passage_turns(config.embed.passage_turns)
        .with_sparse(crate::embed::sparse_encoder(&config.embed)?),
    );
    let mut steam = if config.steam.enabled {
        let db = crate::sink::connect(&config.lancedb).await?;
        let llm = crate::steam::llm_client(&config)?;
        let kernel = crate::steam::kernel(&config, &metrics)?;
        let publish = if config.steam.communities == crate::config::CommunitiesMode::Topic {
            // Keyed by tenant: each partition is read in order by one writer.
            let partitions = config.steam.changes_partitions;
            source::ensure_topic(
                &config.kafka.brokers,
                &config.kafka.properties,
                &config.steam.changes_topic,
                partitions as i32,
                &config.steam.changes_topic_configs(),
            )
            .await?;
            source::check_partitions(
                &config.kafka,
                &config.steam.changes_topic,
                partitions,
                "steam.changes_partitions",
            )
            .await?;
            Some(crate::steam::ChangePublisher::new(
                source::dead_letter_producer(&config.kafka)?,
                config.steam.changes_topic.clone(),
                partitions,
                config.steam_params().tenant_separator,
            ))
        } else {
            None
        };
        let mut stage = SteamStage::open(
            &db,
            config.steam_params(),
            kernel,
            embedder,
            llm,
            metrics.clone(),
            publish,
        )
        .await?;
        stage.restore(&|_| true).await?;
        // As after a batch: what restoring the state read goes back.
        if config.batch.release_memory {
            crate::alloc::trim();
        }
        Some(stage)
    } else {
        None
    };
    if config.kafka.create_dead_letter_topic {
        source::ensure_topic(
            &config.kafka.brokers,
            &config.kafka.properties,
            &config.kafka.dead_letter_topic,
            1,
            &[],
        )
        .await?;
    }
    let consumer = source::consumer(&config.kafka, &metrics)?;
    let producer = source::dead_letter_producer(&config.kafka)?;
    // The source thread owns the producer and exits first when draining;
    // dropping the last handle purges queued messages, which would fail the
    // dead letters of the final batch (seen after a broker restart, when
    // deliveries are slow). This handle keeps it until the writer is done.
    let _dead_letters = producer.clone();
    ready.store(true, Ordering::Relaxed);
    tracing::info!(topics = ?config.kafka.topics, group = %config.kafka.group_id, uri = %config.lancedb.uri, "Pipeline started.");

    let (tx, mut rx) = mpsc::channel::<SourceBatch>(config.batch.queue_batches);
    let mut policy = config.batch.policy();
    if config.embed.engine == crate::config::EmbedEngine::Off {
        // Nothing is embedded: texts cost no more than clicks.
        policy.max_texts = 0;
    }
    let source_loop = SourceLoop {
        consumer: consumer.clone(),
        producer,
        config: config.kafka.clone(),
        tracker: BatchTracker::new(policy),
        metrics: metrics.clone(),
        stop: stop.clone(),
        exit_when_idle: opts.exit_when_idle,
    };
    let source_thread = std::thread::Builder::new()
        .name("steamrf-source".into())
        .spawn(move || source_loop.run(&tx))
        .map_err(|source| Error::Io {
            context: "spawning the source thread".into(),
            source,
        })?;

    // The embed stage runs one batch ahead of the writer: batch N+1 is embedded
    // while batch N is written.
    let (etx, mut erx) = mpsc::channel::<SourceBatch>(1);
    let embed_task = tokio::spawn({
        let (sink, stage, metrics) = (sink.clone(), stage.clone(), metrics.clone());
        let dead_letters = (_dead_letters.clone(), config.kafka.clone());
        async move {
            while let Some(mut batch) = rx.recv().await {
                metrics.queue_depth.dec();
                embed_batch(&stage, &sink, &dead_letters, &metrics, &mut batch).await?;
                if etx.send(batch).await.is_err() {
                    break;
                }
            }
            Ok::<(), Error>(())
        }
    });

    let mut summary = RunSummary::default();
    let mut committed: HashMap<(String, i32), i64> = HashMap::new();
    let mut last_optimize = Instant::now();
    let mut last_trim = Instant::now();
    let optimize_every = config.lancedb.optimize_interval;
    let written = loop {
        let Some(batch) = erx.recv().await else {
            break Ok(());
        };
        if let Err(e) = write_batch(
            &sink,
            steam.as_mut(),
            &consumer,
            &metrics,
            batch,
            &mut committed,
            &mut summary,
        )
        .await
        {
            break Err(e);
        }
        // The batch and the write's working memory are free now; a trim
        // walks the whole heap, so at most one a second.
        if config.batch.release_memory && last_trim.elapsed() >= Duration::from_secs(1) {
            crate::alloc::trim();
            last_trim = Instant::now();
        }
        if !optimize_every.is_zero() && last_optimize.elapsed() >= optimize_every {
            last_optimize = Instant::now();
            if let Err(e) = sink.optimize().await {
                // Compaction is housekeeping: log, count, and carry on.
                tracing::warn!(error = %Chain(&e), "Table optimisation failed.");
                metrics.error("sink", &e);
            }
        }
    };
    // Unblock and stop the source whatever happened, then collect its result.
    stop.store(true, Ordering::Relaxed);
    drop(erx);
    let embedded = embed_task.await.map_err(|e| Error::Internal {
        message: format!("joining the embed stage: {e}"),
    })?;
    let source_result = tokio::task::spawn_blocking(move || source_thread.join())
        .await
        .map_err(|e| Error::Internal {
            message: format!("joining the source thread: {e}"),
        })?
        .map_err(|_| Error::Internal {
            message: "the source thread panicked".into(),
        })?;
    // An index update still running finishes before the process leaves.
    sink.settle().await;
    written?;
    embedded?;
    source_result?;
    // Re-commit the final positions synchronously before leaving the group,
    // for the partitions still owned (another member may be ahead on the rest).
    let owned = owned_offsets(
        &consumer,
        committed.iter().map(|((t, p), o)| (t.as_str(), *p, *o)),
    )?;
    if !owned.is_empty() {
        let tpl = offsets_list(owned.into_iter())?;
        if let Err(e) = consumer.commit(&tpl, CommitMode::Sync) {
            tracing::warn!(error = %Chain(&e), "Final synchronous commit failed; the last batch may be replayed (writes are idempotent).");
        }
    }
    tracing::info!(
        records = summary.records,
        rows = summary.rows_written,
        batches = summary.batches,
        embedded = metrics.total_texts_embedded(),
        "Pipeline drained and stopped."
    );
    Ok(summary)
}

/// The offsets among `offsets` whose partitions this member still owns.
fn owned_offsets<'a>(
    consumer: &KafkaConsumer,
    offsets: impl Iterator<Item = (&'a str, i32, i64)>,
) -> Result<Vec<(&'a str, i32, i64)>> {
    let assignment = consumer
        .assignment()
        .map_err(Error::kafka("reading the assignment"))?;
    Ok(offsets
        .filter(|(t, p, _)| assignment.find_partition(t, *p).is_some())
        .collect())
}

fn offsets_list<'a>(
    offsets: impl Iterator<Item = (&'a str, i32, i64)>,
) -> Result<TopicPartitionList> {
    let mut tpl = TopicPartitionList::new();
    for (t, p, o) in offsets {
        tpl.add_partition_offset(t, p, Offset::Offset(o))
            .map_err(Error::kafka("building the commit list"))?;
    }
    Ok(tpl)
}

/// Embeds one batch, retrying retryable failures (a LanceDB lookup, an
/// endpoint that is still failing after the engine's own retries). Rows
/// whose text the endpoint refused are dead-lettered (kind
/// `embedding_rejected`); their deliveries join the batch's, awaited before
/// its offsets commit.
async fn embed_batch(
    stage: &EmbedStage,
    sink: &LanceSink,
    dead_letters: &(FutureProducer, crate::config::KafkaConfig),
    metrics: &Metrics,
    batch: &mut SourceBatch,
) -> Result<()> {
    let on_error = |e: &Error| metrics.error("embed", e);
    let (tables, rejected) = crate::error::retry(WRITE_ATTEMPTS, "Embedding", on_error, || async {
        let mut tables = batch.tables.clone();
        stage
            .apply(sink, &mut tables)
            .await
            .map(|rejected| (tables, rejected))
    })
    .await
    .inspect_err(on_error)?;
    batch.tables = tables;
    for r in rejected {
        tracing::warn!(table = r.table.as_str(), partition = r.partition, offset = r.offset, reason = %r.reason, "The embedding endpoint refused a row's text; dead-lettering the row.");
        metrics
            .dead_lettered
            .with_label_values(&[crate::metrics::EMBEDDING_REJECTED])
            .inc();
        let (partition, offset) = (r.partition.to_string(), r.offset.to_string());
        let fields = [
            (source::headers::KIND, crate::metrics::EMBEDDING_REJECTED),
            (source::headers::FIELD, r.field),
            (source::headers::REASON, r.reason.as_str()),
            (source::headers::PARTITION, partition.as_str()),
            (source::headers::OFFSET, offset.as_str()),
        ];
        let payload = serde_json::to_vec(&r.row).map_err(|e| Error::Internal {
            message: format!("serialising a rejected row: {e}"),
        })?;
        let (producer, kafka) = dead_letters;
        batch.dead_letters.push(source::send_dead_letter(
            producer,
            kafka,
            &fields,
            Some(r.key.as_bytes()),
            &payload,
        )?);
    }
    Ok(())
}

async fn write_batch(
    sink: &LanceSink,
    mut steam: Option<&mut SteamStage>,
    consumer: &KafkaConsumer,
    metrics: &Metrics,
    batch: SourceBatch,
    committed: &mut HashMap<(String, i32), i64>,
    summary: &mut RunSummary,
) -> Result<()> {
    for (table, rows) in batch.tables.iter() {
        let on_error = |e: &Error| metrics.error("sink", e);
        let what = format!("Writing {}", table.as_str());
        let stats =
            crate::error::retry(WRITE_ATTEMPTS, &what, on_error, || sink.write(table, rows))
                .await
                .inspect_err(on_error)?;
        summary.rows_written += stats.inserted + stats.updated;
        tracing::debug!(
            table = table.as_str(),
            rows = rows.num_rows(),
            inserted = stats.inserted,
            version = stats.version,
            "Batch written."
        );
    }
    // The write path runs on what was just written, before the commit: a
    // failure stops the pipeline uncommitted, and the restart restores the
    // memory state from its tables and replays the batch (idempotently).
    if let Some(steam) = steam.as_deref_mut() {
        let st = steam.apply(&batch.tables).await.inspect_err(|e| {
            metrics.error("steam", e);
        })?;
        tracing::debug!(
            formed = st.formed,
            consolidated = st.consolidated,
            links = st.links,
            prototypes = st.prototypes,
            "STEAM batch applied."
        );
    }
    // A forget runs after everything before it in its partitions was
    // written, and before its offset commits: a crash re-runs it (it is
    // idempotent).
    for (event_id, user_id) in &batch.forgets {
        let receipt = forget::forget(sink, steam.as_deref_mut(), user_id, Some(event_id))
            .await
            .inspect_err(|e| metrics.error("forget", e))?;
        forget::record(metrics, &receipt);
    }
    for f in batch.dead_letters {
        match f.await {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => return Err(Error::kafka("delivering a dead letter")(e)),
            Err(_) => {
                return Err(Error::Internal {
                    message: "dead-letter producer dropped".into(),
                });
            }
        }
    }
    // Commit only partitions we still own: after a rebalance the new owner
    // re-reads from the last commit, and our writes were idempotent anyway.
    let owned = owned_offsets(
        consumer,
        batch.offsets.iter().map(|(t, p, o)| (t.as_str(), *p, *o)),
    )?;
    if !owned.is_empty() {
        let tpl = offsets_list(owned.iter().copied())?;
        match consumer.commit(&tpl, CommitMode::Async) {
            Ok(()) => {
                metrics.commits.with_label_values(&["ok"]).inc();
                for (t, p, o) in owned {
                    committed.insert((t.to_owned(), p), o);
                }
            }
            Err(e) => {
                metrics.commits.with_label_values(&["error"]).inc();
                tracing::warn!(error = %Chain(&e), "Offset commit failed; the batch may be replayed (writes are idempotent).");
            }
        }
    }
    summary.records += batch.records as u64;
    summary.batches += 1;
    metrics.records_committed.inc_by(batch.records as u64);
    metrics
        .batch_latency
        .observe(batch.opened_at.elapsed().as_secs_f64());
    let now_ms = chrono::Utc::now().timestamp_millis();
    // A thread-local histogram, added to the shared one once per batch: an
    // atomic observe per record was ~3% of the writer task.
    let end_to_end = metrics.end_to_end.local();
    for t in &batch.produced_ms {
        // A producer clock ahead of this host's counts as zero.
        end_to_end.observe((now_ms - t).max(0) as f64 / 1000.0);
    }
    end_to_end.flush();
    Ok(())
}
