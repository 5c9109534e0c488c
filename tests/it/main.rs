//! End-to-end tests: the real broker (scripts/broker.sh), the real binary,
//! LanceDB in temp dirs, events produced with an independent client.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod cli;
mod eval;
mod partitioning;
mod privacy;
mod reliability;
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use support::*;

const INTERACTIONS: &str = "SELECT count(*) AS n FROM interactions";
const DISTINCT: &str = "SELECT count(DISTINCT event_id) AS n FROM interactions";

fn assert_tables(uri: &str, exp: &Expected) {
    assert_eq!(
        sql_count(uri, INTERACTIONS),
        exp.interactions as i64,
        "interactions rows"
    );
    assert_eq!(
        sql_count(uri, DISTINCT),
        exp.interactions as i64,
        "distinct event ids"
    );
    assert_eq!(
        sql_count(uri, "SELECT count(*) AS n FROM items"),
        exp.items as i64,
        "items rows"
    );
    assert_eq!(
        sql_count(uri, "SELECT count(*) AS n FROM profiles"),
        exp.profiles as i64,
        "profiles rows"
    );
    // Dialogue turns and items carry embeddings; clicks and purchases never
    // do. A turn's vector is in turn_vectors, under its event id.
    assert_eq!(
        sql_count(uri, "SELECT count(*) AS n FROM turn_vectors"),
        exp.dialogue as i64,
        "embedded dialogue turns"
    );
    assert_eq!(
        sql_count(
            uri,
            "SELECT count(*) AS n FROM turn_vectors v JOIN interactions i ON v.event_id = i.event_id WHERE i.kind = 'dialogue_turn' AND v.embedding IS NOT NULL"
        ),
        exp.dialogue as i64,
        "each vector belongs to a stored dialogue turn; clicks and purchases are not embedded"
    );
    assert_eq!(
        sql_count(
            uri,
            "SELECT count(*) AS n FROM items WHERE embedding IS NOT NULL"
        ),
        exp.items as i64,
        "embedded items"
    );
}

/// 10k events, ~1% malformed: rows equal the valid events, the dead-letter
/// topic holds exactly the malformed ones with their reasons, and the idle
/// exit drains and exits 0.
#[test]
fn ingest_10k_with_dead_letters() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-ingest");
    let dlq = format!("{topic}-dlq");
    let exp = generate(&dir.path().join("events.jsonl"), 10_000, 100, 7, &topic);
    assert_eq!(exp.malformed.len(), 100);
    produce_all(&topic, 4, &dir.path().join("events.jsonl"));

    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &topic,
        dlq: &dlq,
        max_rows: 2000,
        linger_ms: 100,
    };
    let mut p = Pipeline::start(&cfg.write(), Some("3s"));
    let status = p.wait(Duration::from_secs(240));
    assert!(status.success(), "exit {status:?}; log:\n{}", p.log_text());
    assert_tables(&cfg.lancedb_uri(), &exp);

    let letters = read_dead_letters(&dlq, exp.malformed.len(), Duration::from_secs(30));
    assert_eq!(
        letters.len(),
        exp.malformed.len(),
        "exactly the malformed records are dead-lettered"
    );
    let mut seen = BTreeMap::new();
    for l in &letters {
        let kind = exp.malformed.get(&l.payload).unwrap_or_else(|| {
            panic!(
                "unexpected dead letter {:?}",
                String::from_utf8_lossy(&l.payload)
            )
        });
        assert_eq!(
            l.headers.get("steamrf-error-kind").map(String::as_str),
            Some(*kind),
            "{:?}",
            l.headers
        );
        assert!(!l.headers["steamrf-error-reason"].is_empty());
        assert_eq!(l.headers["steamrf-source-topic"], topic);
        assert!(l.headers.contains_key("steamrf-source-offset"));
        *seen.entry(*kind).or_insert(0) += 1;
    }
    assert_eq!(
        seen.len(),
        6,
        "every kind of bad input was exercised: {seen:?}"
    );
    let log = p.log_text();
    assert!(log.contains("Pipeline drained and stopped."), "{log}");
}

/// Replaying the whole topic (a new consumer group from the beginning) adds no rows.
#[test]
fn replay_adds_no_rows() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-replay");
    let exp = generate(&dir.path().join("events.jsonl"), 2_000, 0, 11, &topic);
    produce_all(&topic, 2, &dir.path().join("events.jsonl"));
    let dlq = format!("{topic}-dlq");
    for name in ["first", "replay"] {
        let group = format!("{topic}-{name}");
        let cfg = PipelineConfig {
            dir: dir.path(),
            topic: &topic,
            group: &group,
            dlq: &dlq,
            max_rows: 500,
            linger_ms: 50,
        };
        let p = Pipeline::run_to_idle(&cfg.write());
        assert_tables(&cfg.lancedb_uri(), &exp);
        // The replay finds every dialogue turn and item version stored: it
        // embeds nothing.
        let log = p.log_text();
        if name == "replay" {
            assert!(log.contains("embedded=0"), "{log}");
        } else {
            assert!(!log.contains("embedded=0"), "{log}");
        }
    }
}

/// kill -9 at random moments while events stream in (and one SIGTERM), then
/// restart: nothing lost, nothing duplicated.
#[test]
fn crash_restart_exact_counts() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-crash");
    let dlq = format!("{topic}-dlq");
    let file = dir.path().join("events.jsonl");
    let exp = generate(&file, 8_000, 200, 13, &topic);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &topic,
        dlq: &dlq,
        max_rows: 200,
        linger_ms: 20,
    };
    let config = cfg.write();
    let uri = cfg.lancedb_uri();
    // Stream at ~150 events/s (about 53 s) so the kills land mid-stream. A
    // restarted member first waits for the killed one's session to expire, so
    // each round waits until this incarnation has written something, then
    // kills it at a random moment up to a second later (mid-write, mid-commit,
    // mid-poll: wherever it happens to be).
    let mut producer = produce(&topic, 4, &file, Some(150));
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut partial = std::collections::BTreeSet::new();
    let mut before = 0;
    for round in 0..5 {
        let mut p = Pipeline::start(&config, None);
        let deadline = Instant::now() + Duration::from_secs(60);
        while try_sql_count(&uri, INTERACTIONS).unwrap_or(0) == before && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(100));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..1000)));
        if round == 2 {
            // One graceful stop mid-stream: drain, write, commit, exit 0.
            let status = p.sigterm();
            assert!(status.success(), "SIGTERM: {status:?}\n{}", p.log_text());
            assert!(p.log_text().contains("Pipeline drained and stopped."));
        } else {
            p.kill9();
        }
        let rows = sql_count(&uri, INTERACTIONS);
        eprintln!(
            "round {round}: killed with {rows} of {} rows written",
            exp.interactions
        );
        assert_eq!(
            rows,
            sql_count(&uri, DISTINCT),
            "no duplicates even mid-stream"
        );
        if rows > before && (rows as usize) < exp.interactions {
            partial.insert(rows);
        }
        before = rows;
        if rows as usize == exp.interactions {
            break;
        }
    }
    assert!(producer.wait().unwrap().success());
    assert!(
        partial.len() >= 3,
        "at least three kills should land mid-stream, each after progress: {partial:?}"
    );
    let mut p = Pipeline::start(&config, Some("4s"));
    assert!(
        p.wait(Duration::from_secs(180)).success(),
        "{}",
        p.log_text()
    );
    assert_tables(&uri, &exp);
    // Dead letters are at-least-once: a crash between producing one and
    // committing its offset re-sends it. Every malformed record is there.
    let letters = read_dead_letters(&dlq, exp.malformed.len(), Duration::from_secs(30));
    let distinct: std::collections::BTreeSet<_> =
        letters.iter().map(|l| l.payload.clone()).collect();
    assert_eq!(distinct.len(), exp.malformed.len());
}

/// Two instances in one group split the partitions and write each event
/// once; stopping one (SIGTERM, exit 0) hands its partitions to the other.
#[test]
fn two_instances_share_then_hand_over() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-group");
    let dlq = format!("{topic}-dlq");
    let f1 = dir.path().join("part1.jsonl");
    let f2 = dir.path().join("part2.jsonl");
    let e1 = generate(&f1, 4_000, 0, 21, &format!("{topic}-a"));
    let e2 = generate(&f2, 4_000, 0, 22, &format!("{topic}-b"));
    // Create the (empty) topic before the consumers subscribe, and produce
    // only once both are members, so that both get data.
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    produce_all(&topic, 4, &empty);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &topic,
        dlq: &dlq,
        max_rows: 500,
        linger_ms: 50,
    };
    let config = cfg.write();
    let uri = cfg.lancedb_uri();
    let mut a = Pipeline::start(&config, None);
    let mut b = Pipeline::start(&config, None);
    let long = Duration::from_secs(90);
    a.wait_metric("steamrf_source_assigned_partitions", |v| v >= 1.0, long);
    b.wait_metric("steamrf_source_assigned_partitions", |v| v >= 1.0, long);
    a.wait_metric(
        "steamrf_source_assigned_partitions",
        |v| (1.0..4.0).contains(&v),
        long,
    );
    produce_all(&topic, 4, &f1);
    wait_count(&uri, INTERACTIONS, e1.interactions as i64, long);
    let a_rows = a
        .metric("steamrf_sink_rows_written_total")
        .unwrap_or_else(|| panic!("a is gone; log:\n{}", a.log_text()));
    let b_rows = b
        .metric("steamrf_sink_rows_written_total")
        .unwrap_or_else(|| panic!("b is gone; log:\n{}", b.log_text()));
    assert!(
        a_rows > 0.0 && b_rows > 0.0,
        "both members wrote: a={a_rows} b={b_rows}"
    );

    let status = a.sigterm();
    assert!(
        status.success(),
        "SIGTERM drains and exits 0: {status:?}\n{}",
        a.log_text()
    );
    b.wait_metric("steamrf_source_assigned_partitions", |v| v == 4.0, long);
    produce_all(&topic, 4, &f2);
    let total = Expected {
        interactions: e1.interactions + e2.interactions,
        dialogue: e1.dialogue + e2.dialogue,
        items: e1.items + e2.items,
        profiles: e1.profiles + e2.profiles,
        ..Expected::default()
    };
    wait_count(&uri, INTERACTIONS, total.interactions as i64, long);
    assert!(b.sigterm().success(), "{}", b.log_text());
    assert_tables(&uri, &total);
}

/// Events through Kafka to the STEAM tables: memories per user, links only
/// across users, a prototype for the community four users share (not for the
/// one only two share), and a replay that changes nothing.
#[test]
fn events_become_memories_communities_and_prototypes() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-steam");
    let dlq = format!("{topic}-dlq");
    let file = dir.path().join("events.jsonl");
    steam_events(&topic, &file);
    // One partition: items reach the pipeline before the clicks that need them.
    produce_all(&topic, 1, &file);

    let mut uri = String::new();
    let mut snapshots = Vec::new();
    for name in ["first", "replay"] {
        let group = format!("{topic}-{name}");
        let cfg = PipelineConfig {
            dir: dir.path(),
            topic: &topic,
            group: &group,
            dlq: &dlq,
            max_rows: 1000,
            linger_ms: 100,
        };
        cfg.run_to_idle("[steam]\nenabled = true\n");
        let u = cfg.lancedb_uri();
        snapshots.push(sql_text(
            &u,
            "SELECT memory_id, user_id, version, support, community_id, content FROM memories ORDER BY memory_id",
        ));
        snapshots.push(sql_text(
            &u,
            "SELECT prototype_id, users, content FROM prototypes ORDER BY prototype_id",
        ));
        uri = u;
    }
    assert_eq!(snapshots[0], snapshots[2], "a replay changes no memory");
    assert_eq!(snapshots[1], snapshots[3], "a replay changes no prototype");

    // Every user has memories; user0's profile is one of them; the
    // assistant's turn is not observed, the user's is.
    assert_eq!(
        sql_count(&uri, "SELECT count(DISTINCT user_id) AS n FROM memories"),
        4
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memories WHERE content LIKE 'User profile:%'"
        ),
        1
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT sum(support) AS n FROM memories WHERE content NOT LIKE 'User profile:%'"
        ),
        4 * 3 + 2 + 1,
        "every click, purchase and user turn is linked to exactly one memory"
    );
    // Links only across users.
    assert!(sql_count(&uri, "SELECT count(*) AS n FROM memory_links") > 0);
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memory_links WHERE from_user = to_user"
        ),
        0
    );
    // The jazz community spans four users: published. Sci-fi spans two: not.
    assert!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM prototypes WHERE users >= 3 AND content LIKE '%Jazz%'"
        ) >= 1,
        "{}",
        snapshots[1]
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM prototypes WHERE content LIKE '%Science Fiction%'"
        ),
        0,
        "{}",
        snapshots[1]
    );
    assert_eq!(
        sql_count(&uri, "SELECT count(*) AS n FROM prototypes WHERE users < 3"),
        0
    );
}

/// Items, clicks, purchases, dialogue turns and a profile for four users:
/// four share a jazz interest, two a science-fiction one.
/// A temp dir and a new topic holding [`steam_events`].
fn steam_topic(prefix: &str) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique(prefix);
    let file = dir.path().join("events.jsonl");
    steam_events(&topic, &file);
    produce_all(&topic, 1, &file);
    (dir, topic)
}

fn steam_events(topic: &str, file: &std::path::Path) {
    let mut lines = Vec::new();
    let mut n = 0;
    let mut ev = |body: String| {
        n += 1;
        let ts = 1_764_000_000_000i64 + n * 1000;
        lines.push(format!(
            r#"{{"schema_version":1,"event_id":"{topic}-{n}","timestamp":{ts},{body}}}"#
        ));
    };
    for i in 0..6 {
        ev(format!(
            r#""type":"item","item_id":"jazz{i}","title":"Jazz Standards Collection Volume {i}","categories":["Jazz","Bebop"]"#
        ));
    }
    for i in 0..3 {
        ev(format!(
            r#""type":"item","item_id":"space{i}","title":"Galactic Space Opera Saga Part {i}","categories":["Science Fiction","Space Opera"]"#
        ));
    }
    for u in 0..4 {
        for i in 0..3 {
            ev(format!(
                r#""type":"click","user_id":"user{u}","item_id":"jazz{}""#,
                (u + i) % 6
            ));
        }
    }
    for u in 0..2 {
        ev(format!(
            r#""type":"purchase","user_id":"user{u}","item_id":"space{u}","quantity":1,"price":9.5,"currency":"EUR""#
        ));
    }
    ev(r#""type":"dialogue_turn","user_id":"user3","session_id":"s","role":"user","text":"Any more bebop jazz standards like these?""#.to_owned());
    ev(r#""type":"dialogue_turn","user_id":"user3","session_id":"s","role":"assistant","text":"Try Giant Steps.""#.to_owned());
    ev(
        r#""type":"profile","user_id":"user0","attributes":{"age":31,"likes":"jazz piano"}"#
            .to_owned(),
    );
    std::fs::write(file, lines.join("\n") + "\n").unwrap();
}

/// With a chat endpoint configured, memory and prototype contents come from
/// it (a local fake server: no LLM is reachable from here), and the prompts
/// carry the memories' categories and items.
#[test]
fn memory_contents_come_from_the_llm_when_configured() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-llm");
    let dlq = format!("{topic}-dlq");
    let file = dir.path().join("events.jsonl");
    steam_events(&topic, &file);
    produce_all(&topic, 1, &file);
    let chat = FakeChat::start("Enjoys bebop-era jazz standards.");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &topic,
        dlq: &dlq,
        max_rows: 1000,
        linger_ms: 100,
    };
    cfg.run_to_idle(&format!(
        "[steam]\nenabled = true\n[steam.llm]\nurl = \"{}\"\nmax_in_flight = 2\n",
        chat.url
    ));
    let uri = cfg.lancedb_uri();
    let total = sql_count(&uri, "SELECT count(*) AS n FROM memories");
    let from_llm = sql_count(
        &uri,
        "SELECT count(*) AS n FROM memories WHERE content = 'Enjoys bebop-era jazz standards.'",
    );
    // Every memory but the profile's (its content is the profile itself).
    assert_eq!(from_llm, total - 1);
    assert!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM prototypes WHERE content = 'Enjoys bebop-era jazz standards.'"
        ) >= 1
    );
    let prompts = chat.prompts.lock().unwrap();
    assert!(
        prompts
            .iter()
            .any(|p| p.contains("Jazz") && p.contains("Jazz Standards Collection")),
        "{prompts:?}"
    );
    assert!(prompts.iter().any(|p| p.contains("community")));
}

/// Runs `steamrf run` on `config` until the topic is idle, reading `names`
/// from its /metrics while it runs: the last reads come from the idle wait
/// before the exit, after all the work.
fn run_watching(config: &std::path::Path, names: &[&str]) -> (Pipeline, Vec<f64>) {
    let mut p = Pipeline::start(config, Some("3s"));
    let mut last = vec![0.0; names.len()];
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        for (v, name) in last.iter_mut().zip(names) {
            if let Some(x) = p.metric(name) {
                *v = x;
            }
        }
        if let Some(status) = p.child.try_wait().unwrap() {
            assert!(status.success(), "{}", p.log_text());
            return (p, last);
        }
        assert!(Instant::now() < deadline, "{}", p.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The `[steam.llm]` path against a real model server: llama.cpp's
/// OpenAI-compatible server (PyPI llama-cpp-python, built once by
/// scripts/tools.sh) serving SmolLM2-135M-Instruct. Memory and prototype
/// contents come from the model; a timeout, and a completion cut off before
/// a full sentence, keep the deterministic summary; nothing is lost either
/// way. The model is tiny: this checks the plumbing, not the summaries.
#[test]
fn memory_contents_come_from_a_real_llama_cpp_server() {
    let dir = tempfile::tempdir().unwrap();
    let llm = LlamaServer::start(dir.path());
    const METRICS: [&str; 6] = [
        "steamrf_llm_calls_total{result=\"ok\"}",
        "steamrf_llm_calls_total{result=\"fallback\"}",
        "steamrf_llm_tokens_total{kind=\"prompt\"}",
        "steamrf_llm_tokens_total{kind=\"completion\"}",
        "steamrf_llm_call_duration_seconds_sum",
        "steamrf_llm_call_duration_seconds_count",
    ];
    // The deterministic summariser's shape (operators::steam::memory::summarise).
    let deterministic = "(content LIKE 'Interested in %' OR content LIKE 'For example: %')";
    let run = |name: &str, llm_toml: &str| {
        let topic = unique(name);
        let file = dir.path().join(format!("{name}.jsonl"));
        steam_events(&topic, &file);
        produce_all(&topic, 1, &file);
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let cfg = PipelineConfig {
            dir: &sub,
            topic: &topic,
            group: &topic,
            dlq: &format!("{topic}-dlq"),
            max_rows: 1000,
            linger_ms: 100,
        };
        let config = cfg.write_with(&format!(
            "[steam]\nenabled = true\n[steam.llm]\nurl = \"{}\"\nmax_in_flight = 2\n{llm_toml}",
            llm.url
        ));
        let started = Instant::now();
        let (p, m) = run_watching(&config, &METRICS);
        let uri = cfg.lancedb_uri();
        // Nothing lost: every interaction and item is stored, every memory
        // has content.
        assert_eq!(
            sql_count(&uri, "SELECT count(*) AS n FROM interactions"),
            16
        );
        assert_eq!(sql_count(&uri, "SELECT count(*) AS n FROM items"), 9);
        assert_eq!(
            sql_count(
                &uri,
                "SELECT count(*) AS n FROM memories WHERE content IS NULL OR trim(content) = ''"
            ),
            0
        );
        (p, m, uri, started.elapsed())
    };

    // The model writes the contents.
    let (p, m, uri, took) = run("it-llama", "timeout = \"60s\"\n");
    let memories = sql_count(&uri, "SELECT count(*) AS n FROM memories");
    let from_model = sql_count(
        &uri,
        &format!(
            "SELECT count(*) AS n FROM memories WHERE NOT {deterministic} AND content NOT LIKE 'User profile: %'"
        ),
    );
    let prototypes = sql_count(&uri, "SELECT count(*) AS n FROM prototypes");
    let proto_from_model = sql_count(
        &uri,
        &format!("SELECT count(*) AS n FROM prototypes WHERE NOT {deterministic}"),
    );
    eprintln!(
        "llama.cpp SmolLM2-135M: {memories} memories ({from_model} written by the model), {prototypes} prototypes ({proto_from_model} by the model); \
         calls ok={} fallback={}, tokens prompt={} completion={}, {:.2} s per call ({} calls, {:.1} s in calls), run {took:?}\n\
         per memory or prototype written: {:.2} calls, {:.0} tokens, {:.2} s\n{}",
        m[0],
        m[1],
        m[2],
        m[3],
        m[4] / m[5].max(1.0),
        m[5],
        m[4],
        (m[0] + m[1]) / (memories + prototypes) as f64,
        (m[2] + m[3]) / (memories + prototypes) as f64,
        m[4] / (memories + prototypes) as f64,
        sql_text(
            &uri,
            "SELECT user_id, content FROM memories ORDER BY user_id LIMIT 4"
        ),
    );
    assert!(m[0] >= 1.0, "no LLM call succeeded:\n{}", p.log_text());
    assert!(m[2] > 0.0 && m[3] > 0.0, "the server reported no tokens");
    assert!(from_model >= 1, "no memory content came from the model");
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memories WHERE content LIKE '%Categories seen%'"
        ),
        0,
        "a completion that repeats the prompt was stored"
    );
    assert!(prototypes >= 1);
    assert!(
        proto_from_model + m[1] as i64 >= 1,
        "prototype contents neither came from the model nor fell back"
    );
    drop(p);

    // A completion cut off by max_completion_tokens before a full sentence
    // (one token): refused, the deterministic content kept.
    let (p, m, uri, _) = run("it-llama-cut", "max_completion_tokens = 1\n");
    assert_eq!(m[0], 0.0, "{}", p.log_text());
    assert!(m[1] >= 1.0);
    assert!(
        p.log_text().contains("before a full sentence"),
        "{}",
        p.log_text()
    );
    assert_eq!(
        sql_count(
            &uri,
            &format!(
                "SELECT count(*) AS n FROM memories WHERE NOT {deterministic} AND content NOT LIKE 'User profile: %'"
            )
        ),
        0
    );
    drop(p);

    // Every call times out (and is retried): the deterministic content.
    let (p, m, uri, _) = run("it-llama-timeout", "timeout = \"1ms\"\n");
    assert_eq!(m[0], 0.0, "{}", p.log_text());
    assert!(m[1] >= 1.0);
    assert_eq!(
        sql_count(
            &uri,
            &format!(
                "SELECT count(*) AS n FROM memories WHERE NOT {deterministic} AND content NOT LIKE 'User profile: %'"
            )
        ),
        0
    );
}

/// `steamrf validate` reports every problem at once and exits 2.
#[test]
fn validate_reports_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[kafka]\ntopics = []\n[batch]\nmax_rows = 0\nlinger = \"0ms\"\n[lancedb]\nuri = \"gs://b\"\n[kafka.properties]\n\"no.such.thing\" = \"1\"\n").unwrap();
    let out = std::process::Command::new(steamrf_bin())
        .arg("validate")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "5 problem(s)",
        "kafka.topics",
        "batch.max_rows",
        "batch.linger",
        "lancedb.uri",
        "no.such.thing",
    ] {
        assert!(err.contains(needle), "missing {needle:?}:\n{err}");
    }
    let good = repo_root().join("examples/quickstart.toml");
    let out = std::process::Command::new(steamrf_bin())
        .arg("validate")
        .arg(&good)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// From Kafka events to a retrieval answer: the service starts before the
/// pipeline has written anything, sees the tables appear and change without
/// a restart, and answers text queries with the user's own rows, the
/// published community (never other users' text), and ranked candidates.
#[test]
fn kafka_events_to_a_retrieval_answer() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-serve");
    let dlq = format!("{topic}-dlq");
    let file = dir.path().join("events.jsonl");
    steam_events(&topic, &file);
    produce_all(&topic, 1, &file);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &dlq,
        max_rows: 1000,
        linger_ms: 100,
    };
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "reader-token-0123456789 default\n").unwrap();
    let extra = format!(
        "[steam]\nenabled = true\n[serve]\nrefresh_interval = \"200ms\"\ntokens_file = \"{}\"\n",
        tokens.display()
    );
    let config = cfg.write_with(&extra);
    let service = Service::start(&config);
    let token = Some("reader-token-0123456789");
    let ask = |body: &str| service.post("/v1/retrieve", token, body);
    let (status, _) = service.post(
        "/v1/retrieve",
        None,
        r#"{"user_id":"user3","query":"jazz"}"#,
    );
    assert_eq!(status, 401);

    // The pipeline keeps running, as in production.
    let mut pipeline = Pipeline::start(&config, None);
    let question = r#"{"user_id":"user3","query":"bebop jazz standards","k":5}"#;
    let deadline = Instant::now() + Duration::from_secs(60);
    let answer = loop {
        let (status, body) = ask(question);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        // Each table's snapshot is one consistent version, but the tables
        // are written one after another: memories trail their interactions
        // by the STEAM stage of the same batch.
        let has_memory = v["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["kind"] == "memory");
        if has_memory && !v["collaborative"].as_array().unwrap().is_empty() {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "no answer:\n{}",
            service.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let items = answer["items"].as_array().unwrap();
    let kinds: Vec<&str> = items.iter().map(|i| i["kind"].as_str().unwrap()).collect();
    assert!(
        kinds.contains(&"session") && kinds.contains(&"memory"),
        "{answer}"
    );
    // The session holding the user's own turn, found through a passage window.
    let turn = items
        .iter()
        .find(|i| {
            i["kind"] == "session" && i["content"].as_str().unwrap().contains("Any more bebop")
        })
        .unwrap_or_else(|| panic!("the user's own turn is not retrieved: {answer}"));
    assert_eq!(turn["provenance"]["table"], "interactions");
    assert!(turn["passage"]["end"].as_u64().unwrap() >= 1, "{answer}");
    assert!(
        turn["provenance"]["source_event_ids"][0]
            .as_str()
            .unwrap()
            .starts_with(&topic)
    );
    let ex = &answer["explanation"];
    assert!(
        ex["latency"]["embed_ms"].as_f64().unwrap() > 0.0,
        "{answer}"
    );
    assert!(ex["table_versions"]["memories"].as_u64().unwrap() > 0);
    // The jazz community (four users) is reached through its prototype;
    // other users appear only as ids.
    let collab = answer["collaborative"].as_array().unwrap();
    assert!(
        collab.iter().any(|c| c["users"].as_u64().unwrap() >= 3
            && c["content"].as_str().unwrap().contains("Jazz")),
        "{answer}"
    );
    let text = answer.to_string();
    for other in ["user0", "user1", "user2", "jazz piano"] {
        assert!(!text.contains(other), "{other} leaked: {text}");
    }

    // Ranking: a jazz candidate above a science-fiction one, unknown last.
    let (status, body) = service.post(
        "/v1/recommend",
        token,
        r#"{"user_id":"user2","candidates":["nope","space2","jazz5"]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let ids: Vec<&str> = v["ranked"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["jazz5", "space2", "nope"], "{body}");

    // Freshness: a new turn is answerable soon after it is produced (Kafka,
    // a micro-batch, its embedding, the write, the STEAM stage, a snapshot
    // refresh), with no restart of anything.
    let more = dir.path().join("more.jsonl");
    std::fs::write(
        &more,
        format!(
            "{{\"schema_version\":1,\"event_id\":\"{topic}-late\",\"timestamp\":1764000100000,\"type\":\"dialogue_turn\",\"user_id\":\"user3\",\"session_id\":\"s2\",\"role\":\"user\",\"text\":\"Thelonious Monk piano records, please\"}}\n"
        ),
    )
    .unwrap();
    produce_all(&topic, 1, &more);
    let written = Instant::now();
    loop {
        let (_, body) = ask(
            r#"{"user_id":"user3","query":"Thelonious Monk piano","k":1,"options":{"mode":"familiarity"}}"#,
        );
        if body.contains("Thelonious Monk piano records") {
            break;
        }
        assert!(
            written.elapsed() < Duration::from_secs(10),
            "the new turn never showed up: {body}\n{}\n{}",
            service.log_text(),
            pipeline.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!(
        "new turn answerable {:?} after it was produced",
        written.elapsed()
    );
    assert!(pipeline.sigterm().success());
}

/// `/v1/recommend` with fitted weights (`[serve.ranker]`, as
/// `eval steam --fit-out` writes it), over tables `steamrf run` wrote: the
/// service reads users per item from `interactions` and the items' texts,
/// and ranks by the fused score, each candidate with its signals.
#[test]
fn recommend_ranks_with_the_configured_fused_ranker() {
    let (dir, topic) = steam_topic("it-ranker");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let config = cfg.write_with(
        "[steam]\nenabled = true\n[serve]\nrefresh_interval = \"200ms\"\n\
         [serve.ranker]\nsteam = 0.2\nitem_cf = 0.6\nbm25 = 0.2\npopularity = 0.0\nstats_interval = \"200ms\"\n",
    );
    let mut pipeline = Pipeline::start(&config, None);
    let service = Service::start(&config);
    // user2 clicked jazz2, jazz3 and jazz4; jazz5 was clicked only by user3,
    // who also clicked jazz3 and jazz4: item-CF's first choice. Nobody
    // clicked space2.
    let ask = r#"{"user_id":"user2","candidates":["space2","jazz0","jazz5","nope"]}"#;
    let deadline = Instant::now() + Duration::from_secs(60);
    let v = loop {
        let (status, body) = service.post("/v1/recommend", None, ask);
        if status == 200 {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            if v["ranked"][0]["signals"]["item_cf"].as_f64().unwrap_or(0.0) > 0.0 {
                break v;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no fused ranking: {body}\n{}",
            service.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let ranked = v["ranked"].as_array().unwrap();
    let ids: Vec<&str> = ranked
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["jazz5", "jazz0", "space2", "nope"], "{v}");
    let signal = |i: usize, s: &str| ranked[i]["signals"][s].as_f64().unwrap();
    // cos(jazz3, jazz5) + cos(jazz4, jazz5) = 1/√3 + 1/√2.
    let expected = 1.0 / 3f64.sqrt() + 1.0 / 2f64.sqrt();
    assert!((signal(0, "item_cf") - expected).abs() < 1e-4, "{v}");
    assert_eq!(signal(2, "item_cf"), 0.0);
    // The history's jazz titles share their rare words with jazz candidates.
    assert!(signal(1, "bm25") > signal(2, "bm25"), "{v}");
    assert!(
        ranked[3].get("signals").is_none(),
        "unknown items are not scored"
    );
    assert!(pipeline.sigterm().success());
}

/// Long dialogue sessions through Kafka → `steamrf run` → `steamrf serve`:
/// each turn gets a passage window (the two turns before it and itself) at
/// ingest, once; a question about something said late in a long session
/// finds that session through the window, and the answer names it; the
/// text query's rare words reach the session through BM25 too.
#[test]
fn long_sessions_are_found_through_their_passage_windows() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-passages");
    let file = dir.path().join("events.jsonl");
    let filler = [
        ("user", "I want to reorganise the garage this weekend."),
        (
            "assistant",
            "Start by sorting everything into keep, donate and bin.",
        ),
        ("user", "There are a lot of old paint cans in there."),
        (
            "assistant",
            "Paint cans go to the municipal recycling centre.",
        ),
        ("user", "The shelves are also falling apart."),
        (
            "assistant",
            "Wall-mounted steel shelving lasts longer than wood.",
        ),
        ("user", "What about the bicycles?"),
        ("assistant", "Ceiling hooks keep bicycles off the floor."),
        ("user", "Good idea, the floor is always cluttered."),
        ("assistant", "A pegboard for tools helps with that too."),
    ];
    let mut lines = Vec::new();
    let mut ts = 1_764_000_000_000i64;
    let mut turn = |session: &str, role: &str, text: &str, lines: &mut Vec<String>| {
        ts += 60_000;
        lines.push(format!(
            "{{\"schema_version\":1,\"event_id\":\"{topic}-{}\",\"timestamp\":{ts},\"type\":\"dialogue_turn\",\"user_id\":\"pat\",\"session_id\":\"{session}\",\"role\":\"{role}\",\"text\":\"{text}\"}}",
            lines.len()
        ));
    };
    for (role, text) in filler {
        turn("garage", role, text, &mut lines);
    }
    // The fact sits at the end of a long session about something else.
    for (role, text) in filler.iter().rev() {
        turn("errands", role, text, &mut lines);
    }
    turn(
        "errands",
        "user",
        "Also, my sister Marta is getting married in Lisbon on the 14th of June.",
        &mut lines,
    );
    turn(
        "errands",
        "assistant",
        "Congratulations to Marta! I will remind you to book flights to Lisbon.",
        &mut lines,
    );
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    produce_all(&topic, 1, &file);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 7,
        linger_ms: 100,
    };
    // Small batches: most windows need a turn from an earlier batch, read
    // back from the table.
    cfg.run_to_idle("");
    let uri = cfg.lancedb_uri();
    let count = |sql: &str| sql_count(&uri, sql);
    assert_eq!(count("SELECT count(*) AS n FROM passages"), 22);
    assert_eq!(
        count("SELECT count(*) AS n FROM passages WHERE turns = 3"),
        18,
        "every turn but each session's first two ends a three-turn window"
    );
    assert_eq!(
        count(&format!(
            "SELECT count(*) AS n FROM passages WHERE event_id = '{topic}-21' AND first_event_id = '{topic}-19' AND text LIKE 'Conversation with the assistant on 2025-11-24:%Marta%Lisbon%'"
        )),
        1
    );
    // A replay under another consumer group adds nothing.
    PipelineConfig {
        group: &format!("{topic}-replay"),
        ..cfg
    }
    .run_to_idle("");
    assert_eq!(count("SELECT count(*) AS n FROM passages"), 22);
    // Every turn has its learned sparse vector (SPLADE-tiny).
    assert_eq!(
        count(
            "SELECT count(*) AS n FROM turn_vectors WHERE terms IS NOT NULL AND array_length(terms) = array_length(weights) AND array_length(terms) > 5"
        ),
        22
    );

    let config = cfg.write_with("[serve]\nrefresh_interval = \"200ms\"\n");
    let service = Service::start(&config);
    let (status, body) = service.post(
        "/v1/retrieve",
        None,
        r#"{"user_id":"pat","query":"When is my sister's wedding?","k":1}"#,
    );
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let top = &v["items"][0];
    assert_eq!(top["kind"], "session", "{v}");
    assert_eq!(top["id"], "errands", "{v}");
    let passage = &top["passage"];
    assert!(
        passage["end"].as_u64().unwrap() >= 11,
        "the matching window is at the session's end: {v}"
    );
    assert!(top["dense"].as_f64().unwrap() > 0.0, "{v}");
    // The rare name reaches the session lexically as well.
    let (_, body) = service.post(
        "/v1/retrieve",
        None,
        r#"{"user_id":"pat","query":"Marta Lisbon","k":2}"#,
    );
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["items"][0]["id"], "errands", "{v}");
    assert!(v["items"][0]["lexical"].as_f64().unwrap() > 0.3, "{v}");
    // Words the conversation never uses reach it through the turn's learned
    // expansion ("married" → "marriage", "Lisbon" → "portugal"), which BM25
    // cannot do.
    let (_, body) = service.post(
        "/v1/retrieve",
        None,
        r#"{"user_id":"pat","query":"marriage in Portugal","k":1}"#,
    );
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let top = &v["items"][0];
    assert_eq!(top["id"], "errands", "{v}");
    assert!(top["content"].as_str().unwrap().contains("Marta"), "{v}");
    let (sparse, lexical) = (
        top["sparse"].as_f64().unwrap(),
        top["lexical"].as_f64().unwrap(),
    );
    assert!(sparse > 0.5 && sparse > lexical, "{v}");
}

/// A tokens file in `dir`: `writer-token-0123456789` for tenant `default`,
/// `globex-token-0123456789` for `globex`, `admin-token-0123456789` for all.
fn tenant_tokens(dir: &std::path::Path) -> std::path::PathBuf {
    let tokens = dir.join("tokens");
    std::fs::write(
        &tokens,
        "writer-token-0123456789 default\nglobex-token-0123456789 globex\nadmin-token-0123456789 *\n",
    )
    .unwrap();
    tokens
}

/// `POST /v1/events` → Kafka → `steamrf run` → `/v1/retrieve`: the HTTP write
/// path is the Kafka write path. A request with one bad event produces
/// nothing, tokens are scoped to their tenants, and a resent request adds
/// nothing (the pipeline stores each event_id once).
#[test]
fn http_events_reach_retrieval_through_kafka() {
    let (dir, topic) = steam_topic("it-events");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 50,
    };
    let tokens = tenant_tokens(dir.path());
    let extra = format!(
        "[serve]\nrefresh_interval = \"200ms\"\naccept_events = true\ntokens_file = \"{}\"\n",
        tokens.display()
    );
    let config = cfg.write_with(&extra);
    let service = Service::start(&config);
    let mut pipeline = Pipeline::start(&config, None);
    let writer = Some("writer-token-0123456789");
    let turn = |id: &str, text: &str| {
        format!(
            r#"{{"schema_version":1,"event_id":"{topic}-{id}","timestamp":1764000200000,"type":"dialogue_turn","user_id":"user3","session_id":"http","role":"user","text":"{text}"}}"#
        )
    };

    // The pipeline has joined its group and caught up (the first events are
    // answerable), as in production; then POST -> answerable is measured.
    let started = Instant::now();
    loop {
        let (_, body) = service.post(
            "/v1/retrieve",
            writer,
            r#"{"user_id":"user3","query":"bebop","k":5,"options":{"mode":"familiarity"}}"#,
        );
        if body.contains("Any more bebop") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{}",
            pipeline.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, body) = service.post("/v1/events", None, &turn("a", "x"));
    assert_eq!(status, 401, "{body}");
    // One bad event: a 400 naming it, and nothing of the request produced.
    let bad = format!(
        "[{}, {{\"schema_version\":1,\"event_id\":\"{topic}-b\",\"timestamp\":1,\"type\":\"click\",\"item_id\":\"i\"}}]",
        turn("rejected", "Zanzibar harmonica lessons")
    );
    let (status, body) = service.post("/v1/events", writer, &bad);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains(r#""field":"events[1].user_id""#), "{body}");
    let (status, body) = service.post(
        "/v1/events",
        Some("globex-token-0123456789"),
        &turn("c", "x"),
    );
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(r#""field":"events[0].user_id""#), "{body}");
    let item = format!(
        r#"{{"schema_version":1,"event_id":"{topic}-item","timestamp":1,"type":"item","item_id":"new-item","title":"New"}}"#
    );
    let (status, body) = service.post("/v1/events", writer, &item);
    assert_eq!(
        status, 403,
        "item events need a token for every tenant: {body}"
    );
    assert!(body.contains(r#""field":"events[0].type""#), "{body}");
    let (status, body) = service.post("/v1/events", Some("admin-token-0123456789"), &item);
    assert_eq!(status, 202, "{body}");

    // A good turn: accepted once the broker has it, then answerable.
    let good = turn("good", "Ornette Coleman free jazz records, please");
    let sent = Instant::now();
    let (status, body) = service.post("/v1/events", writer, &good);
    assert_eq!(status, 202, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["accepted"], 1);
    assert_eq!(v["event_ids"][0], format!("{topic}-good"));
    assert_eq!(v["topic"], topic.as_str());
    let question = r#"{"user_id":"user3","query":"Ornette Coleman free jazz","k":10,"options":{"mode":"familiarity"}}"#;
    let answer = loop {
        let (status, body) = service.post("/v1/retrieve", writer, question);
        assert_eq!(status, 200, "{body}");
        if body.contains("Ornette Coleman free jazz records") {
            break body;
        }
        // Issue 21's bound; measured here at ~0.2 s.
        assert!(
            sent.elapsed() < Duration::from_secs(2),
            "the turn was not answerable within 2 s of its POST: {body}\n{}\n{}",
            service.log_text(),
            pipeline.log_text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "POST /v1/events -> answerable in {:?} (accepted in the request, then Kafka, a micro-batch, the embedding, the write, a refresh)",
        sent.elapsed()
    );
    assert!(
        !answer.contains("Zanzibar"),
        "the rejected request produced: {answer}"
    );

    // Resent: accepted again, stored once.
    let (status, body) = service.post("/v1/events", writer, &good);
    assert_eq!(status, 202, "{body}");
    let marker = dir.path().join("marker.jsonl");
    std::fs::write(
        &marker,
        format!("{}\n", turn("marker", "Sun Ra Arkestra marker")),
    )
    .unwrap();
    produce_all(&topic, 1, &marker);
    loop {
        let (_, body) = service.post(
            "/v1/retrieve",
            writer,
            r#"{"user_id":"user3","query":"Sun Ra Arkestra","k":1,"options":{"mode":"familiarity"}}"#,
        );
        if body.contains("Sun Ra Arkestra marker") {
            break;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(60),
            "{}",
            pipeline.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let (_, body) = service.post("/v1/retrieve", writer, question);
    assert_eq!(
        body.matches("Ornette Coleman free jazz records").count(),
        1,
        "the resent event is stored once: {body}"
    );
    assert!(pipeline.sigterm().success());
}

/// An agent's session through MCP: the official Python SDK (PyPI `mcp`)
/// against a real `steamrf serve` at /mcp and a running pipeline. The client
/// (tests/it/mcp_agent.py) lists the tools, calls each, and checks results
/// and refusals: 401 before MCP, 403 as tool errors (another tenant, forget
/// without an admin token), invalid arguments. What it prints is the
/// transcript in docs/agents.md.
#[test]
fn an_agent_uses_memory_through_mcp() {
    let (dir, topic) = steam_topic("it-mcp");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 50,
    };
    let tokens = tenant_tokens(dir.path());
    let extra = format!(
        "[steam]\nenabled = true\n[serve]\nrefresh_interval = \"200ms\"\naccept_events = true\ntokens_file = \"{}\"\n",
        tokens.display()
    );
    let config = cfg.write_with(&extra);
    let service = Service::start(&config);
    let pipeline = Pipeline::start(&config, None);
    // Caught up: user3's first turn is answerable.
    let started = Instant::now();
    while !service
        .post(
            "/v1/retrieve",
            Some("writer-token-0123456789"),
            r#"{"user_id":"user3","query":"bebop","k":5,"options":{"mode":"familiarity"}}"#,
        )
        .1
        .contains("Any more bebop")
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{}",
            pipeline.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = std::process::Command::new(python())
        .arg(repo_root().join("tests/it/mcp_agent.py"))
        .args([
            &format!("http://127.0.0.1:{}/mcp", service.port),
            "user3",
            "writer-token-0123456789",
            "globex-token-0123456789",
            "admin-token-0123456789",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("OK"),
        "{stdout}\n{stderr}\n--- serve ---\n{}\n--- run ---\n{}",
        service.log_text(),
        pipeline.log_text()
    );
    eprintln!("{stdout}{stderr}");
    let metrics = http_get(service.port, "/metrics").unwrap();
    for route in [
        "mcp_retrieve",
        "mcp_recommend",
        "mcp_remember",
        "mcp_forget",
    ] {
        assert!(
            metrics.contains(&format!("route=\"{route}\",status=\"200\"}}")),
            "{route} not counted"
        );
    }
    assert!(
        metrics.contains("route=\"mcp\",status=\"401\"} 2"),
        "{metrics}"
    );
}

/// The running service against its contract: schemathesis (PyPI, in the
/// hash-pinned venv) generates requests from `docs/openapi.json`, valid and
/// not, with and without the token, over tables a pipeline wrote. No 5xx,
/// and every status code, header, content type and body matches the spec.
#[test]
fn the_service_keeps_to_its_openapi_document_under_schemathesis() {
    let (dir, topic) = steam_topic("it-schema");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "schema-token-0123456789 *\n").unwrap();
    let extra = format!(
        "[steam]\nenabled = true\n[serve]\naccept_events = true\ntokens_file = \"{}\"\n",
        tokens.display()
    );
    cfg.run_to_idle(&extra);
    let config = cfg.write_with(&extra);
    let service = Service::start(&config);
    let spec = repo_root().join("docs/openapi.json");
    // Run in the temp dir: schemathesis keeps a cache (.schemathesis/) in
    // its working directory.
    let out = std::process::Command::new(repo_root().join(".tools/venv/bin/schemathesis"))
        .current_dir(dir.path())
        .args([
            "run",
            spec.to_str().unwrap(),
            "--url",
            &format!("http://127.0.0.1:{}", service.port),
            "-H",
            "Authorization: Bearer schema-token-0123456789",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,ignored_auth,unsupported_method",
            "--max-examples",
            "60",
            "--workers",
            "2",
            // Fuzzing repeats until the budget is spent: ~4,000 requests.
            "--max-time",
            "45",
            "--seed",
            "7",
        ])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{text}\n--- serve log ---\n{}",
        service.log_text()
    );
    assert!(text.contains("passed"), "{text}");
    eprintln!(
        "{}",
        text.lines().rev().take(12).collect::<Vec<_>>().join("\n")
    );
    assert!(!service.log_text().contains("panicked"));
}

/// The reference for the scaled-out write path: `file` through one
/// in-process pipeline with STEAM on (`steam` more `[steam]` keys), on a
/// topic, group and tables of its own under `dir/base`. Returns its LanceDB URI.
fn in_process_reference(
    dir: &std::path::Path,
    topic: &str,
    file: &std::path::Path,
    steam: &str,
) -> String {
    let base_dir = dir.join("base");
    std::fs::create_dir(&base_dir).unwrap();
    let base_topic = format!("{topic}-base");
    produce_all(&base_topic, 1, file);
    let base = PipelineConfig {
        dir: &base_dir,
        topic: &base_topic,
        group: &format!("{topic}-base"),
        dlq: &format!("{topic}-base-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    base.run_to_idle(&format!("[steam]\nenabled = true\n{steam}"));
    base.lancedb_uri()
}

/// The `[steam]` section of the scaled-out write path, with a changes topic per test.
fn scaled_out_steam(topic: &str) -> String {
    format!(
        "[steam]\nenabled = true\ncommunities = \"topic\"\nchanges_topic = \"{topic}-changes\"\n"
    )
}

/// Waits (90 s at most) until `uri`'s memories and prototypes equal the
/// reference's at `base_uri`; on failure shows both and `logs`.
fn wait_same_memories_and_prototypes(base_uri: &str, uri: &str, logs: &[(&str, &Pipeline)]) {
    let memories = "SELECT user_id, version, support, content FROM memories ORDER BY memory_id";
    let prototypes = "SELECT users, content FROM prototypes ORDER BY content, users";
    let want = (sql_text(base_uri, memories), sql_text(base_uri, prototypes));
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let got = (
            try_sql_text(uri, memories).unwrap_or_default(),
            try_sql_text(uri, prototypes).unwrap_or_default(),
        );
        if got == want {
            return;
        }
        if Instant::now() >= deadline {
            let logs: String = logs
                .iter()
                .map(|(name, p)| format!("{name}:\n{}\n", p.log_text()))
                .collect();
            panic!(
                "the tables never matched the reference.\nwant:\n{}\n{}\ngot:\n{}\n{}\n{logs}",
                want.0, want.1, got.0, got.1
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The scaled-out write path: two ingest instances (one consumer group, two
/// partitions) form and consolidate memories and publish them to the changes
/// topic; one `steamrf communities` process keeps links, communities and
/// prototypes. The memories and published prototypes equal those of the
/// in-process pipeline over the same events.
#[test]
fn scaled_out_community_writer_matches_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-scale");
    let file = dir.path().join("events.jsonl");
    steam_events(&topic, &file);
    // More users, so that the user-keyed records spread over both partitions.
    let mut text = std::fs::read_to_string(&file).unwrap();
    for u in 4..12 {
        for i in 0..2 {
            text.push_str(&format!(
                "{{\"schema_version\":1,\"event_id\":\"{topic}-x{u}-{i}\",\"timestamp\":{},\"type\":\"click\",\"user_id\":\"user{u}\",\"item_id\":\"jazz{}\"}}\n",
                1_764_000_100_000i64 + u * 10 + i,
                (u + i) % 6
            ));
        }
    }
    std::fs::write(&file, &text).unwrap();
    let (items, rest): (Vec<&str>, Vec<&str>) =
        text.lines().partition(|l| l.contains(r#""type":"item""#));
    let items_file = dir.path().join("items.jsonl");
    let rest_file = dir.path().join("rest.jsonl");
    std::fs::write(&items_file, items.join("\n") + "\n").unwrap();
    std::fs::write(&rest_file, rest.join("\n") + "\n").unwrap();

    let base_uri = in_process_reference(dir.path(), &topic, &file, "");

    // Scaled out: two ingest instances and the writer, on their own tables.
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 4,
        linger_ms: 100,
    };
    let config = cfg.write_with(&scaled_out_steam(&topic));
    let uri = cfg.lancedb_uri();
    let mut writer = Pipeline::start_command("communities", &config, None);
    let mut a = Pipeline::start(&config, None);
    let mut b = Pipeline::start(&config, None);
    // Items first (either instance may write them), then the behaviour.
    produce_all(&topic, 2, &items_file);
    wait_count(
        &uri,
        "SELECT count(*) AS n FROM items",
        9,
        Duration::from_secs(90),
    );
    produce_all(&topic, 2, &rest_file);

    wait_same_memories_and_prototypes(
        &base_uri,
        &uri,
        &[("writer", &writer), ("ingest a", &a), ("ingest b", &b)],
    );
    // How the group split the work (which partition each member got, and
    // when, is up to the broker), and links stay across users.
    let steps = |p: &Pipeline| p.metric("steamrf_steam_memory_steps_total").unwrap_or(0.0);
    eprintln!(
        "memory steps: instance a {}, instance b {}",
        steps(&a),
        steps(&b)
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memory_links WHERE from_user = to_user"
        ),
        0
    );
    assert!(sql_count(&uri, "SELECT count(*) AS n FROM memory_links") > 0);
    for p in [&mut a, &mut b, &mut writer] {
        assert!(p.sigterm().success(), "{}", p.log_text());
    }
}

/// Sharded community writers: the changes topic has 4 partitions keyed by
/// tenant, and two `steamrf communities` processes split them. Six tenants'
/// users click the same catalogue; one writer is killed (-9) mid-stream,
/// the other takes over its partitions and tenants, the killed one comes
/// back and the group splits again. At the end the memories and prototypes
/// equal those of one in-process pipeline over the same events, no link is
/// stored twice, none crosses tenants, and every tenant has its prototype.
#[test]
fn two_sharded_writers_survive_a_kill9_and_match_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-shards");
    let file = dir.path().join("events.jsonl");
    let (tenants, users, clicks) = (6, 4, 6);
    let mut lines = Vec::new();
    let mut n = 0i64;
    let mut ev = |body: String, lines: &mut Vec<String>| {
        n += 1;
        let ts = 1_764_000_000_000i64 + n * 1000;
        lines.push(format!(
            r#"{{"schema_version":1,"event_id":"{topic}-{n}","timestamp":{ts},{body}}}"#
        ));
    };
    let mut items = Vec::new();
    for i in 0..6 {
        ev(
            format!(
                r#""type":"item","item_id":"jazz{i}","title":"Jazz Standards Collection Volume {i}","categories":["Jazz","Bebop"]"#
            ),
            &mut items,
        );
    }
    for c in 0..clicks {
        for t in 0..tenants {
            for u in 0..users {
                ev(
                    format!(
                        r#""type":"click","user_id":"t{t}:user{u}","item_id":"jazz{}""#,
                        (u + c) % 6
                    ),
                    &mut lines,
                );
            }
        }
    }
    let items_file = dir.path().join("items.jsonl");
    let rest_file = dir.path().join("rest.jsonl");
    std::fs::write(&items_file, items.join("\n") + "\n").unwrap();
    std::fs::write(&rest_file, lines.join("\n") + "\n").unwrap();
    std::fs::write(&file, items.join("\n") + "\n" + &lines.join("\n") + "\n").unwrap();

    let sharding = "changes_partitions = 4\n[tenancy]\nseparator = \":\"\n";
    let base_uri = in_process_reference(dir.path(), &topic, &file, sharding);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 6,
        linger_ms: 50,
    };
    let config = cfg.write_with(&format!(
        "{}{sharding}[kafka.properties]\n\"session.timeout.ms\" = \"2000\"\n\"heartbeat.interval.ms\" = \"400\"\n",
        scaled_out_steam(&topic)
    ));
    let uri = cfg.lancedb_uri();
    // The topic exists (with the catalogue) before anyone subscribes.
    produce_all(&topic, 1, &items_file);
    let ingest = Pipeline::start(&config, None);
    wait_count(
        &uri,
        "SELECT count(*) AS n FROM items",
        6,
        Duration::from_secs(60),
    );
    let mut a = Pipeline::start_command("communities", &config, None);
    let b = Pipeline::start_command("communities", &config, None);
    let assigned = "steamrf_source_assigned_partitions";
    for w in [&a, &b] {
        w.wait_metric(assigned, |v| v == 2.0, Duration::from_secs(60));
    }
    // ~8 s of clicks: the kill lands while both writers are busy.
    let mut producer = produce(&topic, 1, &rest_file, Some(18));
    a.wait_metric(
        "steamrf_source_records_committed_total",
        |v| v >= 1.0,
        Duration::from_secs(60),
    );
    std::thread::sleep(Duration::from_millis(
        rand::rngs::StdRng::seed_from_u64(47).random_range(0..600),
    ));
    let before_kill = try_sql_count(&uri, "SELECT count(*) AS n FROM memory_links").unwrap_or(0);
    a.kill9();
    eprintln!(
        "killed writer a with {before_kill} links stored, the producer still running: {}",
        producer.try_wait().unwrap().is_none()
    );
    // The survivor takes every partition once the killed session expires.
    b.wait_metric(assigned, |v| v == 4.0, Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(2));
    let a2 = Pipeline::start_command("communities", &config, None);
    for w in [&a2, &b] {
        w.wait_metric(assigned, |v| v == 2.0, Duration::from_secs(60));
    }
    assert!(producer.wait().unwrap().success());

    assert_eq!(
        sql_count(&base_uri, "SELECT count(*) AS n FROM prototypes"),
        tenants as i64,
        "the reference has one prototype per tenant"
    );
    wait_same_memories_and_prototypes(
        &base_uri,
        &uri,
        &[
            ("writer a", &a),
            ("writer b", &b),
            ("writer a again", &a2),
            ("ingest", &ingest),
        ],
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM (SELECT from_id, to_id, count(*) AS c FROM memory_links GROUP BY from_id, to_id) WHERE c > 1"
        ),
        0,
        "a link stored twice"
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memory_links WHERE split_part(from_user, ':', 1) <> split_part(to_user, ':', 1) OR from_user = to_user"
        ),
        0,
        "a link across tenants, or to the user's own memory"
    );
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(DISTINCT split_part(from_user, ':', 1)) AS n FROM memory_links"
        ),
        tenants as i64
    );
    // Each writer holds only its own tenants' communities.
    let held = |w: &Pipeline| w.metric("steamrf_steam_prototypes").unwrap();
    assert_eq!(held(&b) + held(&a2), tenants as f64);
    assert!(
        held(&b) > 0.0 && held(&a2) > 0.0,
        "{} {}",
        held(&b),
        held(&a2)
    );
    let committed = |w: &Pipeline| w.metric("steamrf_source_records_committed_total");
    eprintln!(
        "changes records committed: writer b {:?}, writer a again {:?}; links {}",
        committed(&b),
        committed(&a2),
        sql_count(&uri, "SELECT count(*) AS n FROM memory_links")
    );
    for w in [&a, &b, &a2] {
        assert_eq!(
            w.log_text().matches("panicked").count(),
            0,
            "{}",
            w.log_text()
        );
    }
}

/// Every process's `/metrics` passes `promtool check metrics`, and every
/// Grafana dashboard query parses (as a recording rule, by `promtool check
/// rules`) and names only metrics those processes export.
#[test]
fn metrics_pass_promtool_and_dashboards_use_exported_metrics() {
    let (dir, topic) = steam_topic("it-metrics");
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let config = cfg.write_with(&scaled_out_steam(&topic));
    let writer = Pipeline::start_command("communities", &config, None);
    let pipeline = Pipeline::start(&config, None);
    let events = std::fs::read_to_string(dir.path().join("events.jsonl"))
        .unwrap()
        .lines()
        .count() as f64;
    pipeline.wait_metric(
        "steamrf_source_records_committed_total",
        |v| v >= events,
        Duration::from_secs(90),
    );
    writer.wait_metric(
        "steamrf_source_records_committed_total",
        |v| v >= 1.0,
        Duration::from_secs(60),
    );
    let service = Service::start(&config);
    let (status, _) = service.post(
        "/v1/retrieve",
        None,
        r#"{"user_id":"user3","query":"jazz","k":3}"#,
    );
    assert_eq!(status, 200);

    let promtool = std::env::var("STEAMRF_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut families = std::collections::BTreeSet::new();
    for (name, port) in [
        ("run", pipeline.metrics_port),
        ("communities", writer.metrics_port),
        ("serve", service.port),
    ] {
        let text = http_get(port, "/metrics").unwrap();
        let mut child = std::process::Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("promtool (Debian package prometheus; scripts/tools.sh installs it)");
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics on {name}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for l in text.lines().filter(|l| l.starts_with("# TYPE ")) {
            let mut parts = l.split_whitespace().skip(2);
            let (n, ty) = (parts.next().unwrap(), parts.next().unwrap());
            families.insert(n.to_owned());
            if ty == "histogram" {
                for s in ["_bucket", "_sum", "_count"] {
                    families.insert(format!("{n}{s}"));
                }
            }
        }
    }

    // Every panel query: a recording rule for promtool, and its metric names.
    let mut rules = String::from("groups:\n  - name: dashboards\n    rules:\n");
    let mut used = std::collections::BTreeSet::new();
    let dashboards = repo_root().join("helm/steamrf/dashboards");
    let mut queries = 0;
    for entry in std::fs::read_dir(&dashboards).unwrap() {
        let path = entry.unwrap().path();
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for p in d["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                let expr = t["expr"].as_str().unwrap();
                queries += 1;
                rules.push_str(&format!(
                    "      - record: steamrf:dashboard:q{queries}\n        expr: {}\n",
                    serde_json::to_string(expr).unwrap()
                ));
                let mut rest = expr;
                while let Some(i) = rest.find("steamrf_") {
                    let name: String = rest[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    rest = &rest[i + name.len()..];
                    used.insert(name);
                }
            }
        }
    }
    assert!(queries >= 20, "{queries} dashboard queries");
    let rules_file = dir.path().join("dashboards.rules.yml");
    std::fs::write(&rules_file, &rules).unwrap();
    let out = std::process::Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&rules_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules:\n{}{}\n{rules}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let missing: Vec<&String> = used.iter().filter(|n| !families.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "dashboards use metrics no process exports: {missing:?}"
    );
}
