//! `steamrf bench soak`: a real `steamrf serve` process under a fixed request
//! rate for a long time, with the tables changing underneath it.
//!
//! - The tables: `users × rows_per_user` dialogue turns with synthetic
//!   clustered vectors, written into a fresh LanceDB directory through the
//!   pipeline's own sink.
//! - The service: this binary's `serve` on a free loopback port, text
//!   queries off (`query_vector` only: the embedder is measured by `bench
//!   embed`), a refresh every 500 ms.
//! - The writer: `writes_per_s` new turns every second, so the service loads
//!   and swaps snapshots all along (a leak across swaps would show), and a
//!   compaction every minute, as the pipeline's `lancedb.optimize_interval`.
//! - The load: open loop at `rate` requests/s (a request is sent on its tick
//!   whether or not earlier ones were answered; at most 512 outstanding, more
//!   are counted as `client_overflow`). 90% familiar adaptive queries near
//!   the user's topics, 8% forced recollection, 2% malformed (`k = 0`: a 400
//!   is the right answer).
//!
//! Every `sample` it prints the window's latency percentiles and the
//! service's RSS (`/proc/<pid>/status`). The RESULT line: `errors` (transport
//! failures, 5xx, a wrong status for a malformed request; the first five are
//! printed), `shed` (503), overall `p50_ms`/`p99_ms`, the median RSS of the
//! first and of the second half of the samples and the growth between them
//! in percent, the RSS at the end and at its peak.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use steamrf_pipelines::config::LanceDbConfig;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::sink::LanceSink;
use steamrf_schemas::{Provenance, TableBatches, TableBuilders, decode};

use super::{Synth, internal, percentile, proc_status_bytes};

/// Options of `steamrf bench soak`.
#[derive(Debug, Clone)]
pub struct SoakBench {
    /// How long the load runs.
    pub duration: Duration,
    /// Requests per second.
    pub rate: u32,
    /// Users in the tables.
    pub users: usize,
    /// Dialogue turns per user.
    pub rows_per_user: usize,
    /// New turns written per second during the run.
    pub writes_per_s: usize,
    /// Reporting interval.
    pub sample: Duration,
}

const TOPICS: usize = 64;
const MAX_OUTSTANDING: usize = 512;

/// Turns `ids` (user, turn) as `interactions` rows (user `u<user>`, event
/// `soak-u<user>-t<turn>`, sessions of 10 turns) and their `turn_vectors`
/// rows, with vectors from `vector(user, turn)`.
pub(super) fn turns(
    ids: &[(usize, usize)],
    first_offset: i64,
    vector: impl FnMut(usize, usize) -> Vec<f32>,
) -> Result<TableBatches> {
    turns_shaped(ids, first_offset, 10, 0, vector)
}

/// [`turns`] with sessions of `session_turns` turns and each turn's text
/// padded with filler words to about `text_bytes`.
pub(super) fn turns_shaped(
    ids: &[(usize, usize)],
    first_offset: i64,
    session_turns: usize,
    text_bytes: usize,
    mut vector: impl FnMut(usize, usize) -> Vec<f32>,
) -> Result<TableBatches> {
    const FILLER: [&str; 8] = [
        "jazz", "rent", "ferry", "garden", "invoice", "sister", "guitar", "lisbon",
    ];
    let mut builders = TableBuilders::default();
    let mut vectors = Vec::with_capacity(ids.len() * steamrf_schemas::tables::EMBEDDING_DIM);
    for (i, &(u, r)) in ids.iter().enumerate() {
        let t = topic_of(u, r);
        let mut text = format!("user {u} turn {r} on topic {t}");
        let mut w = r;
        while text.len() < text_bytes {
            text.push(' ');
            text.push_str(FILLER[w % FILLER.len()]);
            w = w / 3 + 7 * i;
        }
        let json = format!(
            r#"{{"schema_version":1,"event_id":"soak-u{u}-t{r}","timestamp":{},"type":"dialogue_turn","user_id":"u{u}","session_id":"s{}","role":"user","text":"{text}"}}"#,
            1_764_000_000_000i64 + r as i64,
            r / session_turns.max(1)
        );
        let event = decode(json.as_bytes()).map_err(internal)?;
        builders.append(
            &event,
            Provenance {
                partition: 0,
                offset: first_offset + i as i64,
                ingested_at_ms: 0,
            },
        );
        vectors.extend(vector(u, r));
    }
    let mut out = builders.finish()?;
    let batch = out
        .interactions
        .as_ref()
        .ok_or_else(|| internal("no interactions built"))?;
    let rows: Vec<usize> = (0..batch.num_rows()).collect();
    out.turn_vectors = Some(steamrf_schemas::tables::turn_vectors(
        batch, &rows, &vectors,
    )?);
    Ok(out)
}

/// Writes every table of `batches` through `sink`.
pub(super) async fn write_all(sink: &LanceSink, batches: &TableBatches) -> Result<()> {
    for (t, rows) in batches.iter() {
        sink.write(t, rows).await?;
    }
    Ok(())
}

/// A user's turns spread over three topics.
pub(super) fn topic_of(user: usize, turn: usize) -> usize {
    (user * 7 + turn % 3) % TOPICS
}

/// `VmRSS` of process `pid`, in MiB.
pub(super) fn rss_mib(pid: u32) -> f64 {
    status_mib(pid, "VmRSS:")
}

/// A `/proc/<pid>/status` field (`VmRSS:`, `VmHWM:`) of process `pid`, in MiB.
pub(super) fn status_mib(pid: u32, field: &str) -> f64 {
    proc_status_bytes(&pid.to_string(), field) as f64 / f64::from(1u32 << 20)
}

/// The value of the sample `name` (with its labels, as exposed) on the
/// service's `/metrics`; NaN when absent.
pub(super) async fn metric(client: &reqwest::Client, base: &str, name: &str) -> Result<f64> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .map_err(internal)?
        .text()
        .await
        .map_err(internal)?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN))
}

#[derive(Default)]
struct Counters {
    ok: AtomicU64,
    bad_requests: AtomicU64,
    errors: AtomicU64,
    shed: AtomicU64,
    client_overflow: AtomicU64,
    /// The first errors, described.
    error_samples: std::sync::Mutex<Vec<String>>,
}

/// The `serve` child, killed on drop.
pub(super) struct Child(pub(super) std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        // Already gone is fine: this only makes sure it is.
        if self.0.kill().is_ok() {
            drop(self.0.wait());
        }
    }
}

/// This binary's `serve` (or `$STEAMRF_SERVE_BIN`'s) over `lance` on a free
/// loopback port, with text queries off and `serve_toml` added to its
/// `[serve]` section.
pub(super) fn start_service(
    dir: &Path,
    lance: &LanceDbConfig,
    serve_toml: &str,
) -> Result<(Child, String)> {
    let port = crate::free_port()?;
    let config = dir.join("soak.toml");
    let mut text = format!(
        "[embed]\nengine = \"off\"\n[serve]\nlisten = \"127.0.0.1:{port}\"\n{serve_toml}\n[lancedb]\nuri = {:?}\n[lancedb.storage_options]\n",
        lance.uri
    );
    for (k, v) in &lance.storage_options {
        text.push_str(&format!("{k} = {v:?}\n"));
    }
    let io = |context: &str| {
        let context = context.to_owned();
        move |source| Error::Io { context, source }
    };
    std::fs::write(&config, text).map_err(io("writing the soak config"))?;
    let log = std::fs::File::create(dir.join("serve.log")).map_err(io("creating serve.log"))?;
    // Another build's service can be measured against this one's.
    let exe = match std::env::var_os("STEAMRF_SERVE_BIN") {
        Some(bin) => std::path::PathBuf::from(bin),
        None => std::env::current_exe().map_err(io("locating this binary"))?,
    };
    let child = std::process::Command::new(exe)
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env("STEAMRF_LOG", "warn")
        .stdout(log.try_clone().map_err(io("cloning serve.log"))?)
        .stderr(log)
        .spawn()
        .map_err(io("starting steamrf serve"))?;
    Ok((Child(child), format!("http://127.0.0.1:{port}")))
}

/// A client of the service at `base`, once it is ready (see [`wait_ready`]).
/// Idle connections are dropped after 8 s, before the service's header
/// timeout (10 s) would close them under a request.
pub(super) async fn ready_client(base: &str, dir: &Path) -> Result<reqwest::Client> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_idle_timeout(Duration::from_secs(8))
        .build()
        .map_err(internal)?;
    wait_ready(&client, base, dir).await?;
    Ok(client)
}

/// Waits (5 minutes at most) until the service at `base` is ready; its log
/// is in `dir`/serve.log.
pub(super) async fn wait_ready(client: &reqwest::Client, base: &str, dir: &Path) -> Result<()> {
    let ready_by = Instant::now() + Duration::from_secs(300);
    loop {
        let ready = client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok(());
        }
        if Instant::now() > ready_by {
            let log = std::fs::read_to_string(dir.join("serve.log")).unwrap_or_default();
            return Err(internal(format!(
                "steamrf serve never became ready:\n{log}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs the soak; prints a line per `sample` as it goes and returns the
/// `RESULT` line.
pub async fn soak(b: SoakBench) -> Result<Vec<String>> {
    if b.rate == 0 || b.users == 0 || b.rows_per_user == 0 {
        return Err(internal("--rate, --users and --rows-per-user must be > 0"));
    }
    let dir = super::temp_dir()?;
    let uri = dir.path().join("lancedb").display().to_string();
    let lance = LanceDbConfig {
        uri: uri.clone(),
        ..steamrf_pipelines::config::Config::load(None)?.lancedb
    };
    let sink = LanceSink::open(&lance, Metrics::new(&[])).await?;
    let mut synth = Synth::new(TOPICS, steamrf_schemas::tables::EMBEDDING_DIM);
    let started = Instant::now();
    let ids: Vec<(usize, usize)> = (0..b.users)
        .flat_map(|u| (0..b.rows_per_user).map(move |r| (u, r)))
        .collect();
    let mut offset = 0i64;
    for chunk in ids.chunks(50_000) {
        let batch = turns(chunk, offset, |u, r| synth.memory(topic_of(u, r)))?;
        write_all(&sink, &batch).await?;
        offset += chunk.len() as i64;
    }
    // Progress goes straight to stdout; the returned lines are the summary.
    println!(
        "tables: {} users x {} turns written in {:.1}s",
        b.users,
        b.rows_per_user,
        started.elapsed().as_secs_f64()
    );

    let (child, base) = start_service(
        dir.path(),
        &lance,
        "kinds = [\"dialogue\"]\ncollaborative = false",
    )?;
    let pid = child.0.id();
    // Idle connections are dropped before the service's header timeout
    // (10 s) closes them, as a client of any keep-alive server should: with
    // reqwest's default (90 s) a request now and then races the server's
    // close and fails ("connection closed before message completed"; one in
    // 120,000 in a 10-minute run).
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_idle_timeout(Duration::from_secs(8))
        .pool_max_idle_per_host(MAX_OUTSTANDING)
        .build()
        .map_err(internal)?;
    wait_ready(&client, &base, dir.path()).await?;
    let load_started = Instant::now();
    println!(
        "service ready after {:.1}s, RSS {:.0} MiB; {} req/s for {:?}",
        started.elapsed().as_secs_f64(),
        rss_mib(pid),
        b.rate,
        b.duration
    );

    // The writer: new turns every second, so snapshots keep being swapped.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, sink) = (stop.clone(), sink.clone());
        let (users, first_turn, per_s) = (b.users, b.rows_per_user, b.writes_per_s);
        let mut synth = Synth::new(TOPICS, steamrf_schemas::tables::EMBEDDING_DIM);
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(3);
            let mut next = vec![first_turn; users];
            let mut offset = offset;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            let mut seconds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                seconds += 1;
                // Compaction and pruning, as the pipeline does
                // (`lancedb.optimize_interval`, here every minute).
                if seconds.is_multiple_of(60) {
                    sink.optimize().await?;
                }
                if per_s == 0 {
                    continue;
                }
                let ids: Vec<(usize, usize)> = (0..per_s)
                    .map(|_| {
                        let u = rng.random_range(0..users);
                        next[u] += 1;
                        (u, next[u])
                    })
                    .collect();
                let batch = turns(&ids, offset, |u, r| synth.memory(topic_of(u, r)))?;
                offset += ids.len() as i64;
                write_all(&sink, &batch).await?;
            }
            Ok::<(), Error>(())
        })
    };

    let counters = Arc::new(Counters::default());
    let latencies: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
    let outstanding = Arc::new(tokio::sync::Semaphore::new(MAX_OUTSTANDING));
    let mut all: Vec<f64> = Vec::new();
    let mut rss = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(b.rate)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut next_sample = load_started + b.sample;
    let mut sent = 0u64;
    while load_started.elapsed() < b.duration {
        tick.tick().await;
        let Ok(permit) = outstanding.clone().try_acquire_owned() else {
            counters.client_overflow.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        let u = rng.random_range(0..b.users);
        let roll = rng.random_range(0..100);
        let mut q = synth.memory(topic_of(u, rng.random_range(0..3)));
        if roll >= 90 {
            // Far from everything: recollection's own ground.
            q = synth.memory(rng.random_range(0..TOPICS));
        }
        let (body, malformed) = match roll {
            0..90 => (
                serde_json::json!({"user_id": format!("u{u}"), "query_vector": q}),
                false,
            ),
            90..98 => (
                serde_json::json!({"user_id": format!("u{u}"), "query_vector": q,
                                   "options": {"mode": "recollection"}}),
                false,
            ),
            _ => (
                serde_json::json!({"user_id": format!("u{u}"), "query_vector": q, "k": 0}),
                true,
            ),
        };
        sent += 1;
        let (client, url, counts, times) = (
            client.clone(),
            format!("{base}/v1/retrieve"),
            counters.clone(),
            latencies.clone(),
        );
        tokio::spawn(async move {
            let _permit = permit;
            let t = Instant::now();
            let resp = client
                .post(url)
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await;
            let (status, failure) = match resp {
                Ok(r) => {
                    let s = r.status().as_u16();
                    // Read the body: an answer is only done when it arrived.
                    match r.bytes().await {
                        Ok(b) => (
                            s,
                            String::from_utf8_lossy(&b[..b.len().min(200)]).into_owned(),
                        ),
                        Err(e) => (0, format!("reading the body: {e}")),
                    }
                }
                Err(e) => (0, format!("{e:?}")),
            };
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let c: &AtomicU64 = match (status, malformed) {
                (200, false) => &counts.ok,
                (400, true) => &counts.bad_requests,
                (503, _) => &counts.shed,
                _ => {
                    let mut samples = counts
                        .error_samples
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    if samples.len() < 5 {
                        samples.push(format!("status {status} after {ms:.1} ms: {failure}"));
                    }
                    &counts.errors
                }
            };
            c.fetch_add(1, Ordering::Relaxed);
            if status == 200 {
                times
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(ms);
            }
        });
        if Instant::now() >= next_sample {
            next_sample += b.sample;
            let mut window = std::mem::take(
                &mut *latencies
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            window.sort_by(f64::total_cmp);
            let mib = rss_mib(pid);
            rss.push((load_started.elapsed(), mib));
            let line = format!(
                "t={:>5.0}s sent={sent} ok={} errors={} shed={} overflow={} p50={:.2}ms p99={:.2}ms rss={mib:.0}MiB",
                load_started.elapsed().as_secs_f64(),
                counters.ok.load(Ordering::Relaxed),
                counters.errors.load(Ordering::Relaxed),
                counters.shed.load(Ordering::Relaxed),
                counters.client_overflow.load(Ordering::Relaxed),
                percentile(&window, 0.5),
                percentile(&window, 0.99),
            );
            println!("{line}");
            all.extend(window);
        }
    }
    let elapsed = load_started.elapsed();
    // Let the outstanding requests finish.
    let _drained = tokio::time::timeout(
        Duration::from_secs(30),
        outstanding.acquire_many(MAX_OUTSTANDING as u32),
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    writer
        .await
        .map_err(|e| internal(format!("the writer task failed: {e}")))??;
    all.extend(std::mem::take(
        &mut *latencies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    ));
    all.sort_by(f64::total_cmp);
    let end_mib = rss_mib(pid);
    rss.push((elapsed, end_mib));
    let loads = metric(
        &client,
        &base,
        "steamrf_serve_snapshot_loads_total{result=\"ok\"}",
    )
    .await?;
    // RSS swings by a snapshot or two between samples (a refresh builds the
    // next while the current one serves), so growth is judged on medians:
    // the first half of the samples against the second.
    let median = |s: &[(Duration, f64)]| {
        let mut v: Vec<f64> = s.iter().map(|&(_, m)| m).collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 0.5)
    };
    let (first, second) = rss.split_at(rss.len() / 2);
    let (first_mib, second_mib) = (median(first), median(second));
    let max_mib = rss.iter().map(|&(_, m)| m).fold(0.0, f64::max);
    for e in counters
        .error_samples
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
    {
        println!("error: {e}");
    }
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let line = format!(
        "RESULT seconds={:.0} rate={} requests={sent} ok={} bad_requests={} errors={} shed={} client_overflow={} p50_ms={:.2} p99_ms={:.2} snapshots={loads} rss_first_half_mib={first_mib:.0} rss_second_half_mib={second_mib:.0} rss_end_mib={end_mib:.0} rss_max_mib={max_mib:.0} rss_growth_pct={:.1} rows={}",
        elapsed.as_secs_f64(),
        b.rate,
        c(&counters.ok),
        c(&counters.bad_requests),
        c(&counters.errors),
        c(&counters.shed),
        c(&counters.client_overflow),
        percentile(&all, 0.5),
        percentile(&all, 0.99),
        (second_mib - first_mib) / first_mib * 100.0,
        b.users * b.rows_per_user,
    );
    drop(child);
    Ok(vec![line])
}
