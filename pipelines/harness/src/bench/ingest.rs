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

use steamrf_pipelines::config::Config;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::pipeline::{self, RunOptions};
use steamrf_pipelines::{source, sql};

use super::embedding::turn_rates;
use super::produce::produce_in_child;
use super::{reset_peak_rss, rss_bytes, temp_dir};

/// Events per second, two ways.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rates {
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
pub(super) struct Cpu {
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
    /// the produce → durable latency (`bench/latency.rs`); 0: produce the
    /// backlog first and measure throughput against kcat.
    pub rate: u64,
}

/// The topic the benchmark produces to (created here) and the number of
/// distinct users of its events, after checking the options.
///
/// # Errors
/// Invalid options, or the broker failing to create the topic.
pub(super) async fn prepare(b: &IngestBench) -> Result<(String, u64)> {
    let stamp = chrono::Utc::now().format("%Y%m%d%H%M%S%3f");
    let topic = format!("steamrf-bench-{stamp}");
    if !(0.0..=1.0).contains(&b.turns_share) {
        return Err(Error::Config {
            problems: vec![format!(
                "--turns-share: must be in [0, 1], got {}",
                b.turns_share
            )],
        });
    }
    source::ensure_topic(&b.brokers, &Default::default(), &topic, b.partitions, &[]).await?;
    let distinct = if b.distinct == 0 {
        b.events
    } else {
        b.distinct.min(b.events)
    };
    Ok((topic, distinct))
}

/// The throughput run: the backlog produced first (in a child process, so
/// that the producer's buffers, the whole backlog until delivered, are not
/// counted in this process's memory), then kcat's consume rate and
/// steamrf's ingest rate of it.
///
/// # Errors
/// Broker, kcat or pipeline failures.
pub(super) async fn throughput(
    b: IngestBench,
    topic: String,
    distinct: u64,
) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let n = b.events;
    let turns_share = b.turns_share;
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

    let dir = temp_dir()?;
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
pub(super) fn bench_config(b: &IngestBench, topic: &str, dir: &std::path::Path) -> Config {
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
pub(super) fn commits(metrics: &Metrics) -> u64 {
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

/// kcat's group-consume rate: records per second between the first and the
/// last record it prints.
pub(super) fn kcat_rate(kcat: &PathBuf, brokers: &str, topic: &str, n: u64) -> Result<Rates> {
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
