//! `steamrf bench ingest`: events/s from Kafka into LanceDB, beside the raw
//! group-consume rate of kcat on the same topic, measured in the same run.
//!
//! Both rates are measured from the first record seen to the last one
//! handled, so the consumer-group join (seconds on some brokers) is excluded
//! from both. For steamrf "handled" means durable in LanceDB *and* its offset
//! committed; for kcat it means printed.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

use steamrf_pipelines::config::{Config, EmbedConfig, EmbedEngine};
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::pipeline::{self, RunOptions};
use steamrf_pipelines::{embed, source, sql};

mod decode;
mod hammer;
mod index;
mod retrieve;
mod serve;
mod soak;
pub use decode::{DecodeBench, decode_bench};
pub use hammer::{HammerBench, hammer};
pub use index::{IndexBench, index};
pub use retrieve::{RetrieveBench, retrieve};
pub use serve::{ServeBench, serve};
pub use soak::{SoakBench, soak};

/// Events per second, two ways.
#[derive(Debug, Clone, Copy)]
struct Rates {
    /// From the first record seen to the last one handled (excludes start-up
    /// and the group join).
    steady: f64,
    /// From process (or pipeline) start to the last record handled.
    wall: f64,
    /// CPU time over the same span as `steady`: the consumer's process, and
    /// the whole machine (the broker, and anything else running).
    process: Cpu,
    machine: Cpu,
}

/// CPU seconds from `/proc` (Linux; zero elsewhere), in user and kernel
/// mode. On a VM whose host takes freed pages back, the kernel share is
/// mostly the first touch of memory (zeroing it, copying file data into the
/// page cache), and it varies from run to run with what the host did.
#[derive(Debug, Clone, Copy, Default)]
struct Cpu {
    user: f64,
    system: f64,
}

impl Cpu {
    /// `/proc` counts in USER_HZ, 100 per second on Linux whatever the kernel's HZ.
    const TICK: f64 = 0.01;

    /// Every core's busy time (`/proc/stat`; steal time excluded).
    fn machine() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<f64> = stat
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        let at = |i: usize| ticks.get(i).copied().unwrap_or(0.0);
        // user nice system idle iowait irq softirq steal
        Self {
            user: (at(0) + at(1)) * Self::TICK,
            system: (at(2) + at(5) + at(6)) * Self::TICK,
        }
    }

    /// One process's (`/proc/<pid>/stat`, utime and stime; `pid` may be `self`).
    fn process(pid: &str) -> Self {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The command name may hold spaces: fields are counted after its ')'.
        let fields: Vec<f64> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .map(|t| t.parse().unwrap_or(0.0))
            .collect();
        let at = |i: usize| fields.get(i).copied().unwrap_or(0.0);
        Self {
            user: at(11) * Self::TICK,
            system: at(12) * Self::TICK,
        }
    }

    fn since(self, earlier: Self) -> Self {
        Self {
            user: self.user - earlier.user,
            system: self.system - earlier.system,
        }
    }

    fn total(self) -> f64 {
        self.user + self.system
    }

    /// Microseconds per event, and the kernel's share, for a report line.
    fn per_event(self, n: u64) -> String {
        format!(
            "{:.2} µs/event ({:.0}% in the kernel)",
            self.total() * 1e6 / n as f64,
            100.0 * self.system / self.total().max(f64::MIN_POSITIVE)
        )
    }
}

/// Options of `steamrf bench ingest`.
#[derive(Debug, Clone)]
pub struct IngestBench {
    /// Bootstrap servers.
    pub brokers: String,
    /// Events to produce and ingest.
    pub events: u64,
    /// Partitions of the bench topic.
    pub partitions: i32,
    /// The kcat binary.
    pub kcat: PathBuf,
    /// Base pipeline configuration (batching, LanceDB options); topic, group
    /// and LanceDB directory are replaced by fresh ones.
    pub config: Config,
    /// LanceDB location; a temp dir when `None`.
    pub lancedb_uri: Option<String>,
    /// Make the sink the bottleneck: 1,000-row batches, each an idempotent
    /// merge without the key index (a scan of the whole key column), so the
    /// source runs into backpressure.
    pub slow_sink: bool,
    /// The `steamrf` binary that produces the events (`bench produce`) in a
    /// process of its own.
    pub producer: PathBuf,
    /// Distinct events among them (the rest are exact repeats, which the
    /// idempotent write skips): a backlog of `events` over a table that
    /// never exceeds `distinct` rows. `events` when 0.
    pub distinct: u64,
    /// The share of events that are dialogue turns (embedded at ingest, with
    /// their passage windows); the rest are clicks.
    pub turns_share: f64,
    /// Produce at this many events/s while the pipeline runs and measure
    /// the produce → durable latency ([`ingest_latency`]); 0: produce the
    /// backlog first and measure throughput against kcat.
    pub rate: u64,
}

/// Whether bench event `i` is a dialogue turn when a `share` of them are:
/// spread evenly over the stream by a multiplicative hash of `i`.
pub fn bench_is_turn(i: u64, share: f64) -> bool {
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f64 / f64::from(1u32 << 24) < share
}

/// The text of bench dialogue turn `i`: 4–48 words of [`WORDS`], fixed by `i`.
pub fn bench_turn_text(i: u64) -> String {
    let mut h = i.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    let mut next = || {
        // xorshift64*
        h ^= h >> 12;
        h ^= h << 25;
        h ^= h >> 27;
        h.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let len = 4 + (next() % 45) as usize;
    let mut words: Vec<&str> = (0..len)
        .map(|_| WORDS[(next() % WORDS.len() as u64) as usize])
        .collect();
    words.push(".");
    words.join(" ")
}

/// Bench event `i`: a dialogue turn (see [`bench_is_turn`]) or a ~200-byte click.
pub fn bench_event_mixed(i: u64, turns_share: f64) -> (String, String) {
    if !bench_is_turn(i, turns_share) {
        return bench_event(i);
    }
    let user = format!("user-{:06}", i % 100_000);
    let payload = serde_json::json!({
        "type": "dialogue_turn",
        "schema_version": 1,
        "event_id": format!("bench-{i:012}"),
        "timestamp": 1_764_000_000_000u64 + i,
        "user_id": user,
        "session_id": format!("session-{user}-{}", i / 1_000_000),
        "role": "user",
        "text": bench_turn_text(i),
    })
    .to_string();
    (user, payload)
}

/// One ~200-byte click event.
pub fn bench_event(i: u64) -> (String, String) {
    let user = format!("user-{:06}", i % 100_000);
    let payload = format!(
        r#"{{"type":"click","schema_version":1,"event_id":"bench-{i:012}","timestamp":{},"user_id":"{user}","item_id":"item-{:07}","session_id":"session-{:010}-{:016x}","rating":4.0}}"#,
        1_764_000_000_000u64 + i,
        (i * 7919) % 1_000_000,
        i / 20,
        i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    );
    (user, payload)
}

/// `steamrf bench produce`: creates `topic` (if needed) and produces `n`
/// bench events to it; the last line is the `RESULT` line.
///
/// # Errors
/// Broker failures.
pub async fn produce_events(
    brokers: &str,
    topic: &str,
    partitions: i32,
    n: u64,
    distinct: u64,
    turns_share: f64,
    pace: u64,
) -> Result<Vec<String>> {
    source::ensure_topic(brokers, &Default::default(), topic, partitions, &[]).await?;
    let (b, t) = (brokers.to_owned(), topic.to_owned());
    let (rate, avg) =
        tokio::task::spawn_blocking(move || produce(&b, &t, n, distinct, turns_share, pace))
            .await
            .map_err(|e| Error::Internal {
                message: e.to_string(),
            })??;
    Ok(vec![
        format!(
            "produced {n} events ({:.0}% dialogue turns) of {avg} bytes on average into {topic} at {rate:.0}/s",
            turns_share * 100.0
        ),
        format!("RESULT events={n} events_per_s={rate:.0} avg_bytes={avg}"),
    ])
}

/// Runs `producer bench produce …` and reads its `RESULT` line.
fn produce_in_child(
    producer: &std::path::Path,
    brokers: &str,
    topic: &str,
    n: u64,
    distinct: u64,
    turns_share: f64,
    rate: u64,
) -> Result<(f64, usize)> {
    let out = Command::new(producer)
        .args(["bench", "produce", "--brokers", brokers, "--topic", topic])
        .args([
            "--events",
            &n.to_string(),
            "--distinct",
            &distinct.to_string(),
            "--turns-share",
            &turns_share.to_string(),
            "--rate",
            &rate.to_string(),
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| Error::Io {
            context: format!("running {} bench produce", producer.display()),
            source,
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let result = result_fields(&text).unwrap_or_default();
    match (
        out.status.success(),
        result.get("events_per_s"),
        result.get("avg_bytes"),
    ) {
        (true, Some(&rate), Some(&avg)) => Ok((rate, avg as usize)),
        _ => Err(Error::Internal {
            message: format!("bench produce failed ({}): {text}", out.status),
        }),
    }
}

/// The build profile this binary was compiled with, named in every bench's
/// `RESULT` line (`profile=dev|release`): the dev profile builds dependencies at
/// opt-level 1, so its figures and the release build's differ.
pub const PROFILE: &str = if cfg!(debug_assertions) {
    "dev"
} else {
    "release"
};

/// The numeric fields of a bench or eval command's output, whose last line is
/// `RESULT key=value …`; `None` if it is not. Fields whose value is not a number
/// (`profile=dev`, `store=ivf`) are left out.
pub fn result_fields(output: &str) -> Option<std::collections::HashMap<String, f64>> {
    let fields = output.lines().last()?.strip_prefix("RESULT ")?;
    Some(
        fields
            .split_whitespace()
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect(),
    )
}

fn produce(
    brokers: &str,
    topic: &str,
    n: u64,
    distinct: u64,
    turns_share: f64,
    rate: u64,
) -> Result<(f64, usize)> {
    // Paced, a record should not wait long in the producer: the latency
    // measured starts at its timestamp (set when it is handed over).
    let linger = if rate > 0 { "5" } else { "20" };
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", linger)
        .set("batch.size", "1000000")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .create()
        .map_err(Error::kafka("creating the bench producer"))?;
    let started = Instant::now();
    let mut bytes = 0;
    for i in 0..n {
        if rate > 0 && i % 50 == 0 {
            // Event i is due i / rate seconds after the start.
            let due = started + Duration::from_secs_f64(i as f64 / rate as f64);
            while let Some(wait) = due.checked_duration_since(Instant::now()) {
                producer.poll(wait);
            }
        }
        // Event i repeats event i mod distinct exactly (a redelivery).
        let (key, payload) = bench_event_mixed(i % distinct.max(1), turns_share);
        bytes += payload.len();
        let mut record = BaseRecord::to(topic).key(&key).payload(&payload);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => return Err(Error::kafka("producing bench events")(e)),
            }
        }
        if i % 10_000 == 0 {
            producer.poll(Duration::ZERO);
        }
    }
    producer
        .flush(Duration::from_secs(120))
        .map_err(Error::kafka("flushing bench events"))?;
    Ok((
        n as f64 / started.elapsed().as_secs_f64(),
        bytes / n.max(1) as usize,
    ))
}

/// kcat's group-consume rate: records per second between the first and the
/// last record it prints.
fn kcat_rate(kcat: &PathBuf, brokers: &str, topic: &str, n: u64) -> Result<Rates> {
    let group = format!("{topic}-kcat");
    let spawned = Instant::now();
    let mut child = Command::new(kcat)
        .args([
            "-b",
            brokers,
            "-G",
            &group,
            "-X",
            "auto.offset.reset=earliest",
            "-X",
            "session.timeout.ms=6000",
        ])
        .args(["-q", "-f", "%o\n", "-c", &n.to_string(), topic])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|source| Error::Io {
            context: format!("running {}", kcat.display()),
            source,
        })?;
    let stdout = child.stdout.take().ok_or_else(|| Error::Internal {
        message: "no kcat stdout".into(),
    })?;
    let lines = BufReader::with_capacity(1 << 20, stdout).split(b'\n');
    let pid = child.id().to_string();
    let mut first = None;
    let mut cpu_at_first = (Cpu::default(), Cpu::default());
    let mut count = 0u64;
    for line in lines {
        line.map_err(|source| Error::Io {
            context: "reading kcat output".into(),
            source,
        })?;
        if first.is_none() {
            first = Some(Instant::now());
            cpu_at_first = (Cpu::process(&pid), Cpu::machine());
        }
        count += 1;
        if count == n {
            break;
        }
    }
    let last = Instant::now();
    let (process, machine) = (Cpu::process(&pid), Cpu::machine());
    child.kill().ok(); // it may have exited after printing n records
    child.wait().ok();
    let first = first.ok_or_else(|| Error::Internal {
        message: "kcat printed no records".into(),
    })?;
    if count < n {
        return Err(Error::Internal {
            message: format!("kcat consumed {count} of {n} records"),
        });
    }
    Ok(Rates {
        steady: (n - 1) as f64 / last.duration_since(first).as_secs_f64(),
        wall: n as f64 / last.duration_since(spawned).as_secs_f64(),
        process: process.since(cpu_at_first.0),
        machine: machine.since(cpu_at_first.1),
    })
}

/// Runs the benchmark and returns the output lines, the last one being the `RESULT` line.
///
/// # Errors
/// Broker, kcat or pipeline failures.
pub async fn ingest(b: IngestBench) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let stamp = chrono::Utc::now().format("%Y%m%d%H%M%S%3f");
    let topic = format!("steamrf-bench-{stamp}");
    source::ensure_topic(&b.brokers, &Default::default(), &topic, b.partitions, &[]).await?;
    let n = b.events;
    // In a child process (`steamrf bench produce`), so that the producer's
    // buffers (the whole backlog, until delivered) are not counted in this
    // process's memory below.
    let distinct = if b.distinct == 0 {
        n
    } else {
        b.distinct.min(n)
    };
    let turns_share = b.turns_share;
    if !(0.0..=1.0).contains(&turns_share) {
        return Err(Error::Config {
            problems: vec![format!(
                "--turns-share: must be in [0, 1], got {turns_share}"
            )],
        });
    }
    if b.rate > 0 {
        return ingest_latency(b, topic, distinct).await;
    }
    let (exe, brokers, t) = (b.producer.clone(), b.brokers.clone(), topic.clone());
    let (produce_rate, avg_bytes) = tokio::task::spawn_blocking(move || {
        produce_in_child(&exe, &brokers, &t, n, distinct, turns_share, 0)
    })
    .await
    .map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    out.push(format!("produced {n} events ({:.0}% dialogue turns) of {avg_bytes} bytes on average into {topic} ({} partitions) at {produce_rate:.0}/s", turns_share * 100.0, b.partitions));

    let (kcat, brokers, t) = (b.kcat.clone(), b.brokers.clone(), topic.clone());
    let kcat = tokio::task::spawn_blocking(move || kcat_rate(&kcat, &brokers, &t, n))
        .await
        .map_err(|e| Error::Internal {
            message: e.to_string(),
        })??;
    out.push(format!(
        "kcat (librdkafka group consumer, output to a pipe): {:.0} events/s first → last record; {:.0} events/s from process start",
        kcat.steady, kcat.wall
    ));

    let dir = tempfile::tempdir().map_err(|source| Error::Io {
        context: "temp dir".into(),
        source,
    })?;
    let config = bench_config(&b, &topic, dir.path());
    let metrics = Metrics::new(&config.kafka.topics);
    let stop = Arc::new(AtomicBool::new(false));
    let policy = config.batch.policy();
    let rss_before = rss_bytes("VmRSS:");
    let mut rss_ready = 0;
    let mut load_peak = 0;
    let started = Instant::now();
    let task = tokio::spawn(pipeline::run(
        config.clone(),
        RunOptions::default(),
        metrics.clone(),
        stop.clone(),
    ));
    let received = metrics.records_received.with_label_values(&[&topic]);
    let mut first = None;
    let mut cpu_at_first = (Cpu::default(), Cpu::default());
    let mut first_commit: Option<Instant> = None;
    let mut deciles: Vec<u64> = Vec::with_capacity(10);
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if task.is_finished() {
            break;
        }
        if first.is_none() && received.get() > 0 {
            first = Some(Instant::now());
            cpu_at_first = (Cpu::process("self"), Cpu::machine());
            // Start-up (model, tables, consumer) is done: its peak is kept
            // apart and the kernel's high-water mark restarts here, so the
            // peak read at the end is the peak while draining the backlog.
            load_peak = rss_bytes("VmHWM:");
            rss_ready = rss_bytes("VmRSS:");
            reset_peak_rss();
        }
        let committed = metrics.records_committed.get();
        if committed > 0 && first_commit.is_none() {
            first_commit = Some(Instant::now());
        }
        // The peak so far at each tenth of the backlog: flat if memory
        // does not grow with what was drained.
        while first.is_some()
            && committed * 10 >= n * (deciles.len() as u64 + 1)
            && deciles.len() < 10
        {
            deciles.push(rss_bytes("VmHWM:"));
        }
        if committed >= n {
            break;
        }
        if Instant::now() > deadline {
            return Err(Error::Internal {
                message: "steamrf did not ingest every event within 10 minutes".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let done = Instant::now();
    let cpu_at_done = (Cpu::process("self"), Cpu::machine());
    let drain_peak = rss_bytes("VmHWM:");
    let (anon, file) = (rss_bytes("RssAnon:"), rss_bytes("RssFile:"));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let summary = task.await.map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    let first = first.ok_or_else(|| Error::Internal {
        message: "steamrf received nothing".into(),
    })?;
    let steamrf = Rates {
        steady: n as f64 / done.duration_since(first).as_secs_f64(),
        wall: n as f64 / done.duration_since(started).as_secs_f64(),
        process: cpu_at_done.0.since(cpu_at_first.0),
        machine: cpu_at_done.1.since(cpu_at_first.1),
    };
    let rows = sql::query(
        &config.lancedb,
        "SELECT count(*) AS n, count(DISTINCT event_id) AS d FROM interactions",
    )
    .await?;
    let counts = arrow_cast::pretty::pretty_format_batches(&rows)?
        .to_string()
        .replace('\n', " ");
    out.push(format!(
        "steamrf (decode → Arrow → LanceDB merge_insert → commit; batches of ≤{} rows / {} bytes / {:?}): {:.0} events/s first record → last commit; {:.0} events/s from pipeline start; {} batches; table check: {counts}",
        policy.max_rows, policy.max_bytes, policy.linger, steamrf.steady, steamrf.wall, summary.batches
    ));
    let writes: Vec<String> = steamrf_schemas::TableName::ALL
        .iter()
        .filter_map(|t| {
            let h = metrics.write_duration.with_label_values(&[t.as_str()]);
            (h.get_sample_count() > 0).then(|| {
                format!(
                    "{} {} writes, {:.1} s",
                    t.as_str(),
                    h.get_sample_count(),
                    h.get_sample_sum()
                )
            })
        })
        .collect();
    out.push(format!(
        "  time in LanceDB writes: {}; source blocked on a full queue: {:.1} s; wall time first record → last commit: {:.1} s",
        writes.join(", "),
        metrics.backpressure.get(),
        done.duration_since(first).as_secs_f64()
    ));
    let commits = commits(&metrics);
    let turns = if turns_share > 0.0 {
        let secs = done.duration_since(first).as_secs_f64();
        Some(turn_rates(&config, n, distinct, turns_share, secs, &metrics).await?)
    } else {
        None
    };
    if let Some(t) = &turns {
        out.push(format!(
            "  dialogue turns: {} stored, {:.0} turns/s first record → last commit; {} texts embedded (turns and their passage windows); the embedder alone on {} of the same turn texts: {:.0} texts/s; ratio {:.3}",
            t.turns, t.turns_per_s, t.embedded, t.sample, t.embedder_per_s, t.turns_per_s / t.embedder_per_s
        ));
        let stage = metrics.operator_duration.with_label_values(&["embed"]);
        out.push(format!(
            "  embed stage: {:.1} s over {} batches, of which {:.1} s inside {} embedding calls (the turns and their windows run at once, so the sum can exceed the stage)",
            stage.get_sample_sum(),
            stage.get_sample_count(),
            metrics.embed_duration.get_sample_sum(),
            metrics.embed_duration.get_sample_count()
        ));
        out.push(format!(
            "  per text embedded: the pipeline {:.0} texts/s; the embedder alone on a sample of the same texts (turns and windows as stored, in the pipeline's proportion) {:.0} texts/s; ratio {:.3}",
            t.texts_per_s, t.embedder_mix_per_s, t.texts_per_s / t.embedder_mix_per_s
        ));
    }
    let first_commit_s = first_commit.map_or(f64::NAN, |c| c.duration_since(first).as_secs_f64());
    let us = |c: Cpu| c.total() * 1e6 / n as f64;
    out.push(format!(
        "  first commit {first_commit_s:.1} s after the first record"
    ));
    let reasons: Vec<String> = steamrf_operators::batch::FlushReason::ALL
        .iter()
        .map(|r| {
            format!(
                "{}={}",
                r.as_str(),
                metrics.batches.with_label_values(&[r.as_str()]).get()
            )
        })
        .collect();
    out.push(format!("  batches cut by: {}", reasons.join(" ")));
    out.push(format!(
        "  CPU, first record → last: steamrf's process {}, the whole machine (broker included) {}; kcat's process {}, the whole machine {}",
        steamrf.process.per_event(n),
        steamrf.machine.per_event(n),
        kcat.process.per_event(n),
        kcat.machine.per_event(n)
    ));
    out.push(format!(
        "  from start, group join included: steamrf {:.0} events/s, kcat {:.0} events/s, ratio {:.3}",
        steamrf.wall,
        kcat.wall,
        steamrf.wall / kcat.wall
    ));
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    out.push(format!(
        "  memory (RSS of this process; the events were produced by another): {:.0} MiB before the pipeline started, start-up peak {:.0} MiB (model, tables), {:.0} MiB at the first record, peak {:.0} MiB while draining the {n}-event backlog; source blocked on a full queue {:.1} s",
        mib(rss_before),
        mib(load_peak),
        mib(rss_ready),
        mib(drain_peak),
        metrics.backpressure.get()
    ));
    out.push(format!(
        "  RSS at the end: {:.0} MiB anonymous (heap, stacks), {:.0} MiB file-backed (the binary's pages, mapped files)",
        mib(anon),
        mib(file)
    ));
    out.push(format!(
        "  peak RSS after each tenth of the backlog (MiB): {}",
        deciles
            .iter()
            .map(|&b| format!("{:.0}", mib(b)))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    let turn_keys = turns.map_or_else(String::new, |t| {
        format!(
            " turns_share={turns_share} turns_per_s={:.1} embedder_texts_per_s={:.1} turns_ratio={:.3} texts_per_s={:.1} embedder_mix_texts_per_s={:.1} texts_ratio={:.3}",
            t.turns_per_s,
            t.embedder_per_s,
            t.turns_per_s / t.embedder_per_s,
            t.texts_per_s,
            t.embedder_mix_per_s,
            t.texts_per_s / t.embedder_mix_per_s
        )
    });
    out.push(format!(
        "RESULT ingest_events_per_s={:.0} kcat_events_per_s={:.0} ratio={:.3} peak_rss_mib={:.0} startup_peak_rss_mib={:.0} ready_rss_mib={:.0} backpressure_s={:.1} commits={commits} first_commit_s={first_commit_s:.1} cpu_us_per_event={:.2} kernel_share={:.2} machine_cpu_us_per_event={:.2} kcat_cpu_us_per_event={:.2} kcat_machine_cpu_us_per_event={:.2}{turn_keys}",
        steamrf.steady,
        kcat.steady,
        steamrf.steady / kcat.steady,
        mib(drain_peak),
        mib(load_peak),
        mib(rss_ready),
        metrics.backpressure.get(),
        us(steamrf.process),
        steamrf.process.system / steamrf.process.total().max(f64::MIN_POSITIVE),
        us(steamrf.machine),
        us(kcat.process),
        us(kcat.machine)
    ));
    Ok(out)
}

/// The pipeline configuration of an ingest bench: `b.config` on a fresh
/// topic, group, dead-letter topic and (unless given) LanceDB directory.
fn bench_config(b: &IngestBench, topic: &str, dir: &std::path::Path) -> Config {
    let mut config = b.config.clone();
    if b.slow_sink {
        config.lancedb.reindex_rows = 0;
        config.lancedb.fresh_keys = 0;
        config.batch.max_rows = config.batch.max_rows.min(1000);
    }
    config.kafka.brokers = b.brokers.clone();
    config.kafka.topics = vec![topic.to_owned()];
    config.kafka.group_id = format!("{topic}-steamrf");
    config.kafka.dead_letter_topic = format!("{topic}-dlq");
    config.lancedb.uri = b
        .lancedb_uri
        .clone()
        .unwrap_or_else(|| dir.to_string_lossy().into_owned());
    config
}

/// LanceDB commits so far: every write is one commit (a version of its table).
fn commits(metrics: &Metrics) -> u64 {
    steamrf_schemas::TableName::ALL
        .iter()
        .map(|t| {
            metrics
                .write_duration
                .with_label_values(&[t.as_str()])
                .get_sample_count()
        })
        .sum()
}

/// The `q` quantile of histogram `h`, interpolated linearly within its
/// bucket as Prometheus' `histogram_quantile` does (NaN when empty,
/// infinite past the last bucket).
fn histogram_quantile(h: &prometheus::Histogram, q: f64) -> f64 {
    use prometheus::core::Metric as _;
    let m = h.metric();
    let hist = m.get_histogram();
    let total = hist.get_sample_count();
    if total == 0 {
        return f64::NAN;
    }
    let rank = q * total as f64;
    let (mut lower, mut below) = (0.0, 0u64);
    for b in hist.get_bucket() {
        let (upper, count) = (b.upper_bound(), b.cumulative_count());
        if count as f64 >= rank {
            let inside = (count - below) as f64;
            return lower + (upper - lower) * (rank - below as f64) / inside.max(1.0);
        }
        (lower, below) = (upper, count);
    }
    f64::INFINITY
}

/// `bench ingest --rate R`: the pipeline runs first; a child process then
/// produces the events at `R`/s, each stamped by its producer; the latency
/// of each record is its Kafka timestamp → its batch's offsets committed
/// (`steamrf_ingest_end_to_end_seconds`, the metric a deployment watches).
async fn ingest_latency(b: IngestBench, topic: String, distinct: u64) -> Result<Vec<String>> {
    let n = b.events;
    let dir = tempfile::tempdir().map_err(|source| Error::Io {
        context: "temp dir".into(),
        source,
    })?;
    let config = bench_config(&b, &topic, dir.path());
    let metrics = Metrics::new(&config.kafka.topics);
    let stop = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(pipeline::run(
        config.clone(),
        RunOptions::default(),
        metrics.clone(),
        stop.clone(),
    ));
    // Produce only once the group has assigned the partitions, so the
    // latency does not include the pipeline's start-up.
    let ready_by = Instant::now() + Duration::from_secs(120);
    while metrics.assigned_partitions.get() == 0 {
        if task.is_finished() || Instant::now() > ready_by {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            task.await.map_err(|e| Error::Internal {
                message: e.to_string(),
            })??;
            return Err(Error::Internal {
                message: "the pipeline was not assigned its partitions within 120 s".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    reset_peak_rss();
    let (exe, brokers, t, turns_share, rate) = (
        b.producer.clone(),
        b.brokers.clone(),
        topic.clone(),
        b.turns_share,
        b.rate,
    );
    let started = Instant::now();
    let producer = tokio::task::spawn_blocking(move || {
        produce_in_child(&exe, &brokers, &t, n, distinct, turns_share, rate)
    });
    let deadline = started + Duration::from_secs_f64(n as f64 / b.rate as f64 + 300.0);
    while metrics.records_committed.get() < n && !task.is_finished() {
        if Instant::now() > deadline {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(Error::Internal {
                message: format!(
                    "steamrf committed {} of {n} events within {:.0} s",
                    metrics.records_committed.get(),
                    deadline.duration_since(started).as_secs_f64()
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let peak = rss_bytes("VmHWM:");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    task.await.map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    let (produced_per_s, avg_bytes) = producer.await.map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    let e2e = &metrics.end_to_end;
    let (p50, p99) = (histogram_quantile(e2e, 0.5), histogram_quantile(e2e, 0.99));
    let commits = commits(&metrics);
    let batches = metrics.batch_latency.get_sample_count();
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    Ok(vec![
        format!(
            "produced {n} events ({:.0}% dialogue turns, {avg_bytes} bytes on average) at {produced_per_s:.0}/s (target {}/s) while steamrf ran; all committed {took:.1} s after the first was produced",
            b.turns_share * 100.0,
            b.rate
        ),
        format!(
            "  produce → durable (Kafka timestamp → offsets committed, {} records): p50 {p50:.3} s, p99 {p99:.3} s (interpolated within the histogram's buckets: 0.1 s wide up to 1 s); {batches} batches, {commits} LanceDB commits; peak RSS {:.0} MiB",
            e2e.get_sample_count(),
            mib(peak)
        ),
        format!(
            "RESULT rate={} produced_per_s={produced_per_s:.0} e2e_p50_s={p50:.3} e2e_p99_s={p99:.3} batches={batches} commits={commits} peak_rss_mib={:.0}",
            b.rate,
            mib(peak)
        ),
    ])
}

/// The dialogue-turn side of `bench ingest --turns-share`.
struct TurnRates {
    /// Turns stored.
    turns: u64,
    /// Turns stored per second, first record → last commit.
    turns_per_s: f64,
    /// Texts the pipeline embedded (turns and passage windows).
    embedded: u64,
    /// Turn texts the embedder was timed on alone.
    sample: usize,
    /// The embedder's own rate on them, texts/s.
    embedder_per_s: f64,
    /// Texts the pipeline embedded per second, first record → last commit.
    texts_per_s: f64,
    /// The embedder's own rate on a sample of the texts the pipeline
    /// embedded (stored turn texts and passage windows, in the pipeline's
    /// proportion), texts/s.
    embedder_mix_per_s: f64,
}

/// Counts the stored turns and times the embedder alone on the same turn
/// texts (up to 4,000 of them), and on a sample of every text the pipeline
/// embedded; each in one call, the embedder's best.
async fn turn_rates(
    config: &Config,
    n: u64,
    distinct: u64,
    turns_share: f64,
    secs: f64,
    metrics: &Metrics,
) -> Result<TurnRates> {
    let rows = sql::query(
        &config.lancedb,
        "SELECT count(*) AS n FROM interactions WHERE kind = 'dialogue_turn'",
    )
    .await?;
    let turns = rows
        .first()
        .and_then(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<arrow_array::Int64Array>()
                .map(|a| a.value(0))
        })
        .unwrap_or(0) as u64;
    let texts: Vec<String> = (0..n.min(distinct.max(1)))
        .filter(|&i| bench_is_turn(i, turns_share))
        .take(4000)
        .map(bench_turn_text)
        .collect();
    // One call: the embedder's best on these texts (sorted by length into
    // forward passes, every worker busy).
    let timed = time_embedder(&config.embed, &texts, texts.len(), 1).await?;
    // The same work the pipeline did: its turn texts and its windows, as
    // stored, in the proportion it embedded them.
    use arrow_array::cast::AsArray;
    let embedded = metrics.total_texts_embedded();
    let windows = sql::query(
        &config.lancedb,
        "SELECT text FROM passages ORDER BY event_id LIMIT 4000",
    )
    .await?;
    let windows: Vec<String> = windows
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_string::<i32>()
                .iter()
                .flatten()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let share = embedded.saturating_sub(turns) as f64 / embedded.max(1) as f64;
    let k = ((texts.len() as f64 * share).round() as usize).min(windows.len());
    let mix: Vec<String> = texts[..texts.len() - k]
        .iter()
        .chain(&windows[..k])
        .cloned()
        .collect();
    let mixed = time_embedder(&config.embed, &mix, mix.len(), 1).await?;
    Ok(TurnRates {
        turns,
        turns_per_s: turns as f64 / secs,
        embedded,
        sample: texts.len(),
        embedder_per_s: texts.len() as f64 / timed.secs,
        texts_per_s: embedded as f64 / secs,
        embedder_mix_per_s: mix.len() as f64 / mixed.secs,
    })
}

/// The in-process embedder timed on `texts`.
struct Timed {
    /// The best of the runs, seconds.
    secs: f64,
    /// The vectors of the last run, row-major.
    vectors: Vec<f32>,
    /// Tokens embedded in one run.
    tokens: u64,
    /// The embedder's vector length.
    dim: usize,
}

/// Loads the local engine of `cfg`, warms it up, then embeds `texts` `runs`
/// times: calls of `chunk` texts, all submitted at once (each call is cut
/// into forward passes that the workers take in turn).
async fn time_embedder(
    cfg: &EmbedConfig,
    texts: &[String],
    chunk: usize,
    runs: usize,
) -> Result<Timed> {
    let mut cfg = cfg.clone();
    cfg.engine = EmbedEngine::Local;
    let embedder = embed::embedder(&cfg)?.ok_or_else(|| Error::Internal {
        message: "no embedder".into(),
    })?;
    let err = |e: steamrf_operators::embed::EmbedError| Error::Internal {
        message: e.to_string(),
    };
    // Warm-up (first-touch of the weights, thread start).
    embedder
        .embed(texts.iter().take(64).cloned().collect())
        .await
        .map_err(err)?;
    let mut timed = Timed {
        secs: f64::INFINITY,
        vectors: Vec::new(),
        tokens: 0,
        dim: embedder.dim(),
    };
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let calls = texts
            .chunks(chunk.max(1))
            .map(|c| embedder.embed(c.to_vec()));
        let results = futures::future::join_all(calls).await;
        timed.secs = timed.secs.min(t.elapsed().as_secs_f64());
        timed.vectors.clear();
        timed.tokens = 0;
        for r in results {
            let r = r.map_err(err)?;
            timed.tokens += r.tokens;
            timed.vectors.extend(r.vectors);
        }
    }
    Ok(timed)
}

/// Options of `steamrf bench similarity`.
#[derive(Debug, Clone)]
pub struct SimilarityBench {
    /// Queries per call.
    pub queries: usize,
    /// Corpus rows.
    pub corpus: usize,
    /// Dimension.
    pub dim: usize,
    /// Hits per query.
    pub k: usize,
    /// Python with numpy and threadpoolctl (scripts/tools.sh installs one).
    pub python: PathBuf,
    /// `cpu` (reference: numpy/OpenBLAS) or `cuda` (reference: cuBLAS GEMM only).
    pub backend: String,
    /// `f32` or `f16` (CUDA only).
    pub precision: String,
}

/// `steamrf bench similarity --backend cuda`: the CUDA kernel (cuBLAS GEMM +
/// top-k kernel, host merge) beside cuBLAS GEMM alone on the same shapes.
fn similarity_cuda(
    b: &SimilarityBench,
    corpus: &steamrf_kernels::Corpus,
    queries: &[f32],
) -> Result<Vec<String>> {
    use steamrf_kernels::cuda::{CudaKernel, Precision};
    use steamrf_kernels::{SearchParams, SimilarityKernel, cpu::CpuKernel};
    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let precision = if b.precision == "f16" {
        Precision::F16
    } else {
        Precision::F32
    };
    let kernel = CudaKernel::new(0, precision).map_err(internal)?;
    let flops = 2.0 * b.queries as f64 * b.corpus as f64 * b.dim as f64;
    let params = SearchParams::top(b.k);
    // Warm-up: uploads the corpus (kept on the device) and loads cuBLAS.
    kernel.top_k(queries, corpus, &params).map_err(internal)?;
    let mut best = f64::INFINITY;
    let mut hits = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        hits = kernel.top_k(queries, corpus, &params).map_err(internal)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let mut gemm = f64::INFINITY;
    for _ in 0..3 {
        gemm = gemm.min(kernel.time_gemm_only(queries, corpus).map_err(internal)?);
    }
    let q4 = &queries[..(4 * b.dim).min(queries.len())];
    let cpu = CpuKernel::default()
        .top_k(q4, corpus, &params)
        .map_err(internal)?;
    let agree = cpu
        .iter()
        .zip(&hits)
        .filter(|(c, g)| c.first().map(|h| h.index) == g.first().map(|h| h.index))
        .count();
    let (ours, blas) = (flops / best / 1e9, flops / gemm / 1e9);
    Ok(vec![
        format!(
            "steamrf cuda kernel on {} ({precision:?}, blocks of {} rows, top-{} kernel + host merge): {best:.4} s, {ours:.0} GFLOP/s",
            kernel.name, kernel.block_rows, b.k
        ),
        format!("cuBLAS SGEMM only, same blocks: {gemm:.4} s, {blas:.0} GFLOP/s"),
        format!("top-1 agrees with the CPU kernel on {agree} of 4 queries"),
        format!(
            "RESULT steamrf_gflops={ours:.1} blas_gflops={blas:.1} ratio={:.3}",
            ours / blas
        ),
    ])
}

/// `steamrf bench similarity`: GFLOP/s of the CPU kernel (top-k included)
/// beside numpy's matmul (OpenBLAS) on the same shapes, in the same run.
///
/// # Errors
/// Kernel input errors, or the numpy reference failing to run.
pub fn similarity(b: &SimilarityBench) -> Result<Vec<String>> {
    use rand::{Rng, SeedableRng};
    use steamrf_kernels::{
        Corpus, SearchParams, SimilarityKernel, cpu::CpuKernel, reference::ScalarKernel,
    };
    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let mut out = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut normal =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let corpus = Corpus::from_vec(normal(b.corpus * b.dim), b.dim).map_err(internal)?;
    let queries = normal(b.queries * b.dim);
    if b.backend == "cuda" {
        return similarity_cuda(b, &corpus, &queries);
    }
    let flops = 2.0 * b.queries as f64 * b.corpus as f64 * b.dim as f64;
    let kernel = CpuKernel::default();
    let params = SearchParams::top(b.k);
    // Warm-up on a slice of the work (pages in the corpus, spins up the threads).
    kernel
        .top_k(&queries[..b.dim.min(queries.len())], &corpus, &params)
        .map_err(internal)?;
    let mut best = f64::INFINITY;
    let mut hits = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        hits = kernel.top_k(&queries, &corpus, &params).map_err(internal)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let steamrf_gflops = flops / best / 1e9;
    out.push(format!(
        "steamrf cpu kernel ({} threads, blocks of {} rows x {} queries, top-{} fused): {best:.2} s, {steamrf_gflops:.1} GFLOP/s",
        kernel.threads, kernel.block_rows, kernel.query_block, b.k
    ));
    // Spot-check against the scalar reference on a few queries and a corpus slice.
    let sample_rows = b.corpus.min(20_000);
    let sample =
        Corpus::from_rows(&corpus.as_slice()[..sample_rows * b.dim], b.dim).map_err(internal)?;
    let q4 = &queries[..(4 * b.dim).min(queries.len())];
    let fast = kernel.top_k(q4, &sample, &params).map_err(internal)?;
    let slow = ScalarKernel.top_k(q4, &sample, &params).map_err(internal)?;
    let max_diff = fast
        .iter()
        .zip(&slow)
        .flat_map(|(f, s)| f.iter().zip(s).map(|(a, b)| (a.score - b.score).abs()))
        .fold(0.0f32, f32::max);
    out.push(format!("  parity with the scalar reference (4 queries x {sample_rows} rows): max score difference {max_diff:.2e}; {} result lists", hits.len()));

    let output = Command::new(&b.python)
        .arg("scripts/blas_bench.py")
        .args([
            "--queries",
            &b.queries.to_string(),
            "--corpus",
            &b.corpus.to_string(),
        ])
        .args(["--dim", &b.dim.to_string(), "--k", &b.k.to_string()])
        // Those two slow a current OpenBLAS down; unset for this command only.
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .output()
        .map_err(|source| Error::Io {
            context: format!("running {}", b.python.display()),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::Internal {
            message: format!(
                "blas_bench.py failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| Error::Internal {
            message: format!("blas_bench.py output: {e}"),
        })?;
    let blas_gflops = report["gemm_gflops"].as_f64().unwrap_or(f64::NAN);
    out.push(format!(
        "numpy matmul (GEMM only, corpus in blocks of 16384): {blas_gflops:.1} GFLOP/s; with a top-{} per block: {:.1} GFLOP/s; BLAS: {}",
        b.k,
        report["topk_gflops"].as_f64().unwrap_or(f64::NAN),
        report["blas"]
    ));
    out.push(format!(
        "RESULT steamrf_gflops={steamrf_gflops:.1} blas_gflops={blas_gflops:.1} ratio={:.3}",
        steamrf_gflops / blas_gflops
    ));
    Ok(out)
}

/// Options of `steamrf bench embed`.
#[derive(Debug, Clone)]
pub struct EmbedBench {
    /// Texts to embed (generated unless `corpus` is given).
    pub texts: usize,
    /// One text per line, instead of the generated corpus.
    pub corpus: Option<PathBuf>,
    /// The embedding configuration (model directory, batch size, workers).
    pub config: EmbedConfig,
    /// Texts per embed call (the pipeline's micro-batch of dialogue turns).
    pub chunk: usize,
    /// Skip the sentence-transformers reference.
    pub no_reference: bool,
}

const WORDS: &[&str] = &[
    "I",
    "really",
    "liked",
    "the",
    "new",
    "album",
    "by",
    "that",
    "jazz",
    "band",
    "and",
    "want",
    "something",
    "similar",
    "for",
    "a",
    "long",
    "drive",
    "tonight",
    "my",
    "sister",
    "recommended",
    "movie",
    "about",
    "space",
    "travel",
    "with",
    "great",
    "soundtrack",
    "but",
    "ending",
    "was",
    "too",
    "slow",
    "can",
    "you",
    "suggest",
    "books",
    "on",
    "history",
    "of",
    "Rome",
    "or",
    "ancient",
    "Greece",
    "prefer",
    "acoustic",
    "guitar",
    "over",
    "electronic",
    "music",
    "when",
    "working",
    "last",
    "week",
    "bought",
    "running",
    "shoes",
    "they",
    "are",
    "comfortable",
    "looking",
    "waterproof",
    "jacket",
    "hiking",
    "in",
    "autumn",
    "kids",
    "love",
    "animated",
    "films",
    "from",
    "Japan",
    "classic",
    "rock",
    "vinyl",
    "records",
    "collection",
    "is",
    "growing",
    "fast",
    "do",
    "have",
    "any",
    "thrillers",
    "set",
    "Scandinavia",
    "coffee",
    "beans",
    "dark",
    "roast",
    "espresso",
    "machine",
    "broke",
    "again",
    "need",
    "quiet",
    "dishwasher",
    "small",
    "kitchen",
    "favourite",
    "director",
    "makes",
    "black",
    "white",
    "dramas",
    "not",
    "fan",
    "horror",
    "comedies",
    "romantic",
    "period",
    "pieces",
    "Victorian",
    "England",
    "science",
    "fiction",
    "novels",
    "robots",
    "artificial",
    "intelligence",
    "this",
    "podcast",
    "covers",
    "economics",
    "politics",
    "weekly",
    "subscription",
    "cancelled",
    "because",
    "price",
    "went",
    "up",
    "headphones",
    "noise",
    "cancelling",
    "battery",
    "life",
];

/// A deterministic corpus of dialogue-like turns and item texts, 4 to 48
/// words long (about 6 to 60 tokens).
pub fn bench_texts(n: usize, seed: u64) -> Vec<String> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            if i % 4 == 3 {
                let w = |rng: &mut rand::rngs::StdRng| WORDS[rng.random_range(0..WORDS.len())];
                format!(
                    "{} {} {}. Categories: {}, {}.",
                    w(&mut rng),
                    w(&mut rng),
                    w(&mut rng),
                    w(&mut rng),
                    w(&mut rng)
                )
            } else {
                let len = rng.random_range(4..=48);
                let mut s: Vec<&str> = (0..len)
                    .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                    .collect();
                s.push(".");
                s.join(" ")
            }
        })
        .collect()
}

/// `steamrf bench embed`: sentences/s of the in-process embedder through the
/// pipeline's async interface, beside sentence-transformers on torch on the
/// same texts and model directory, in the same run.
///
/// # Errors
/// The model failing to load, or the reference failing to run.
pub async fn embed(b: EmbedBench) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let texts = match &b.corpus {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|source| Error::Io {
                context: format!("reading {}", path.display()),
                source,
            })?
            .lines()
            .take(b.texts)
            .map(str::to_owned)
            .collect(),
        None => bench_texts(b.texts, 42),
    };
    let mut cfg = b.config.clone();
    cfg.engine = EmbedEngine::Local;
    let Timed {
        secs: best,
        vectors,
        tokens,
        dim,
    } = time_embedder(&cfg, &texts, b.chunk, 2).await?;
    let steamrf = texts.len() as f64 / best;
    out.push(format!(
        "steamrf ({:?} forward pass, {} worker(s), batches of {}, length-sorted): {} texts, {:.1} tokens/text, {best:.2} s, {steamrf:.1} sentences/s",
        cfg.backend,
        embed::workers(&cfg),
        cfg.batch_size,
        texts.len(),
        tokens as f64 / texts.len() as f64
    ));
    if b.no_reference {
        out.push(format!(
            "RESULT steamrf_sentences_per_s={steamrf:.1} reference_sentences_per_s=nan ratio=nan"
        ));
        return Ok(out);
    }
    let file = tempfile::NamedTempFile::new().map_err(|source| Error::Io {
        context: "creating a temp file".into(),
        source,
    })?;
    std::fs::write(file.path(), texts.join("\n")).map_err(|source| Error::Io {
        context: "writing the texts".into(),
        source,
    })?;
    let output = Command::new("scripts/st-reference.sh")
        .arg("--texts")
        .arg(file.path())
        .arg("--model")
        .arg(&cfg.model_dir)
        .args(["--batch-size", &cfg.batch_size.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| Error::Io {
            context: "running scripts/st-reference.sh".into(),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::Internal {
            message: "scripts/st-reference.sh failed (see above)".into(),
        });
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| Error::Internal {
            message: format!("st_bench.py output: {e}"),
        })?;
    let reference = report["sentences_per_s"].as_f64().unwrap_or(f64::NAN);
    let mut max_diff = 0.0f32;
    if let Some(vs) = report["vectors"].as_array() {
        for (i, v) in vs.iter().enumerate() {
            for (j, x) in v.as_array().into_iter().flatten().enumerate() {
                let x = x.as_f64().unwrap_or(f64::NAN) as f32;
                max_diff = max_diff.max((x - vectors[i * dim + j]).abs());
            }
        }
    }
    out.push(format!(
        "sentence-transformers {} (torch {}, {} threads, batch {}): {reference:.1} sentences/s; max abs difference over the first 50 vectors: {max_diff:.1e}",
        "6.2.0", report["torch"].as_str().unwrap_or("?"), report["threads"], cfg.batch_size
    ));
    out.push(format!(
        "RESULT steamrf_sentences_per_s={steamrf:.1} reference_sentences_per_s={reference:.1} ratio={:.3}",
        steamrf / reference
    ));
    Ok(out)
}

/// Options of `steamrf bench communities`.
#[derive(Debug, Clone)]
pub struct CommunitiesBench {
    /// Memories in the corpus before the measured batches.
    pub memories: usize,
    /// New memories per batch.
    pub batch: usize,
    /// Incremental batches measured (the median is reported).
    pub batches: usize,
    /// Run the full recomputation's relation extraction entirely instead of
    /// timing 3 of its query blocks and scaling.
    pub full_recompute: bool,
    /// Embedding dimension.
    pub dim: usize,
}

/// Restarts the kernel's peak-RSS mark (`VmHWM`) at the current RSS
/// (Linux: `echo 5 > /proc/self/clear_refs`); without it `VmHWM` keeps the
/// process's peak since start.
fn reset_peak_rss() {
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        tracing::warn!(error = %e, "Cannot reset the peak RSS; the reported peak includes start-up.");
    }
}

/// A memory line of /proc/self/status (`VmRSS:`, `VmHWM:`), in bytes.
fn rss_bytes(field: &str) -> u64 {
    proc_status_bytes("self", field)
}

/// A memory line of `/proc/<pid>/status` (`pid` may be `self`), in bytes.
fn proc_status_bytes(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The `p` quantile of sorted `sorted` (nearest rank); NaN when empty.
/// A temporary directory for a benchmark's tables, removed on drop.
fn temp_dir() -> Result<tempfile::TempDir> {
    tempfile::tempdir().map_err(|source| Error::Io {
        context: "creating a temp dir".into(),
        source,
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Appends `batch` to `table` as it is (a bench's rows are new: no
/// idempotency check), in one commit.
async fn add(table: &lancedb::Table, batch: arrow_array::RecordBatch) -> lancedb::Result<()> {
    let schema = batch.schema();
    table
        .add(
            Box::new(arrow_array::RecordBatchIterator::new([Ok(batch)], schema))
                as Box<dyn arrow_array::RecordBatchReader + Send>,
        )
        .execute()
        .await
        .map(drop)
}

/// A benchmark's own failure, as an internal error.
fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

/// Clustered synthetic memories: `topics` unit centres; each memory is its
/// topic's centre plus Gaussian noise of norm ~0.7, so members of a topic
/// have cosine ~0.67 with each other (links above τ = 0.5) and ~0 across topics.
struct Synth {
    rng: rand::rngs::StdRng,
    centres: Vec<f32>,
    dim: usize,
}

impl Synth {
    fn new(topics: usize, dim: usize) -> Self {
        use rand::SeedableRng;
        let mut s = Self {
            rng: rand::rngs::StdRng::seed_from_u64(11),
            centres: Vec::with_capacity(topics * dim),
            dim,
        };
        for _ in 0..topics {
            let mut c: Vec<f32> = (0..dim).map(|_| s.gauss()).collect();
            steamrf_operators::embed::normalize(&mut c);
            s.centres.extend(c);
        }
        s
    }

    fn gauss(&mut self) -> f32 {
        use rand::Rng;
        // Box-Muller.
        let u1: f32 = self.rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = self.rng.random_range(0.0..1.0);
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    fn memory(&mut self, topic: usize) -> Vec<f32> {
        let scale = (0.5f32 / self.dim as f32).sqrt();
        let mut v: Vec<f32> = self.centres[topic * self.dim..(topic + 1) * self.dim].to_vec();
        for x in &mut v {
            *x += self.gauss() * scale;
        }
        steamrf_operators::embed::normalize(&mut v);
        v
    }
}

/// `steamrf bench communities`: time per batch of relation extraction plus
/// community maintenance (and prototypes) on a corpus of `memories`, beside a
/// full recomputation (extraction for every memory, communities from scratch),
/// in the same run.
///
/// # Errors
/// Kernel errors.
pub fn communities(b: &CommunitiesBench) -> Result<Vec<String>> {
    use rand::Rng;
    use steamrf_kernels::cpu::CpuKernel;
    use steamrf_kernels::{Corpus, SearchParams, SimilarityKernel};
    use steamrf_operators::steam::memory::Memory;
    use steamrf_operators::steam::relations::Link;
    use steamrf_operators::steam::{MemoryId, SteamParams, SteamState};

    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let mut out = Vec::new();
    let params = SteamParams::default();
    let kernel = CpuKernel::default();
    let users = (b.memories / 10).max(10);
    let topics = (b.memories / 200).max(2);
    let mut synth = Synth::new(topics, b.dim);
    let mut state = SteamState::new(params, b.dim);
    let mut by_topic: Vec<Vec<u64>> = vec![Vec::new(); topics];
    let t = Instant::now();
    // Sequential ids: the bench measures the kernel and the graph, not the
    // hash (memory ids are opaque to both).
    let mid = |id: u64| MemoryId(u128::from(id));
    let mk = |id: u64, user: usize, topic: usize, embedding: Vec<f32>| Memory {
        id: mid(id),
        user_id: format!("u{user}"),
        content: String::new(),
        embedding,
        interactions: vec![format!("e{id}")],
        items: vec![format!("i{id}")],
        community: None,
        created_ms: 0,
        updated_ms: 0,
        version: 1,
        facets: [(format!("topic {topic}"), 1)].into_iter().collect(),
        recent: Vec::new(),
    };
    for i in 0..b.memories {
        let topic = synth.rng.random_range(0..topics);
        let e = synth.memory(topic);
        let id = i as u64 + 1;
        by_topic[topic].push(id);
        state
            .restore_memory(mk(id, i % users, topic, e))
            .map_err(internal)?;
    }
    out.push(format!(
        "corpus: {} memories of {} users in {topics} topics, dim {}, generated in {:.1} s",
        b.memories,
        users,
        b.dim,
        t.elapsed().as_secs_f64()
    ));
    // The initial links: cross-topic cosines are ~0 (far below τ), so each
    // memory's global top-k1 lies in its topic; computed per topic.
    let t = Instant::now();
    for members in &by_topic {
        if members.len() < 2 {
            continue;
        }
        let mut rows = Vec::with_capacity(members.len() * b.dim);
        for &id in members {
            if let Some(m) = state.memory(mid(id)) {
                rows.extend_from_slice(&m.embedding);
            }
        }
        let corpus = Corpus::from_rows(&rows, b.dim).map_err(internal)?;
        let user = |id: u64| (id - 1) as usize % users;
        let exclude = |q: usize, c: usize| user(members[q]) == user(members[c]);
        let hits = kernel
            .top_k(
                &rows,
                &corpus,
                &SearchParams {
                    k: params.k1,
                    min_score: params.link_tau,
                    exclude: Some(&exclude),
                },
            )
            .map_err(internal)?;
        for (q, hs) in hits.into_iter().enumerate() {
            let links = hs
                .into_iter()
                .map(|h| Link {
                    from: mid(members[q]),
                    to: mid(members[h.index as usize]),
                    score: h.score,
                })
                .collect();
            state.restore_links(mid(members[q]), links);
        }
    }
    out.push(format!(
        "initial links (per topic): {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let built = state.rebuild();
    let from_scratch_ms = t.elapsed().as_secs_f64() * 1e3;
    let sizes: Vec<usize> = state.communities().iter().map(|(_, m)| m.len()).collect();
    out.push(format!(
        "communities from scratch: {from_scratch_ms:.0} ms ({} communities, largest {}, {} prototypes published)",
        sizes.len(),
        sizes.iter().max().unwrap_or(&0),
        built.prototypes.len()
    ));

    // Incremental batches.
    let mut next_id = b.memories as u64 + 1;
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..b.batches.max(1) {
        let mut ids = Vec::with_capacity(b.batch);
        for _ in 0..b.batch {
            let topic = synth.rng.random_range(0..topics);
            let user = synth.rng.random_range(0..users);
            let e = synth.memory(topic);
            state
                .restore_memory(mk(next_id, user, topic, e))
                .map_err(internal)?;
            ids.push(mid(next_id));
            next_id += 1;
        }
        let t = Instant::now();
        let o = state.link(&kernel, &ids).map_err(internal)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        last = Some(o);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let incremental_ms = sorted[sorted.len() / 2];
    if let Some(o) = last {
        out.push(format!(
            "incremental batch of {} (relation extraction over {} memories + communities + prototypes): median {incremental_ms:.0} ms of {:?} ms; last batch: {} links, {} merges, {} relabelled, {} prototypes rebuilt",
            b.batch,
            state.len(),
            times.iter().map(|t| t.round() as u64).collect::<Vec<_>>(),
            o.links.len(),
            o.delta.merges,
            o.delta.relabelled,
            o.prototypes.len()
        ));
    }

    // Full recomputation: extraction for every memory (query blocks of
    // `batch`), then communities and prototypes from scratch.
    let n = state.len();
    let blocks = n.div_ceil(b.batch);
    let measured = if b.full_recompute {
        blocks
    } else {
        blocks.min(3)
    };
    let all = (1..=n as u64).map(mid).collect::<Vec<_>>();
    let t = Instant::now();
    for block in all.chunks(b.batch).take(measured) {
        // The same call the incremental path makes, for `batch` memories.
        let _ = state.link_dry_run(&kernel, block).map_err(internal)?;
    }
    let per_block = t.elapsed().as_secs_f64() * 1e3 / measured as f64;
    let extraction_ms = per_block * blocks as f64;
    let t = Instant::now();
    state.rebuild();
    let rebuild_ms = t.elapsed().as_secs_f64() * 1e3;
    let recompute_ms = extraction_ms + rebuild_ms;
    out.push(format!(
        "full recomputation: relation extraction {extraction_ms:.0} ms ({blocks} query blocks of {}, {}) + communities and prototypes from scratch {rebuild_ms:.0} ms",
        b.batch,
        if measured == blocks {
            "all measured".to_owned()
        } else {
            format!("{measured} measured at {per_block:.0} ms each, scaled")
        }
    ));
    out.push(format!(
        "peak memory (VmHWM): {:.2} GiB",
        rss_bytes("VmHWM:") as f64 / (1u64 << 30) as f64
    ));
    out.push(format!(
        "RESULT incremental_ms={incremental_ms:.1} recompute_ms={recompute_ms:.0} ratio={:.1}",
        recompute_ms / incremental_ms
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_interpolate_within_buckets_like_prometheus() {
        let h = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new("t", "t").buckets(vec![0.1, 0.5, 1.0]),
        )
        .unwrap();
        assert!(histogram_quantile(&h, 0.5).is_nan(), "empty");
        // 50 in (0, 0.1], 40 in (0.1, 0.5], 10 in (0.5, 1].
        for (v, n) in [(0.05, 50), (0.3, 40), (0.7, 10)] {
            for _ in 0..n {
                h.observe(v);
            }
        }
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(histogram_quantile(&h, 0.5), 0.1));
        // Rank 70 is half-way through the second bucket.
        assert!(close(histogram_quantile(&h, 0.7), 0.3));
        // Rank 99 is 90% through the third.
        assert!(close(histogram_quantile(&h, 0.99), 0.95));
        h.observe(5.0);
        assert!(
            histogram_quantile(&h, 1.0).is_infinite(),
            "past the last bucket"
        );
    }
}
