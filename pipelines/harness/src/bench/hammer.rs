//! `steamrf bench hammer`: one user with a huge history, asked for by many
//! clients at once while the other users keep asking (issue 44, item 3: no
//! single user stalls or exhausts a replica).
//!
//! - The tables: user `u0` with `big_rows` dialogue turns of about
//!   `turn_bytes` each in sessions of `session_turns`, and `users` other
//!   users with `rows_per_user` turns, appended through LanceDB with the
//!   sink's BTree indexes, as `bench serve` writes them.
//! - The service: this binary's `serve` with the default configuration
//!   (`serve.cache_bytes` from `--cache-bytes`), text queries off.
//! - Baseline: `requests` requests over the other users, one at a time,
//!   with nobody hammering.
//! - Hammer, for `duration`: `clients` loops ask for `u0` back to back; one
//!   loop asks the other users one at a time (their latency is the number
//!   that matters); `/healthz` is asked every 100 ms; every `write_every` a
//!   new turn of `u0` is written through the pipeline's sink, so each
//!   refresh evicts `u0` and the next request reads and builds it again.
//!   The service's RSS is sampled every 200 ms. With `busy_threads`, that
//!   many threads spin in the benchmark's process meanwhile (CPU load).
//!
//! The RESULT line: the other users' p50/p99 under the hammer and their
//! p99 alone (`p99_ratio` between them), their errors (any non-200), `u0`'s
//! answers by status, the slowest `/healthz`, the largest answer body, the
//! user reads the service made (`user_reads`: misses that read the tables;
//! `joined`: misses that waited on a read already running) beside the turns
//! written to `u0` (`big_writes`: each evicts it once), and the peak RSS
//! beside its budget (`serve.cache_bytes` + 300 MiB).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use steamrf_pipelines::config::LanceDbConfig;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::sink::{self, LanceSink};
use steamrf_schemas::TableName;

use super::soak::{Child, metric, ready_client, start_service, status_mib, topic_of, turns_shaped};
use super::{Synth, internal, percentile};

/// Options of `steamrf bench hammer`.
#[derive(Debug, Clone)]
pub struct HammerBench {
    /// Turns of the hammered user.
    pub big_rows: usize,
    /// Bytes of each of its turns' text, about.
    pub turn_bytes: usize,
    /// Turns per session of the hammered user.
    pub session_turns: usize,
    /// Other users.
    pub users: usize,
    /// Turns per other user.
    pub rows_per_user: usize,
    /// Concurrent clients asking for the hammered user.
    pub clients: usize,
    /// How long the hammer runs.
    pub duration: Duration,
    /// A new turn of the hammered user this often (zero: none).
    pub write_every: Duration,
    /// Requests of the baseline.
    pub requests: usize,
    /// `serve.cache_bytes`.
    pub cache_bytes: usize,
    /// Threads that spin in this process while the hammer runs: CPU load
    /// on the replica's machine, which slows its fills so that more of them
    /// overlap (RSS went past its budget only under load).
    pub busy_threads: usize,
}

const TOPICS: usize = 64;
const BATCH: usize = 20_000;

/// One request's latency in ms, status and body length.
async fn ask(client: &reqwest::Client, base: &str, user: usize, q: &[f32]) -> (f64, u16, usize) {
    let body = serde_json::json!({"user_id": format!("u{user}"), "query_vector": q, "k": 10});
    let t = Instant::now();
    let sent = client
        .post(format!("{base}/v1/retrieve"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    let (status, len) = match sent {
        Ok(r) => {
            let status = r.status().as_u16();
            (status, r.bytes().await.map_or(0, |b| b.len()))
        }
        Err(_) => (0, 0),
    };
    (t.elapsed().as_secs_f64() * 1e3, status, len)
}

async fn write_tables(b: &HammerBench, sink: &LanceSink) -> Result<i64> {
    let mut synth = Synth::new(TOPICS, steamrf_schemas::tables::EMBEDDING_DIM);
    let big: Vec<(usize, usize)> = (0..b.big_rows).map(|r| (0, r)).collect();
    let small: Vec<(usize, usize)> = (1..=b.users)
        .flat_map(|u| (0..b.rows_per_user).map(move |r| (u, r)))
        .collect();
    let started = Instant::now();
    let mut offset = 0i64;
    for (ids, session, bytes) in [(&big, b.session_turns, b.turn_bytes), (&small, 10, 0)] {
        for chunk in ids.chunks(BATCH) {
            let batches = turns_shaped(chunk, offset, session, bytes, |u, r| {
                synth.memory(topic_of(u, r))
            })?;
            for (name, batch) in batches.iter() {
                super::add(sink.table(name), batch.clone())
                    .await
                    .map_err(Error::lance(format!("appending {}", name.as_str())))?;
            }
            offset += chunk.len() as i64;
        }
    }
    for name in [TableName::Interactions, TableName::TurnVectors] {
        sink::ensure_btree(sink.table(name), sink::indexed_columns(name)).await?;
    }
    println!(
        "tables: u0 with {} turns of ~{} bytes, {} users x {} turns, written in {:.0}s",
        b.big_rows,
        b.turn_bytes,
        b.users,
        b.rows_per_user,
        started.elapsed().as_secs_f64()
    );
    Ok(offset)
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    shed: AtomicU64,
    errors: AtomicU64,
    max_bytes: AtomicU64,
}

impl Tally {
    fn count(&self, status: u16, bytes: usize) {
        match status {
            200 => &self.ok,
            503 => &self.shed,
            _ => &self.errors,
        }
        .fetch_add(1, Ordering::Relaxed);
        self.max_bytes.fetch_max(bytes as u64, Ordering::Relaxed);
    }
}

/// Runs the benchmark; returns its summary lines, the last one `RESULT`.
///
/// # Errors
/// LanceDB or service failures.
pub async fn hammer(b: HammerBench) -> Result<Vec<String>> {
    if b.big_rows == 0 || b.users == 0 || b.rows_per_user == 0 || b.clients == 0 {
        return Err(internal(
            "--big-rows, --users, --rows-per-user and --clients must be > 0",
        ));
    }
    let dir = super::temp_dir()?;
    let lance = LanceDbConfig {
        uri: dir.path().join("lancedb").display().to_string(),
        ..steamrf_pipelines::config::Config::load(None)?.lancedb
    };
    let sink = LanceSink::open(&lance, Metrics::new(&[])).await?;
    let mut offset = write_tables(&b, &sink).await?;
    let (child, base): (Child, String) = start_service(
        dir.path(),
        &lance,
        &format!(
            "cache_bytes = \"{}\"\nrefresh_interval = \"500ms\"",
            b.cache_bytes
        ),
    )?;
    let pid = child.0.id();
    let client = ready_client(&base, dir.path()).await?;
    let mut synth = Synth::new(TOPICS, steamrf_schemas::tables::EMBEDDING_DIM);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);

    // Baseline: the other users, nobody hammering (each asked once first,
    // so both phases measure cached users).
    for u in 1..=b.users {
        ask(&client, &base, u, &synth.memory(topic_of(u, 0))).await;
    }
    let mut alone = Vec::with_capacity(b.requests);
    for _ in 0..b.requests {
        let u = rng.random_range(1..=b.users);
        let (ms, _, _) = ask(&client, &base, u, &synth.memory(topic_of(u, 1))).await;
        alone.push(ms);
    }
    let rss_before = status_mib(pid, "VmRSS:");
    println!("baseline: {} requests, RSS {rss_before:.0} MiB", b.requests);

    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..b.busy_threads)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005) + 1);
                    }
                }
            })
        })
        .collect();
    let big = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for c in 0..b.clients {
        let (client, base, stop, big) = (client.clone(), base.clone(), stop.clone(), big.clone());
        let q = synth.memory(topic_of(0, c));
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (_, status, bytes) = ask(&client, &base, 0, &q).await;
                big.count(status, bytes);
                if status == 503 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }));
    }
    let writer = {
        let (sink, stop, every) = (sink.clone(), stop.clone(), b.write_every);
        let mut synth = Synth::new(TOPICS, steamrf_schemas::tables::EMBEDDING_DIM);
        let (first, bytes) = (b.big_rows, b.turn_bytes);
        tokio::spawn(async move {
            let mut n = 0;
            while !every.is_zero() && !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(every).await;
                let batch = turns_shaped(&[(0, first + n)], offset, 10, bytes, |u, r| {
                    synth.memory(topic_of(u, r))
                })?;
                super::soak::write_all(&sink, &batch).await?;
                (n, offset) = (n + 1, offset + 1);
            }
            Ok::<usize, Error>(n)
        })
    };
    let health = {
        let (client, base, stop) = (client.clone(), base.clone(), stop.clone());
        tokio::spawn(async move {
            let mut worst = 0f64;
            let mut failed = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let ok = client
                    .get(format!("{base}/healthz"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                worst = worst.max(t.elapsed().as_secs_f64() * 1e3);
                failed += u64::from(!ok);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (worst, failed)
        })
    };
    let rss = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut peak = 0f64;
            while !stop.load(Ordering::Relaxed) {
                peak = peak.max(status_mib(pid, "VmRSS:"));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            peak
        })
    };
    // The other users, one request at a time, for the whole run.
    let others = Tally::default();
    let mut hammered = Vec::new();
    let until = Instant::now() + b.duration;
    while Instant::now() < until {
        let u = rng.random_range(1..=b.users);
        let (ms, status, bytes) = ask(&client, &base, u, &synth.memory(topic_of(u, 1))).await;
        others.count(status, bytes);
        hammered.push(ms);
    }
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().map_err(|_| internal("a busy thread panicked"))?;
    }
    for t in tasks {
        t.await.map_err(internal)?;
    }
    let written = writer.await.map_err(internal)??;
    let (healthz_max_ms, healthz_failed) = health.await.map_err(internal)?;
    let rss_peak = rss.await.map_err(internal)?.max(status_mib(pid, "VmRSS:"));
    let reads = metric(
        &client,
        &base,
        "steamrf_serve_cache_lookups_total{kind=\"user\",result=\"miss\"}",
    )
    .await?;
    let joined = metric(
        &client,
        &base,
        "steamrf_serve_cache_lookups_total{kind=\"user\",result=\"joined\"}",
    )
    .await?;
    drop(child);

    alone.sort_by(f64::total_cmp);
    hammered.sort_by(f64::total_cmp);
    let baseline_p99 = percentile(&alone, 0.99);
    let (p50, p99) = (percentile(&hammered, 0.5), percentile(&hammered, 0.99));
    let budget = b.cache_bytes as f64 / f64::from(1u32 << 20) + 300.0;
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Ok(vec![
        format!(
            "u0: {} turns of ~{} bytes in sessions of {}; {} clients for {:?}, a new u0 turn every {:?} ({written} written); {} busy threads",
            b.big_rows,
            b.turn_bytes,
            b.session_turns,
            b.clients,
            b.duration,
            b.write_every,
            b.busy_threads
        ),
        format!(
            "others: {} requests, p50 {p50:.1} ms, p99 {p99:.1} ms (alone: p99 {baseline_p99:.1} ms); u0: {} ok, {} shed, {} errors; user reads {reads}, joined {joined}",
            hammered.len(),
            n(&big.ok),
            n(&big.shed),
            n(&big.errors)
        ),
        format!(
            "RESULT big_rows={} clients={} big_writes={written} other_requests={} other_p50_ms={p50:.1} other_p99_ms={p99:.1} baseline_p99_ms={baseline_p99:.1} p99_ratio={:.2} other_errors={} big_ok={} big_shed={} big_errors={} healthz_max_ms={healthz_max_ms:.0} healthz_failed={healthz_failed} answer_bytes_max={} user_reads={reads} joined={joined} rss_peak_mib={rss_peak:.0} rss_budget_mib={budget:.0}",
            b.big_rows,
            b.clients,
            hammered.len(),
            p99 / baseline_p99.max(1e-9),
            n(&others.errors) + n(&others.shed),
            n(&big.ok),
            n(&big.shed),
            n(&big.errors),
            n(&big.max_bytes).max(n(&others.max_bytes)),
        ),
    ])
}
