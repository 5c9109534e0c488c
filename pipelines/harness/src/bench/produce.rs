//! The ingest benchmark's load: synthetic clicks, purchases and dialogue
//! turns produced to the broker (in a child process, so producing does not
//! share the measured process), and kcat's raw group-consume rate of the
//! same topic, the reference every ingest rate is a ratio of.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::source;

use super::texts::WORDS;

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
pub(super) fn produce_in_child(
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

pub(super) fn produce(
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
