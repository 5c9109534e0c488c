//! `steamrf communities`: the single community writer of the scaled-out
//! STEAM write path (`steam.communities = "topic"`).
//!
//! Ingest instances (`steamrf run`, any number in one consumer group) form
//! and consolidate the memories of their partitions' users, write them to
//! `memories`, and then publish them to `steam.changes_topic` (one
//! partition). This process consumes that topic in micro-batches
//! (`batch.max_rows` memories or `batch.linger`), applies the changes to its
//! state (restored from `memories` and `memory_links` on start), extracts the
//! changed memories' links in one kernel call, maintains communities
//! incrementally and rebuilds the affected prototypes, writes
//! `memory_links` and `prototypes`, and only then commits its offsets. A
//! kill -9 replays uncommitted changes, which the idempotent writes absorb.
//!
//! One partition makes it a single writer by construction: a second process
//! in the same group gets no partition and waits as a standby, taking over
//! on a rebalance. Ingest never waits for it; its lag is the consumer lag of
//! the `<group_id>-communities` group.
//!
//! A `forget` event handled by an ingest instance reaches this process as a
//! [`Tombstone`] on the same topic, after every change of the user that
//! instance published: the batch ends there, and the writer deletes the
//! user's links, re-links and rebuilds prototypes before committing it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use steamrf_operators::steam::memory::Memory;

use crate::config::{CommunitiesMode, Config};
use crate::error::{Chain, Error, Result};
use crate::metrics::Metrics;
use crate::source::{self, KafkaConsumer};
use crate::steam::{Change, SteamStage, Tombstone, decode_change};

/// What one run did.
#[derive(Debug, Clone, Copy, Default)]
pub struct WriterSummary {
    /// Changes records consumed.
    pub records: u64,
    /// Memories applied.
    pub memories: u64,
    /// Records that did not decode (logged and skipped).
    pub malformed: u64,
    /// Tombstones applied (users forgotten).
    pub forgets: u64,
}

struct Collected {
    memories: Vec<Memory>,
    /// A tombstone ends a batch: it is applied after the memories before it.
    forget: Option<Tombstone>,
    offsets: BTreeMap<(String, i32), i64>,
    records: u64,
    malformed: u64,
}

/// Polls until `max` memories, `linger` after the first record, a
/// tombstone, or `stop`.
fn collect(
    consumer: &KafkaConsumer,
    max: usize,
    linger: Duration,
    stop: &AtomicBool,
    metrics: &Metrics,
) -> Collected {
    let mut c = Collected {
        memories: Vec::new(),
        forget: None,
        offsets: BTreeMap::new(),
        records: 0,
        malformed: 0,
    };
    let mut deadline: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) && c.memories.len() < max && c.forget.is_none() {
        let wait = match deadline {
            Some(d) if Instant::now() >= d => break,
            Some(d) => d - Instant::now(),
            None => Duration::from_millis(100),
        };
        match consumer.poll(wait) {
            None if deadline.is_none() => break,
            None => {}
            Some(Err(e)) => tracing::warn!(error = %Chain(&e), "Polling the changes topic failed."),
            Some(Ok(m)) => {
                deadline.get_or_insert_with(|| Instant::now() + linger);
                c.offsets
                    .insert((m.topic().to_owned(), m.partition()), m.offset() + 1);
                c.records += 1;
                let payload = m.payload().unwrap_or_default();
                metrics
                    .records_received
                    .with_label_values(&[m.topic()])
                    .inc();
                match decode_change(payload) {
                    Ok(Change::Memories(ms)) => c.memories.extend(ms),
                    Ok(Change::Forget(t)) => c.forget = Some(t),
                    Err(e) => {
                        // Only steamrf writes this topic: a bad record is a bug
                        // or a foreign producer. Skipping it loses nothing the
                        // `memories` table does not still hold.
                        c.malformed += 1;
                        tracing::error!(offset = m.offset(), error = %Chain(&e), "Skipping a malformed memory-changes record.");
                    }
                }
            }
        }
    }
    c
}

/// Runs the community writer until `stop` (or `exit_when_idle` without
/// records once its partition is assigned).
///
/// # Errors
/// Configuration, Kafka or LanceDB failures (uncommitted changes are replayed
/// on the next start).
pub async fn run(
    config: Config,
    metrics_addr: Option<SocketAddr>,
    exit_when_idle: Option<Duration>,
    stop: Arc<AtomicBool>,
) -> Result<WriterSummary> {
    if config.steam.communities != CommunitiesMode::Topic {
        return Err(Error::Config {
            problems: vec![
                "steam.communities: must be \"topic\" for `steamrf communities` (with \"in_process\" the pipeline keeps communities itself)".into(),
            ],
        });
    }
    let topic = config.steam.changes_topic.clone();
    let metrics = Metrics::new(std::slice::from_ref(&topic));
    let ready = Arc::new(AtomicBool::new(false));
    let server = crate::http::metrics_server(metrics_addr, &metrics, &ready).await?;
    let result = run_inner(config, exit_when_idle, stop, metrics, ready).await;
    if let Some(s) = server {
        s.abort();
    }
    result
}

async fn run_inner(
    config: Config,
    exit_when_idle: Option<Duration>,
    stop: Arc<AtomicBool>,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
) -> Result<WriterSummary> {
    let topic = config.steam.changes_topic.clone();
    source::check_brokers(&config.kafka).await?;
    let db = crate::sink::connect(&config.lancedb).await?;
    let kernel = crate::steam::kernel(&config, &metrics)?;
    let llm = crate::steam::llm_client(&config)?;
    let mut stage = SteamStage::open(
        &db,
        config.steam_params(),
        kernel,
        None,
        llm,
        metrics.clone(),
        None,
    )
    .await?
    .into_writer();
    source::ensure_topic(
        &config.kafka.brokers,
        &config.kafka.properties,
        &topic,
        1,
        &config.steam.changes_topic_configs(),
    )
    .await?;
    let mut kafka = config.kafka.clone();
    kafka.group_id = format!("{}-communities", config.kafka.group_id);
    kafka.topics = vec![topic.clone()];
    let consumer = source::consumer(&kafka, &metrics)?;
    ready.store(true, Ordering::Relaxed);
    tracing::info!(topic = %topic, group = %kafka.group_id, "Community writer started.");
    let mut summary = WriterSummary::default();
    let mut last = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let (c, s, m) = (consumer.clone(), stop.clone(), metrics.clone());
        let (max, linger) = (config.batch.max_rows, config.batch.linger);
        let got = tokio::task::spawn_blocking(move || collect(&c, max, linger, &s, &m))
            .await
            .map_err(|e| Error::Internal {
                message: format!("the changes poll panicked: {e}"),
            })?;
        if got.offsets.is_empty() {
            let assigned = metrics.assigned_partitions.get() > 0;
            if !assigned {
                last = Instant::now();
            }
            if exit_when_idle.is_some_and(|d| assigned && last.elapsed() >= d) {
                tracing::info!("Idle; stopping.");
                break;
            }
            continue;
        }
        last = Instant::now();
        let n = got.memories.len() as u64;
        let stats = stage.apply_changes(got.memories).await.inspect_err(|e| {
            metrics.error("steam", e);
        })?;
        if let Some(t) = &got.forget {
            let receipt = crate::forget::apply_tombstone(&mut stage, t)
                .await
                .inspect_err(|e| metrics.error("forget", e))?;
            crate::forget::record(&metrics, &receipt);
            summary.forgets += 1;
        }
        let mut tpl = TopicPartitionList::new();
        for ((t, p), o) in &got.offsets {
            tpl.add_partition_offset(t, *p, Offset::Offset(*o))
                .map_err(Error::kafka("building the commit"))?;
        }
        let c = consumer.clone();
        tokio::task::spawn_blocking(move || c.commit(&tpl, CommitMode::Sync))
            .await
            .map_err(|e| Error::Internal {
                message: format!("the commit panicked: {e}"),
            })?
            .map_err(Error::kafka("committing the changes offsets"))?;
        metrics.records_committed.inc_by(got.records);
        summary.records += got.records;
        summary.memories += n;
        summary.malformed += got.malformed;
        tracing::debug!(
            memories = n,
            links = stats.links,
            prototypes = stats.prototypes,
            "Changes applied."
        );
    }
    tracing::info!(
        records = summary.records,
        memories = summary.memories,
        "Community writer stopped."
    );
    Ok(summary)
}
