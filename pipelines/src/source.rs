//! The Kafka source: a consumer-group member that polls on its own thread,
//! decodes payloads into Arrow builders, dead-letters what it cannot decode,
//! and hands micro-batches to the writer through a bounded queue.
//!
//! Offsets are never auto-committed. Each [`SourceBatch`] carries the next
//! offset per partition it covers; the writer commits them after LanceDB has
//! acknowledged the write and the dead letters are acknowledged by Kafka.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::Message;
use rdkafka::client::ClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord};
use rdkafka::statistics::Statistics;
use steamrf_operators::batch::{BatchTracker, FlushReason};
use steamrf_operators::embed::clip_bytes;
use steamrf_schemas::{DecodeError, Event, Provenance, TableBatches, TableBuilders, decode};
use tokio::sync::mpsc;

use crate::config::KafkaConfig;
use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// What one vector costs in a batch: `EMBEDDING_DIM` floats. A row that
/// gets vectors adds them to its payload's bytes in `batch.max_bytes`, so the
/// budget bounds the batch's memory rather than its JSON: an item one (its
/// `embedding` column), a dialogue turn two (its `turn_vectors` row and its
/// passage window). Clicks and purchases carry none.
pub const ROW_VECTOR_BYTES: usize = steamrf_schemas::tables::EMBEDDING_DIM * 4;

/// Dead-letter header names.
pub mod headers {
    /// The error kind (`invalid_json`, `missing_field`, ...).
    pub const KIND: &str = "steamrf-error-kind";
    /// The offending field, empty when the payload as a whole is at fault.
    pub const FIELD: &str = "steamrf-error-field";
    /// The full error message.
    pub const REASON: &str = "steamrf-error-reason";
    /// Source topic.
    pub const TOPIC: &str = "steamrf-source-topic";
    /// Source partition.
    pub const PARTITION: &str = "steamrf-source-partition";
    /// Source offset.
    pub const OFFSET: &str = "steamrf-source-offset";
    /// Present when the payload was cut to fit the producer's
    /// `message.max.bytes`: the original payload's length in bytes.
    pub const ORIGINAL_PAYLOAD_BYTES: &str = "steamrf-original-payload-bytes";
    /// Present when the key was cut: the original key's length in bytes.
    pub const ORIGINAL_KEY_BYTES: &str = "steamrf-original-key-bytes";
}

/// librdkafka's default `message.max.bytes`, the dead-letter producer's limit
/// unless `kafka.properties` sets another.
const DEFAULT_MESSAGE_MAX_BYTES: usize = 1_000_000;
/// Room kept in a dead letter for the record's own framing (lengths,
/// timestamp, attributes, header names' varints).
const DEAD_LETTER_FRAMING_BYTES: usize = 1024;
/// The most of a header value a dead letter carries: a reason or field name
/// can quote hostile input.
const DEAD_LETTER_HEADER_MAX_BYTES: usize = 1024;
/// The most of the original record's key a dead letter carries.
const DEAD_LETTER_KEY_MAX_BYTES: usize = 4096;

/// What a dead letter carries of a malformed record.
#[derive(Debug, PartialEq, Eq)]
struct FittedDeadLetter<'a> {
    payload: &'a [u8],
    key: Option<&'a [u8]>,
    /// The original payload's length, when it was cut.
    payload_cut_from: Option<usize>,
    /// The original key's length, when it was cut.
    key_cut_from: Option<usize>,
}

/// Cuts a dead letter so that key + payload + headers + framing stay within
/// the producer's `max_message_bytes`. A record refused by the producer
/// (`MessageSizeTooLarge`) would stop the pipeline on it at every restart: a
/// malformed record just under `kafka.max_event_bytes` (1 MiB by default,
/// above librdkafka's 1,000,000) did exactly that. `header_bytes` are the
/// other headers' names and values; room for the two length headers is kept.
fn fit_dead_letter<'a>(
    payload: &'a [u8],
    key: Option<&'a [u8]>,
    header_bytes: usize,
    max_message_bytes: usize,
) -> FittedDeadLetter<'a> {
    let (key, key_cut_from) = match key {
        Some(k) if k.len() > DEAD_LETTER_KEY_MAX_BYTES => {
            (Some(&k[..DEAD_LETTER_KEY_MAX_BYTES]), Some(k.len()))
        }
        k => (k, None),
    };
    let length_headers =
        headers::ORIGINAL_PAYLOAD_BYTES.len() + headers::ORIGINAL_KEY_BYTES.len() + 40;
    let room = max_message_bytes.saturating_sub(
        DEAD_LETTER_FRAMING_BYTES + header_bytes + length_headers + key.map_or(0, <[u8]>::len),
    );
    let (payload, payload_cut_from) = if payload.len() > room {
        (&payload[..room], Some(payload.len()))
    } else {
        (payload, None)
    };
    FittedDeadLetter {
        payload,
        key,
        payload_cut_from,
        key_cut_from,
    }
}

/// Produces one dead letter to `kafka.dead_letter_topic`: `fields` as
/// headers (each value cut to 1 KiB: a reason can quote hostile input), the
/// key and payload cut to fit the producer's `message.max.bytes` (see
/// [`fit_dead_letter`]). Waits while the producer's queue is full.
///
/// # Errors
/// The producer refused the record for another reason.
pub fn send_dead_letter(
    producer: &FutureProducer,
    config: &KafkaConfig,
    fields: &[(&str, &str)],
    key: Option<&[u8]>,
    payload: &[u8],
) -> Result<DeliveryFuture> {
    let fields: Vec<(&str, &str)> = fields
        .iter()
        .map(|&(k, v)| (k, clip_bytes(v, DEAD_LETTER_HEADER_MAX_BYTES)))
        .collect();
    let header_bytes = fields.iter().map(|(k, v)| k.len() + v.len()).sum();
    let max_message_bytes = config
        .properties
        .get("message.max.bytes")
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_MESSAGE_MAX_BYTES);
    let fitted = fit_dead_letter(payload, key, header_bytes, max_message_bytes);
    if let Some(n) = fitted.payload_cut_from {
        tracing::warn!(
            bytes = n,
            kept = fitted.payload.len(),
            "A dead letter's payload was cut to fit message.max.bytes."
        );
    }
    let payload_cut_from = fitted.payload_cut_from.map(|n| n.to_string());
    let key_cut_from = fitted.key_cut_from.map(|n| n.to_string());
    let cut = [
        (headers::ORIGINAL_PAYLOAD_BYTES, payload_cut_from.as_deref()),
        (headers::ORIGINAL_KEY_BYTES, key_cut_from.as_deref()),
    ];
    let headers = fields
        .into_iter()
        .chain(cut.into_iter().filter_map(|(k, v)| Some((k, v?))))
        .fold(OwnedHeaders::new(), |h, (key, value)| {
            h.insert(Header {
                key,
                value: Some(value),
            })
        });
    let mut record = FutureRecord::to(&config.dead_letter_topic)
        .payload(fitted.payload)
        .headers(headers);
    if let Some(key) = fitted.key {
        record = record.key(key);
    }
    loop {
        match producer.send_result(record) {
            Ok(f) => return Ok(f),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                record = r;
                producer.poll(Duration::from_millis(50));
            }
            Err((e, _)) => return Err(Error::kafka("producing a dead letter")(e)),
        }
    }
}

/// One micro-batch on its way to the writer.
pub struct SourceBatch {
    /// Rows per table.
    pub tables: TableBatches,
    /// Next offset to commit, per (topic, partition).
    pub offsets: Vec<(String, i32, i64)>,
    /// Dead letters that must be acknowledged before the offsets are committed.
    pub dead_letters: Vec<DeliveryFuture>,
    /// Records (valid and malformed) covered.
    pub records: usize,
    /// Payload bytes covered.
    pub bytes: usize,
    /// When the first record was polled.
    pub opened_at: Instant,
    /// Why it was cut.
    pub reason: FlushReason,
    /// `forget` events: (event id, user id). A batch that carries one
    /// carries nothing else; the writer runs it before committing.
    pub forgets: Vec<(String, String)>,
    /// The Kafka timestamp (ms since the epoch: the producer's CreateTime,
    /// or the broker's LogAppendTime if the topic says so) of each record
    /// covered that has one: the end-to-end latency is measured from it.
    pub produced_ms: Vec<i64>,
}

/// Consumer callbacks: rebalance logging and the lag gauge.
pub struct SourceContext {
    metrics: Metrics,
    topics: Vec<String>,
}

impl ClientContext for SourceContext {
    fn stats(&self, stats: Statistics) {
        for (name, topic) in &stats.topics {
            if !self.topics.contains(name) {
                continue;
            }
            let lag: i64 = topic
                .partitions
                .values()
                .filter(|p| p.partition >= 0 && p.consumer_lag >= 0)
                .map(|p| p.consumer_lag)
                .sum();
            self.metrics
                .consumer_lag
                .with_label_values(&[name])
                .set(lag);
        }
    }
}

impl ConsumerContext for SourceContext {
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let kind = match rebalance {
            Rebalance::Assign(tpl) => {
                tracing::info!(partitions = tpl.count(), "Partitions assigned.");
                "assign"
            }
            Rebalance::Revoke(tpl) => {
                tracing::info!(partitions = tpl.count(), "Partitions revoked.");
                "revoke"
            }
            Rebalance::Error(e) => {
                tracing::warn!(error = %e, "Rebalance error.");
                "error"
            }
        };
        self.metrics.rebalances.with_label_values(&[kind]).inc();
        let n = consumer.assignment().map(|a| a.count()).unwrap_or(0);
        self.metrics
            .assigned_partitions
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// The consumer type.
pub type KafkaConsumer = BaseConsumer<SourceContext>;

fn base_client_config(cfg: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    for (k, v) in &cfg.properties {
        c.set(k, v);
    }
    c.set("bootstrap.servers", &cfg.brokers);
    c
}

/// Asks the brokers for the cluster's metadata, so that a wrong address, a
/// firewall or bad credentials stop start-up with a clear error instead of
/// a consumer that waits silently.
///
/// # Errors
/// [`Error::Kafka`] naming the brokers when none answers within
/// `kafka.connect_timeout`.
pub async fn check_brokers(cfg: &KafkaConfig) -> Result<()> {
    let client: BaseConsumer = base_client_config(cfg)
        .create()
        .map_err(Error::kafka("creating the client that checks the brokers"))?;
    let timeout = cfg.connect_timeout;
    let brokers = cfg.brokers.clone();
    tokio::task::spawn_blocking(move || client.fetch_metadata(None, timeout).map(|_| ()))
        .await
        .map_err(|e| Error::Internal {
            message: format!("checking the brokers panicked: {e}"),
        })?
        .map_err(Error::kafka(format!(
            "no broker of {brokers} answered within {} (kafka.connect_timeout)",
            humantime::format_duration(timeout)
        )))
}

/// Checks that `topic` has exactly `want` partitions: a keyed topic with
/// another count sends keys to other partitions than its readers expect.
///
/// # Errors
/// [`Error::Config`] naming `setting` when the counts differ;
/// [`Error::Kafka`] when the metadata cannot be read.
pub async fn check_partitions(
    cfg: &KafkaConfig,
    topic: &str,
    want: u32,
    setting: &str,
) -> Result<()> {
    let client: BaseConsumer = base_client_config(cfg).create().map_err(Error::kafka(
        "creating the client that reads topic metadata",
    ))?;
    let (timeout, name) = (cfg.connect_timeout, topic.to_owned());
    let have = tokio::task::spawn_blocking(move || {
        client
            .fetch_metadata(Some(&name), timeout)
            .map(|m| m.topics().first().map_or(0, |t| t.partitions().len()))
    })
    .await
    .map_err(|e| Error::Internal {
        message: format!("reading topic metadata panicked: {e}"),
    })?
    .map_err(Error::kafka(format!("reading the metadata of {topic}")))?;
    if have != want as usize {
        return Err(Error::Config {
            problems: vec![format!(
                "{setting}: {want}, but topic {topic} has {have} partitions; every process must use the topic's count (resize it only with ingest stopped and every writer caught up, then set {setting} to match)"
            )],
        });
    }
    Ok(())
}

/// Creates the group consumer and subscribes it.
///
/// # Errors
/// [`Error::Kafka`] if librdkafka rejects the configuration or the subscription.
pub fn consumer(cfg: &KafkaConfig, metrics: &Metrics) -> Result<Arc<KafkaConsumer>> {
    let mut c = base_client_config(cfg);
    c.set("group.id", &cfg.group_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "false")
        .set(
            "statistics.interval.ms",
            cfg.statistics_interval.as_millis().to_string(),
        );
    let ctx = SourceContext {
        metrics: metrics.clone(),
        topics: cfg.topics.clone(),
    };
    let consumer: KafkaConsumer = c
        .create_with_context(ctx)
        .map_err(Error::kafka("creating the consumer"))?;
    let topics: Vec<&str> = cfg.topics.iter().map(String::as_str).collect();
    consumer
        .subscribe(&topics)
        .map_err(Error::kafka("subscribing"))?;
    Ok(Arc::new(consumer))
}

/// Creates the dead-letter producer (idempotent, acks=all).
///
/// # Errors
/// [`Error::Kafka`] if librdkafka rejects the configuration.
pub fn dead_letter_producer(cfg: &KafkaConfig) -> Result<FutureProducer> {
    producer(cfg, "the dead-letter producer", None)
}

/// librdkafka's name for the Java client's default partitioner.
pub const JAVA_PARTITIONER: &str = "murmur2_random";

/// An idempotent producer (acks=all) with the consumer's client settings
/// (brokers, security); `max_message_bytes` raises librdkafka's
/// `message.max.bytes`.
///
/// # Errors
/// [`Error::Kafka`] if librdkafka rejects the configuration.
pub fn producer(
    cfg: &KafkaConfig,
    what: &str,
    max_message_bytes: Option<usize>,
) -> Result<FutureProducer> {
    let mut c = base_client_config(cfg);
    // Consumer-only properties would make the producer warn; drop the ones we know.
    for k in [
        "session.timeout.ms",
        "auto.offset.reset",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "fetch.min.bytes",
        "fetch.max.bytes",
        "fetch.wait.max.ms",
        "max.partition.fetch.bytes",
        "partition.assignment.strategy",
        "group.instance.id",
        "isolation.level",
        "queued.min.messages",
        "queued.max.messages.kbytes",
    ] {
        c.remove(k);
    }
    c.set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5");
    // The Java client's partitioner (murmur2 of the key; keyless records
    // spread at random): a user's events from steamrf (`POST /v1/events`,
    // MCP `remember`, a forget) land on the partition a Java producer puts
    // them on, so they stay in order with the user's other events
    // (docs/events.md). librdkafka's own default (CRC32) would not. A
    // `partitioner` in `kafka.properties` wins.
    if c.get("partitioner").is_none() {
        c.set("partitioner", JAVA_PARTITIONER);
    }
    if let Some(n) = max_message_bytes {
        c.set("message.max.bytes", n.max(1_000_000).to_string());
    }
    c.create().map_err(Error::kafka(format!("creating {what}")))
}

/// Creates `topic` with `partitions` (and `configs`, e.g. `retention.ms`)
/// if it does not exist. When it exists and a config differs from the one
/// asked for, logs a warning naming both: an operator may have set it on
/// purpose, so it is not overwritten.
///
/// # Errors
/// The admin client cannot be built, or the broker refuses the topic.
pub async fn ensure_topic(
    brokers: &str,
    props: &BTreeMap<String, String>,
    topic: &str,
    partitions: i32,
    configs: &[(&str, String)],
) -> Result<()> {
    use rdkafka::admin::{
        AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication,
    };
    let mut c = ClientConfig::new();
    for (k, v) in props {
        if k.starts_with("security.") || k.starts_with("sasl.") || k.starts_with("ssl.") {
            c.set(k, v);
        }
    }
    c.set("bootstrap.servers", brokers);
    let admin: AdminClient<_> = c
        .create()
        .map_err(Error::kafka("creating the admin client"))?;
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let new_topic = configs.iter().fold(
        NewTopic::new(topic, partitions, TopicReplication::Fixed(-1)),
        |t, (k, v)| t.set(k, v),
    );
    let results = admin
        .create_topics(&[new_topic], &options)
        .await
        .map_err(Error::kafka(format!("creating topic {topic}")))?;
    let mut existed = false;
    for r in results {
        match r {
            Ok(_) => {}
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => existed = true,
            Err((t, code)) => {
                return Err(Error::Kafka {
                    context: format!("creating topic {t}"),
                    source: KafkaError::AdminOp(code),
                });
            }
        }
    }
    if existed && !configs.is_empty() {
        // Best effort: a broker that cannot describe configs is not an error.
        match admin
            .describe_configs(&[ResourceSpecifier::Topic(topic)], &options)
            .await
        {
            Ok(described) => {
                for resource in described.into_iter().flatten() {
                    for (k, want) in configs {
                        let have = resource.get(k).and_then(|e| e.value.clone());
                        if have.as_deref() != Some(want.as_str()) {
                            tracing::warn!(topic, config = k, have = ?have, want = %want, "An existing topic's config differs from steamrf's; leaving it as it is.");
                        }
                    }
                }
            }
            Err(e) => tracing::debug!(topic, error = %e, "Describing the topic's configs failed."),
        }
    }
    Ok(())
}

/// What the poll loop needs.
pub struct SourceLoop {
    /// The subscribed consumer.
    pub consumer: Arc<KafkaConsumer>,
    /// The dead-letter producer.
    pub producer: FutureProducer,
    /// Configuration.
    pub config: KafkaConfig,
    /// Batch limits.
    pub tracker: BatchTracker,
    /// Metrics.
    pub metrics: Metrics,
    /// Set to stop: the loop flushes what it holds and returns.
    pub stop: Arc<AtomicBool>,
    /// Stop by itself after this long without records once partitions are
    /// assigned (time spent handing a batch to a busy writer does not count).
    pub exit_when_idle: Option<Duration>,
}

struct Pending {
    builders: TableBuilders,
    /// Next offset to commit per (topic index, partition), but for the
    /// partition of the last record, which is in `last`: records come in
    /// runs from one partition, so most records touch no map.
    offsets: HashMap<(usize, i32), i64>,
    last: Option<((usize, i32), i64)>,
    dead_letters: Vec<DeliveryFuture>,
    produced_ms: Vec<i64>,
    /// The rows' `ingested_at`, re-based at every batch cut.
    clock: WallClock,
}

/// Wall-clock milliseconds derived from the monotonic instant the loop
/// already reads per record: a `Utc::now()` per record was ~4% of the
/// source thread. Re-based at every batch cut ([`SourceLoop::flush`]), so
/// the two clocks cannot drift apart by more than a batch's worth of slew.
struct WallClock {
    base: Instant,
    base_ms: i64,
}

impl WallClock {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            base_ms: chrono::Utc::now().timestamp_millis(),
        }
    }

    fn ms_at(&self, at: Instant) -> i64 {
        let since = at.saturating_duration_since(self.base).as_millis();
        self.base_ms + i64::try_from(since).unwrap_or(i64::MAX - self.base_ms)
    }
}

/// Received records and bytes per topic, counted locally and added to the
/// shared counters every [`Received::EVERY`] records and whenever a poll
/// comes back empty: two atomic adds per record were ~2% of the thread.
struct Received {
    records: Vec<prometheus::IntCounter>,
    bytes: Vec<prometheus::IntCounter>,
    counted: Vec<(u64, u64)>,
    since_publish: u32,
}

impl Received {
    const EVERY: u32 = 1024;

    fn new(metrics: &Metrics, topics: &[String]) -> Self {
        let per_topic = |v: &prometheus::IntCounterVec| {
            topics.iter().map(|t| v.with_label_values(&[t])).collect()
        };
        Self {
            records: per_topic(&metrics.records_received),
            bytes: per_topic(&metrics.bytes_received),
            counted: vec![(0, 0); topics.len()],
            since_publish: 0,
        }
    }

    fn count(&mut self, topic: usize, bytes: usize) {
        let c = &mut self.counted[topic];
        c.0 += 1;
        c.1 += bytes as u64;
        self.since_publish += 1;
        if self.since_publish >= Self::EVERY {
            self.publish();
        }
    }

    fn publish(&mut self) {
        for (i, c) in self.counted.iter_mut().enumerate() {
            if c.0 > 0 {
                self.records[i].inc_by(c.0);
                self.bytes[i].inc_by(c.1);
                *c = (0, 0);
            }
        }
        self.since_publish = 0;
    }
}

impl Pending {
    fn new() -> Self {
        Self {
            builders: TableBuilders::default(),
            offsets: HashMap::new(),
            last: None,
            dead_letters: Vec::new(),
            produced_ms: Vec::new(),
            clock: WallClock::new(),
        }
    }

    /// Records that offsets before `next` of `partition` are in the batch.
    fn advance(&mut self, topic: usize, partition: i32, next: i64) {
        match &mut self.last {
            Some((at, n)) if *at == (topic, partition) => *n = (*n).max(next),
            _ => {
                self.settle_last();
                self.last = Some(((topic, partition), next));
            }
        }
    }

    /// Moves the last record's partition into `offsets`.
    fn settle_last(&mut self) {
        if let Some((at, n)) = self.last.take() {
            let slot = self.offsets.entry(at).or_insert(0);
            *slot = (*slot).max(n);
        }
    }

    /// Every partition's next offset, emptied.
    fn take_offsets(&mut self) -> HashMap<(usize, i32), i64> {
        self.settle_last();
        std::mem::take(&mut self.offsets)
    }
}

impl SourceLoop {
    /// Polls until stopped, sending batches into `tx` (blocking when it is
    /// full: that is the backpressure). Runs on a dedicated thread.
    ///
    /// # Errors
    /// Only for failures that must stop the pipeline (the writer went away,
    /// Arrow rejected a batch).
    pub fn run(mut self, tx: &mpsc::Sender<SourceBatch>) -> Result<()> {
        let mut pending = Pending::new();
        let mut opened_at = Instant::now();
        let mut last_record = Instant::now();
        // One clock read per record (right after the poll): on some VMs a
        // read costs ~30 ns, and three per record were 10% of this thread.
        let mut now = last_record;
        let mut idle_clock_running = false;
        let max_event_bytes = self.config.max_event_bytes.0;
        let max_skew_ms =
            i64::try_from(self.config.max_future_skew.as_millis()).unwrap_or(i64::MAX);
        let topics = self.config.topics.clone();
        // A local handle, so polled messages do not borrow `self`.
        let consumer = self.consumer.clone();
        let mut received = Received::new(&self.metrics, &topics);
        loop {
            if self.stop.load(Ordering::Relaxed) {
                received.publish();
                self.flush(&mut pending, opened_at, FlushReason::Drain, tx)?;
                return Ok(());
            }
            let wait = self
                .tracker
                .deadline()
                .map_or(Duration::from_millis(100), |d| {
                    d.saturating_duration_since(now)
                })
                .min(Duration::from_millis(100));
            let polled = consumer.poll(wait);
            now = Instant::now();
            match polled {
                None => received.publish(),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "Kafka consumer error.");
                    self.metrics.error("source", &Error::kafka("polling")(e));
                }
                Some(Ok(msg)) => {
                    last_record = now;
                    if self.tracker.is_empty() {
                        opened_at = now;
                    }
                    // `msg.topic()` measures and UTF-8-checks the C name
                    // on every call: with one topic there is nothing to ask.
                    let topic_idx = if topics.len() == 1 {
                        0
                    } else {
                        topics.iter().position(|t| t == msg.topic()).unwrap_or(0)
                    };
                    let payload = msg.payload().unwrap_or_default();
                    let produced = msg.timestamp().to_millis();
                    received.count(topic_idx, payload.len());
                    let wall_ms = pending.clock.ms_at(now);
                    let decoded = if payload.len() > max_event_bytes {
                        Err(DecodeError::oversize(payload.len(), max_event_bytes))
                    } else {
                        decode(payload).and_then(|e| {
                            e.check_not_ahead(wall_ms, max_skew_ms)?;
                            Ok(e)
                        })
                    };
                    if let Ok(Event::Forget(f)) = &decoded {
                        // Everything polled before it is written first; the
                        // forget travels alone, with its own offset.
                        self.flush(&mut pending, opened_at, FlushReason::Forget, tx)?;
                        self.send(
                            SourceBatch {
                                tables: TableBuilders::default().finish()?,
                                offsets: vec![(
                                    topics[topic_idx].clone(),
                                    msg.partition(),
                                    msg.offset() + 1,
                                )],
                                dead_letters: Vec::new(),
                                records: 1,
                                bytes: payload.len(),
                                opened_at: now,
                                reason: FlushReason::Forget,
                                forgets: vec![(f.event_id.to_string(), f.user_id.to_string())],
                                produced_ms: produced.into_iter().collect(),
                            },
                            tx,
                        )?;
                        now = Instant::now();
                        last_record = now;
                        continue;
                    }
                    pending.advance(topic_idx, msg.partition(), msg.offset() + 1);
                    pending.produced_ms.extend(produced);
                    let mut text = false;
                    let size = match decoded {
                        Ok(event) => {
                            let vectors = match &event {
                                Event::Interaction(i)
                                    if i.kind == steamrf_schemas::InteractionKind::DialogueTurn =>
                                {
                                    2
                                }
                                Event::Item(_) => 1,
                                _ => 0,
                            };
                            text = vectors > 0;
                            pending.builders.append(
                                &event,
                                Provenance {
                                    partition: msg.partition(),
                                    offset: msg.offset(),
                                    ingested_at_ms: wall_ms,
                                },
                            );
                            payload.len() + vectors * ROW_VECTOR_BYTES
                        }
                        Err(err) => {
                            let f = self.dead_letter(&msg, payload, &err)?;
                            pending.dead_letters.push(f);
                            payload.len()
                        }
                    };
                    if let Some(reason) = self.tracker.record_with(size, text, now) {
                        self.flush(&mut pending, opened_at, reason, tx)?;
                        // Time blocked on a busy writer is not idle time.
                        now = Instant::now();
                        last_record = now;
                    }
                }
            }
            if self.tracker.linger_elapsed(now) {
                self.flush(&mut pending, opened_at, FlushReason::Linger, tx)?;
                now = Instant::now();
                last_record = now;
            }
            if let Some(idle) = self.exit_when_idle {
                if !idle_clock_running && self.metrics.assigned_partitions.get() > 0 {
                    idle_clock_running = true;
                    last_record = now;
                }
                if idle_clock_running
                    && self.tracker.is_empty()
                    && now.duration_since(last_record) >= idle
                {
                    tracing::info!(idle = ?idle, "No records for the idle period; stopping.");
                    self.stop.store(true, Ordering::Relaxed);
                }
            }
        }
    }

    fn dead_letter(
        &self,
        msg: &impl Message,
        payload: &[u8],
        err: &DecodeError,
    ) -> Result<DeliveryFuture> {
        self.metrics
            .dead_lettered
            .with_label_values(&[err.kind.as_str()])
            .inc();
        tracing::debug!(topic = msg.topic(), partition = msg.partition(), offset = msg.offset(), error = %err, "Dead-lettering a malformed record.");
        let partition = msg.partition().to_string();
        let offset = msg.offset().to_string();
        let reason = err.to_string();
        let fields = [
            (headers::KIND, err.kind.as_str()),
            (headers::FIELD, err.field.as_str()),
            (headers::REASON, reason.as_str()),
            (headers::TOPIC, msg.topic()),
            (headers::PARTITION, &partition),
            (headers::OFFSET, &offset),
        ];
        send_dead_letter(&self.producer, &self.config, &fields, msg.key(), payload)
    }

    fn flush(
        &mut self,
        p: &mut Pending,
        opened_at: Instant,
        reason: FlushReason,
        tx: &mpsc::Sender<SourceBatch>,
    ) -> Result<()> {
        if self.tracker.is_empty() {
            return Ok(());
        }
        let (records, bytes) = self.tracker.take();
        tracing::debug!(records, bytes, reason = reason.as_str(), age = ?opened_at.elapsed(), "Batch cut.");
        let tables = p.builders.finish()?;
        p.clock = WallClock::new();
        let offsets = p
            .take_offsets()
            .into_iter()
            .map(|((t, part), off)| (self.config.topics[t].clone(), part, off))
            .collect();
        let batch = SourceBatch {
            tables,
            offsets,
            dead_letters: std::mem::take(&mut p.dead_letters),
            records,
            bytes,
            opened_at,
            reason,
            forgets: Vec::new(),
            produced_ms: std::mem::take(&mut p.produced_ms),
        };
        self.send(batch, tx)
    }

    fn send(&self, batch: SourceBatch, tx: &mpsc::Sender<SourceBatch>) -> Result<()> {
        let (reason, records, bytes) = (batch.reason, batch.records, batch.bytes);
        self.metrics
            .batches
            .with_label_values(&[reason.as_str()])
            .inc();
        self.metrics.batch_records.observe(records as f64);
        self.metrics.batch_bytes.observe(bytes as f64);
        self.metrics.queue_depth.inc();
        let stopped = || Error::Internal {
            message: "the writer stopped before the source".into(),
        };
        match tx.try_send(batch) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(batch)) => {
                // The queue is full: the sink is slower than the source, and
                // waiting here is the backpressure (Kafka keeps the rest).
                let blocked = Instant::now();
                let sent = tx.blocking_send(batch);
                self.metrics
                    .backpressure
                    .inc_by(blocked.elapsed().as_secs_f64());
                sent.map_err(|_| stopped())
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(stopped()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_commits_the_next_offset_of_every_partition_it_read() {
        let mut p = Pending::new();
        for (topic, partition, next) in [
            (0, 1, 11),
            (0, 1, 12),
            (0, 2, 5),
            (1, 1, 7),
            (0, 1, 13),
            (0, 2, 4),
        ] {
            p.advance(topic, partition, next);
        }
        let got: BTreeMap<_, _> = p.take_offsets().into_iter().collect();
        assert_eq!(
            got,
            BTreeMap::from([((0, 1), 13), ((0, 2), 5), ((1, 1), 7)])
        );
        assert!(p.take_offsets().is_empty(), "taken once");
    }

    #[test]
    fn a_dead_letter_that_fits_is_sent_whole() {
        let payload = vec![b'x'; 900_000];
        let f = fit_dead_letter(&payload, Some(b"alice"), 300, DEFAULT_MESSAGE_MAX_BYTES);
        assert_eq!(f.payload.len(), 900_000);
        assert_eq!(f.key, Some(&b"alice"[..]));
        assert_eq!((f.payload_cut_from, f.key_cut_from), (None, None));
    }

    #[test]
    fn a_payload_over_the_producer_limit_is_cut_to_fit_with_its_headers() {
        // The poison pill: a malformed record just under max_event_bytes (1 MiB).
        let payload = vec![b'x'; 1_040_109];
        let header_bytes = 5_000;
        let f = fit_dead_letter(
            &payload,
            Some(b"alice"),
            header_bytes,
            DEFAULT_MESSAGE_MAX_BYTES,
        );
        assert_eq!(f.payload_cut_from, Some(1_040_109));
        let total = f.payload.len() + 5 + header_bytes + DEAD_LETTER_FRAMING_BYTES;
        assert!(total < DEFAULT_MESSAGE_MAX_BYTES, "{total}");
        assert!(
            f.payload.len() > 990_000,
            "keeps nearly all it can: {}",
            f.payload.len()
        );
        assert_eq!(
            f.payload,
            &payload[..f.payload.len()],
            "a prefix of the original"
        );
        // A raised producer limit keeps it whole.
        let f = fit_dead_letter(&payload, None, header_bytes, 2_000_000);
        assert_eq!((f.payload.len(), f.payload_cut_from), (1_040_109, None));
    }

    #[test]
    fn a_huge_key_is_cut_too_and_nothing_underflows() {
        let key = vec![b'k'; 600_000];
        let payload = vec![b'x'; 600_000];
        let f = fit_dead_letter(&payload, Some(&key), 0, DEFAULT_MESSAGE_MAX_BYTES);
        assert_eq!(f.key.map(<[u8]>::len), Some(DEAD_LETTER_KEY_MAX_BYTES));
        assert_eq!(f.key_cut_from, Some(600_000));
        assert!(f.payload_cut_from.is_none());
        // A limit smaller than the framing leaves an empty payload, not a panic.
        let f = fit_dead_letter(&payload, Some(&key), 10_000, 100);
        assert!(f.payload.is_empty());
        assert_eq!(f.payload_cut_from, Some(600_000));
    }
}
