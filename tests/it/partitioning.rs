//! steamrf's producers partition as the Java client does (docs/events.md).

use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::*;

/// Kafka's `Utils.murmur2` (the Java client's default partitioner), written
/// from its definition: seed 0x9747b28c, m 0x5bd1e995, r 24.
fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, b) in tail.iter().enumerate().rev() {
            h ^= u32::from(*b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// `Utils.toPositive(Utils.murmur2(key)) % partitions`.
fn java_partition(key: &str, partitions: u32) -> u32 {
    (murmur2(key.as_bytes()) & 0x7fff_ffff) as u32 % partitions
}

#[test]
fn the_reference_murmur2_matches_kafkas_test_vectors() {
    // From Kafka's UtilsTest.testMurmur2.
    for (key, want) in [
        ("21", -973_932_308),
        ("foobar", -790_332_482),
        ("a-little-bit-long-string", -985_981_536),
        ("a-little-bit-longer-string", -1_486_304_829),
        (
            "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58_897_971,
        ),
        ("abc", 479_470_107),
    ] {
        assert_eq!(murmur2(key.as_bytes()), want, "{key}");
    }
}

/// Events `POST /v1/events` produces land on the partition the Java
/// client's partitioner picks for their key, so a forget sent through
/// steamrf stays behind the user's earlier events from a Java producer.
/// Under 6e978f1 (librdkafka's CRC32 default) most keys landed elsewhere.
#[test]
fn posted_events_land_where_a_java_producer_puts_their_key() {
    const PARTITIONS: u32 = 6;
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-partitioner");
    seed_topic(dir.path(), &topic, PARTITIONS);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 50,
    };
    let config = cfg.write_with("[serve]\naccept_events = true\n");
    let service = Service::start_until(&config, "/healthz", "ok\n");
    let users: Vec<String> = (0..48).map(|u| format!("user-{u}-{}", u * 7919)).collect();
    let events: Vec<String> = users
        .iter()
        .enumerate()
        .map(|(n, u)| {
            format!(
                r#"{{"schema_version":1,"event_id":"{topic}-{n}","timestamp":1764000000000,"type":"click","user_id":"{u}","item_id":"i"}}"#
            )
        })
        .collect();
    let (status, body) = service.post("/v1/events", None, &format!("[{}]", events.join(",")));
    assert_eq!(status, 202, "{body}\n{}", service.log_text());

    // Read back with kcat: key and partition of every record.
    let deadline = Instant::now() + Duration::from_secs(30);
    let placed = loop {
        let out = Command::new(repo_root().join(".tools/bin/kcat"))
            .args([
                "-C",
                "-b",
                &brokers(),
                "-t",
                &topic,
                "-o",
                "beginning",
                "-e",
                "-q",
            ])
            .args(["-f", "%k %p\\n"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let placed: BTreeMap<String, u32> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.rsplit_once(' '))
            .filter(|(k, _)| k.starts_with("user-"))
            .map(|(k, p)| (k.to_owned(), p.parse().unwrap()))
            .collect();
        if placed.len() == users.len() {
            break placed;
        }
        assert!(
            Instant::now() < deadline,
            "read {} of {}",
            placed.len(),
            users.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let wrong: Vec<_> = users
        .iter()
        .filter(|u| placed[*u] != java_partition(u, PARTITIONS))
        .map(|u| (u, placed[u], java_partition(u, PARTITIONS)))
        .collect();
    assert!(
        wrong.is_empty(),
        "(key, steamrf's partition, Java's): {wrong:?}"
    );
    // Not vacuous: the keys spread over the partitions.
    let used: std::collections::BTreeSet<_> = placed.values().collect();
    assert!(used.len() >= 4, "{placed:?}");
}
