//! `steamrf communities`: the community writers of the scaled-out STEAM
//! write path (`steam.communities = "topic"`).
//!
//! Ingest instances (`steamrf run`, any number in one consumer group) form
//! and consolidate the memories of their partitions' users, write them to
//! `memories`, and then publish them to `steam.changes_topic`, each tenant's
//! to the one partition [`steamrf_schemas::tenancy::shard_of`] names
//! (`steam.changes_partitions` of them). Writers are one consumer group over
//! that topic: each partition, and so each tenant, has exactly one writer at
//! a time, and communities never span tenants, so writers never share a
//! link, a community or a prototype. A writer restores the tenants of its
//! partitions from `memories` and `memory_links` when they are assigned
//! (again after every rebalance), then consumes its partitions in
//! micro-batches (`batch.max_rows` memories or `batch.linger`): applies the
//! changes to its state, extracts the changed memories' links in one kernel
//! call, maintains communities incrementally and rebuilds the affected
//! prototypes, writes `memory_links` and `prototypes`, and only then commits
//! its offsets. A kill -9 replays uncommitted changes, which the idempotent
//! writes absorb; a record polled from a partition this writer no longer
//! owns is left to its new owner.
//!
//! Writers beyond the partitions get none and stand by, taking over on a
//! rebalance. Ingest never waits for them; their lag is the consumer lag of
//! the `<group_id>-communities` group.
//!
//! A `forget` event handled by an ingest instance reaches the user's writer
//! as a [`Tombstone`] on the user's partition, after every change of the
//! user that instance published: the batch ends there, and the writer
//! deletes the user's links, re-links and rebuilds prototypes before
//! committing it.

use std::collections::{BTreeMap, BTreeSet};
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
use crate::steam::{Change, SteamStage, Tombstone, change_partition, decode_change};

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
    /// The memories, with the partition each came from.
    memories: Vec<(i32, Memory)>,
    /// A tombstone ends a batch: it is applied after the memories before it.
    forget: Option<(i32, Tombstone)>,
    /// Next offset per partition.
    offsets: BTreeMap<i32, i64>,
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
                c.offsets.insert(m.partition(), m.offset() + 1);
                c.records += 1;
                let payload = m.payload().unwrap_or_default();
                metrics
                    .records_received
                    .with_label_values(&[m.topic()])
                    .inc();
                match decode_change(payload) {
                    Ok(Change::Memories(ms)) => {
                        c.memories
                            .extend(ms.into_iter().map(|x| (m.partition(), x)));
                    }
                    Ok(Change::Forget(t)) => c.forget = Some((m.partition(), t)),
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
    let partitions = config.steam.changes_partitions;
    let separator = config.steam_params().tenant_separator;
    source::check_brokers(&config.kafka).await?;
    let db = crate::sink::connect(&config.lancedb).await?;
    let kernel = crate::steam::kernel(&config, &metrics)?;
    let llm = crate::steam::llm_client(&config)?;
    // Empty until partitions are assigned: then it holds their tenants.
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
        partitions as i32,
        &config.steam.changes_topic_configs(),
    )
    .await?;
    source::check_partitions(
        &config.kafka,
        &topic,
        partitions,
        "steam.changes_partitions",
    )
    .await?;
    let mut kafka = config.kafka.clone();
    kafka.group_id = format!("{}-communities", config.kafka.group_id);
    kafka.topics = vec![topic.clone()];
    let consumer = source::consumer(&kafka, &metrics)?;
    ready.store(true, Ordering::Relaxed);
    tracing::info!(topic = %topic, partitions, group = %kafka.group_id, "Community writer started.");
    let mut summary = WriterSummary::default();
    let mut last = Instant::now();
    // The partitions whose tenants the state holds.
    let mut owned: BTreeSet<i32> = BTreeSet::new();
    while !stop.load(Ordering::Relaxed) {
        let (c, s, m) = (consumer.clone(), stop.clone(), metrics.clone());
        let (max, linger) = (config.batch.max_rows, config.batch.linger);
        let got = tokio::task::spawn_blocking(move || collect(&c, max, linger, &s, &m))
            .await
            .map_err(|e| Error::Internal {
                message: format!("the changes poll panicked: {e}"),
            })?;
        // After the poll that ran any rebalance: the state follows the
        // assignment before anything is applied.
        let assigned = assigned_partitions(&consumer, &topic)?;
        if assigned != owned {
            if assigned.is_empty() {
                stage.clear_state();
            } else {
                let keep =
                    |user: &str| assigned.contains(&change_partition(user, partitions, separator));
                stage.restore(&keep).await?;
                // Restoring read every stored memory and link through Arrow
                // batches: what malloc kept of them goes back, as after a batch.
                if config.batch.release_memory {
                    crate::alloc::trim();
                }
            }
            tracing::info!(partitions = ?assigned, memories = stage.state().len(), "Partitions assigned: the state holds their tenants.");
            owned.clone_from(&assigned);
        }
        if got.offsets.is_empty() {
            if assigned.is_empty() {
                last = Instant::now();
            }
            if exit_when_idle.is_some_and(|d| !assigned.is_empty() && last.elapsed() >= d) {
                tracing::info!("Idle; stopping.");
                break;
            }
            continue;
        }
        last = Instant::now();
        // Records of a partition revoked while they were polled are its new
        // owner's: it reads them again from the last commit.
        let polled = got.memories.len();
        let memories: Vec<Memory> = got
            .memories
            .into_iter()
            .filter(|(p, _)| owned.contains(p))
            .map(|(_, m)| m)
            .collect();
        if memories.len() < polled {
            tracing::info!(
                left = polled - memories.len(),
                "Changes of revoked partitions left to their new owner."
            );
        }
        let n = memories.len() as u64;
        let stats = stage.apply_changes(memories).await.inspect_err(|e| {
            metrics.error("steam", e);
        })?;
        if let Some((p, t)) = &got.forget
            && owned.contains(p)
        {
            let receipt = crate::forget::apply_tombstone(&mut stage, t)
                .await
                .inspect_err(|e| metrics.error("forget", e))?;
            crate::forget::record(&metrics, &receipt);
            summary.forgets += 1;
        }
        let mut tpl = TopicPartitionList::new();
        for (p, o) in got.offsets.iter().filter(|(p, _)| owned.contains(p)) {
            tpl.add_partition_offset(&topic, *p, Offset::Offset(*o))
                .map_err(Error::kafka("building the commit"))?;
        }
        let c = consumer.clone();
        let committed = tokio::task::spawn_blocking(move || {
            if tpl.count() == 0 {
                return Ok(());
            }
            c.commit(&tpl, CommitMode::Sync)
        })
        .await
        .map_err(|e| Error::Internal {
            message: format!("the commit panicked: {e}"),
        })?;
        match committed {
            Ok(()) => {
                metrics.commits.with_label_values(&["ok"]).inc();
                metrics.records_committed.inc_by(got.records);
            }
            Err(e) => {
                // A rebalance during the batch: whoever owns the partitions
                // now replays it, and every write was idempotent.
                metrics.commits.with_label_values(&["error"]).inc();
                tracing::warn!(error = %Chain(&e), "Committing the changes offsets failed; the batch may be replayed.");
            }
        }
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

/// The partitions of `topic` assigned to this writer now.
fn assigned_partitions(consumer: &KafkaConsumer, topic: &str) -> Result<BTreeSet<i32>> {
    let tpl = consumer
        .assignment()
        .map_err(Error::kafka("reading the assignment"))?;
    Ok(tpl
        .elements_for_topic(topic)
        .iter()
        .map(|e| e.partition())
        .collect())
}
