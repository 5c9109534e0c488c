//! `steamrf bench serve`: a real `steamrf serve` over many users, to show
//! that a replica's memory is bounded by `serve.cache_bytes` and not by the
//! user base, and what a user costs when it is and is not cached.
//!
//! - The tables: `users × rows_per_user` dialogue turns (384-d vectors
//!   around a few topics per user), appended to a fresh LanceDB directory
//!   in batches of 50,000 rows (a fragment each, as a pipeline's commits
//!   leave them between compactions), then the `interactions` BTree indexes
//!   as the sink builds them.
//! - The service: this binary's `serve` on a loopback port with the
//!   default configuration (`serve.cache_bytes` from `--cache-bytes`),
//!   text queries off (`query_vector`: the embedder is `bench embed`'s).
//! - Cold: one request each for `cold_users` users never asked for
//!   before, one at a time (the cache churns: they do not all fit).
//! - Hot: `hot_users` users asked for once, then `requests` requests over
//!   them, one at a time.
//! - Freshness: `fresh` times, a new turn for a random hot user is written
//!   through the pipeline's sink (`merge_insert`, as ingest writes), and the
//!   user is asked with that turn's vector every 10 ms until it is answered:
//!   commit → answerable. Produce → commit is ingest's (`bench ingest`).
//! - Memory: the service's RSS (`VmRSS`) after each phase and its peak
//!   (`VmHWM`), beside the budget `cache_bytes + 300 MiB`.

use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use steamrf_pipelines::config::LanceDbConfig;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::sink::{self, LanceSink};
use steamrf_schemas::TableName;
use steamrf_schemas::tables::EMBEDDING_DIM;

use super::soak::{
    Child, metric, ready_client, rss_mib, start_service, status_mib, topic_of as topic, turns,
};
use super::{internal, percentile};

/// Options of `steamrf bench serve`.
#[derive(Debug, Clone)]
pub struct ServeBench {
    /// Users in the tables.
    pub users: usize,
    /// Dialogue turns per user.
    pub rows_per_user: usize,
    /// `serve.cache_bytes`.
    pub cache_bytes: usize,
    /// Users asked for once each (cold).
    pub cold_users: usize,
    /// Users in the hot set.
    pub hot_users: usize,
    /// Requests over the hot set.
    pub requests: usize,
    /// Freshness probes.
    pub fresh: usize,
    /// Where the tables go (default: a temp directory); an `s3://` URI
    /// measures reads through an object store.
    pub uri: Option<String>,
    /// `[lancedb.storage_options]` for `uri`.
    pub storage_options: Vec<(String, String)>,
}

const TOPICS: usize = 64;
const BATCH: usize = 50_000;

/// Topic centres and cheap noise: a 10M-row table's vectors in seconds.
struct Vectors {
    centres: Vec<Vec<f32>>,
    rng: rand::rngs::SmallRng,
}

impl Vectors {
    fn new(seed: u64) -> Self {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let centres = (0..TOPICS)
            .map(|_| {
                unit(
                    (0..EMBEDDING_DIM)
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect(),
                )
            })
            .collect();
        Self { centres, rng }
    }

    fn around(&mut self, topic: usize) -> Vec<f32> {
        let c = &self.centres[topic % TOPICS];
        unit(
            c.iter()
                .map(|x| x + self.rng.random_range(-0.08f32..0.08))
                .collect(),
        )
    }

    /// A direction no topic is near.
    fn fresh(&mut self) -> Vec<f32> {
        unit(
            (0..EMBEDDING_DIM)
                .map(|_| self.rng.random_range(-1.0f32..1.0))
                .collect(),
        )
    }
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    steamrf_operators::embed::normalize(&mut v);
    v
}

/// One request; its latency in ms and the ids it answered.
async fn ask(
    client: &reqwest::Client,
    base: &str,
    user: usize,
    q: &[f32],
) -> Result<(f64, Vec<String>)> {
    let body = serde_json::json!({"user_id": format!("u{user}"), "query_vector": q});
    let t = Instant::now();
    let r = client
        .post(format!("{base}/v1/retrieve"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .map_err(internal)?;
    let status = r.status();
    let text = r.text().await.map_err(internal)?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    if !status.is_success() {
        return Err(internal(format!("u{user}: {status} {text}")));
    }
    let v: serde_json::Value = serde_json::from_str(&text).map_err(internal)?;
    // The rows' ids and the events behind them: in the passage view a turn
    // is answered as part of its session.
    let ids = v["items"]
        .as_array()
        .map(|a| {
            a.iter()
                .flat_map(|i| {
                    let sources = i["provenance"]["source_event_ids"].as_array();
                    std::iter::once(&i["id"]).chain(sources.into_iter().flatten())
                })
                .filter_map(|id| id.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    Ok((ms, ids))
}

/// The p50 and p99 of `ms`.
fn p50_p99(ms: &mut [f64]) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    (percentile(ms, 0.5), percentile(ms, 0.99))
}

async fn write_tables(b: &ServeBench, sink: &LanceSink) -> Result<()> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(2);
    let (users, per_user) = (b.users, b.rows_per_user);
    // Batches are built on a blocking thread while the previous one is written.
    let producer = tokio::task::spawn_blocking(move || {
        let mut vectors = Vectors::new(7);
        let ids: Vec<(usize, usize)> = (0..users)
            .flat_map(|u| (0..per_user).map(move |r| (u, r)))
            .collect();
        for (i, chunk) in ids.chunks(BATCH).enumerate() {
            let batch = turns(chunk, (i * BATCH) as i64, |u, r| {
                vectors.around(topic(u, r))
            })?;
            if tx.blocking_send(batch).is_err() {
                break;
            }
        }
        Ok::<(), Error>(())
    });
    let started = Instant::now();
    let mut rows = 0usize;
    while let Some(batches) = rx.recv().await {
        // Plain appends: the rows are new, no idempotency check needed.
        for (name, batch) in batches.iter() {
            super::add(sink.table(name), batch.clone())
                .await
                .map_err(Error::lance(format!("appending {}", name.as_str())))?;
        }
        rows += batches.interactions.as_ref().map_or(0, |b| b.num_rows());
        if rows.is_multiple_of(BATCH * 20) {
            println!(
                "tables: {rows} rows in {:.0}s",
                started.elapsed().as_secs_f64()
            );
        }
    }
    producer
        .await
        .map_err(|e| internal(format!("building turns panicked: {e}")))??;
    let t = Instant::now();
    for name in [TableName::Interactions, TableName::TurnVectors] {
        sink::ensure_btree(sink.table(name), sink::indexed_columns(name)).await?;
    }
    println!(
        "tables: {rows} rows written in {:.0}s, indexed in {:.0}s",
        started.elapsed().as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs the benchmark; returns its summary lines, the last one `RESULT`.
///
/// # Errors
/// LanceDB or service failures, and any request that fails.
pub async fn serve(b: ServeBench) -> Result<Vec<String>> {
    if b.users == 0 || b.rows_per_user == 0 || b.hot_users == 0 {
        return Err(internal(
            "--users, --rows-per-user and --hot-users must be > 0",
        ));
    }
    if b.hot_users + b.cold_users > b.users {
        return Err(internal(
            "--hot-users + --cold-users must not exceed --users",
        ));
    }
    let dir = super::temp_dir()?;
    let uri = match &b.uri {
        Some(u) => u.clone(),
        None => dir.path().join("lancedb").display().to_string(),
    };
    let lance = LanceDbConfig {
        uri,
        storage_options: b.storage_options.iter().cloned().collect(),
        ..steamrf_pipelines::config::Config::load(None)?.lancedb
    };
    let sink = LanceSink::open(&lance, Metrics::new(&[])).await?;
    write_tables(&b, &sink).await?;

    let (child, base): (Child, String) = start_service(
        dir.path(),
        &lance,
        &format!("cache_bytes = \"{}\"", b.cache_bytes),
    )?;
    let pid = child.0.id();
    let client = ready_client(&base, dir.path()).await?;
    let rss_ready = rss_mib(pid);
    println!("service ready, RSS {rss_ready:.0} MiB");

    // Users: a shuffled order, the hot set first, then the cold ones.
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut order: Vec<usize> = (0..b.users).collect();
    for i in 0..order.len() {
        let j = rng.random_range(i..order.len());
        order.swap(i, j);
    }
    let hot = &order[..b.hot_users];
    let cold = &order[b.hot_users..b.hot_users + b.cold_users];
    let mut vectors = Vectors::new(9);

    // Cold: each user once (the cache fills, then churns).
    let mut cold_ms = Vec::with_capacity(cold.len());
    for &u in cold {
        let q = vectors.around(topic(u, rng.random_range(0..3)));
        cold_ms.push(ask(&client, &base, u, &q).await?.0);
    }
    let rss_cold = rss_mib(pid);
    println!("cold: {} users, RSS {rss_cold:.0} MiB", cold.len());

    // Hot: warm the set, then ask over it.
    for &u in hot {
        ask(&client, &base, u, &vectors.around(topic(u, 0))).await?;
    }
    let mut hot_ms = Vec::with_capacity(b.requests);
    for _ in 0..b.requests {
        let u = hot[rng.random_range(0..hot.len())];
        let q = vectors.around(topic(u, rng.random_range(0..3)));
        hot_ms.push(ask(&client, &base, u, &q).await?.0);
    }
    let rss_hot = rss_mib(pid);
    println!(
        "hot: {} requests over {} users, RSS {rss_hot:.0} MiB",
        b.requests,
        hot.len()
    );

    // Freshness: commit → answerable.
    let mut fresh_ms = Vec::with_capacity(b.fresh);
    let first_offset = (b.users * b.rows_per_user) as i64;
    for i in 0..b.fresh {
        let offset = first_offset + i as i64;
        let u = hot[rng.random_range(0..hot.len())];
        let turn = b.rows_per_user + 1_000_000 + i;
        let v = vectors.fresh();
        let batch = turns(&[(u, turn)], offset, |_, _| v.clone())?;
        let want = format!("soak-u{u}-t{turn}");
        super::soak::write_all(&sink, &batch).await?;
        let committed = Instant::now();
        loop {
            let (_, ids) = ask(&client, &base, u, &v).await?;
            if ids.contains(&want) {
                break;
            }
            if committed.elapsed() > Duration::from_secs(30) {
                return Err(internal(format!(
                    "{want} not answerable 30 s after its commit"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        fresh_ms.push(committed.elapsed().as_secs_f64() * 1e3);
        // Spread the probes over refreshes.
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..500))).await;
    }
    let rss_end = rss_mib(pid);
    let rss_peak = status_mib(pid, "VmHWM:");
    let cache_mib =
        metric(&client, &base, "steamrf_serve_cache_bytes").await? / f64::from(1u32 << 20);
    let evicted = metric(
        &client,
        &base,
        "steamrf_serve_cache_evictions_total{reason=\"capacity\"}",
    )
    .await?;
    drop(child);

    let budget_mib = b.cache_bytes as f64 / f64::from(1u32 << 20) + 300.0;
    let mut out = vec![
        format!(
            "{} users x {} turns ({} rows); serve.cache_bytes {:.0} MiB, RSS budget {budget_mib:.0} MiB",
            b.users,
            b.rows_per_user,
            b.users * b.rows_per_user,
            b.cache_bytes as f64 / f64::from(1u32 << 20)
        ),
        format!(
            "RSS: ready {rss_ready:.0}, after cold {rss_cold:.0}, after hot {rss_hot:.0}, end {rss_end:.0}, peak {rss_peak:.0} MiB; cache {cache_mib:.0} MiB held, {evicted} evicted for room"
        ),
    ];
    let (cold_p50, cold_p99) = p50_p99(&mut cold_ms);
    let (hot_p50, hot_p99) = p50_p99(&mut hot_ms);
    let (fresh_p50, fresh_p99) = p50_p99(&mut fresh_ms);
    out.push(format!(
        "RESULT store={} users={} rows_per_user={} cache_mib={:.0} hot_p50_ms={hot_p50:.2} hot_p99_ms={hot_p99:.2} cold_p50_ms={cold_p50:.2} cold_p99_ms={cold_p99:.2} fresh_p50_ms={fresh_p50:.0} fresh_p99_ms={fresh_p99:.0} rss_mib={rss_end:.0} rss_peak_mib={rss_peak:.0} rss_budget_mib={budget_mib:.0} cache_held_mib={cache_mib:.1} evicted={evicted} cold_users={} hot_users={} requests={} fresh={}",
        if lance.uri.starts_with("s3://") { "s3" } else { "local" },
        b.users,
        b.rows_per_user,
        b.cache_bytes as f64 / f64::from(1u32 << 20),
        b.cold_users,
        b.hot_users,
        b.requests,
        b.fresh,
    ));
    Ok(out)
}
