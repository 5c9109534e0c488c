//! Who sees what, attacked as the other user (docs/security.md): each test
//! plays the user or tenant a promise protects others from.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support::*;

/// Ben (tenant acme) tells the assistant something private in a conversation about the
/// music four users share. Ann, a member of the same community, asks for
/// collaborative context: she gets the community's prototype (it exists: the
/// test cannot pass by publishing nothing), and it names only the albums
/// that enough of its users chose, never a word Ben wrote, nor an album
/// only Ben chose. The `prototypes` table itself holds none of it either.
#[test]
fn a_prototype_never_quotes_a_member_to_another() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-proto-leak");
    let secret = "HIV diagnosis";
    let only_ben = "Private Pressing Bootleg Tape";
    let mut lines = Vec::new();
    let mut n = 0;
    let mut ev = |body: String| {
        n += 1;
        lines.push(format!(
            r#"{{"schema_version":1,"event_id":"{topic}-{n}","timestamp":{},{body}}}"#,
            1_764_000_000_000i64 + n * 1000
        ));
    };
    let albums = [
        "Kind of Blue Bebop Jazz",
        "Blue Train Bebop Jazz",
        "Giant Steps Bebop Jazz",
    ];
    for (i, t) in albums.iter().enumerate() {
        ev(format!(
            r#""type":"item","item_id":"jazz{i}","title":"{t}","categories":["Jazz","Bebop"]"#
        ));
    }
    ev(format!(
        r#""type":"item","item_id":"bootleg","title":"{only_ben}","categories":["Jazz","Bebop"]"#
    ));
    let users = ["acme:ann", "acme:ben", "acme:cat", "acme:dan"];
    for u in users {
        for i in 0..albums.len() {
            ev(format!(
                r#""type":"click","user_id":"{u}","item_id":"jazz{i}""#
            ));
        }
    }
    ev(r#""type":"click","user_id":"acme:ben","item_id":"bootleg""#.to_owned());
    for u in users {
        // The issue's attack: under 6e978f1 a turn starting with '!' sorted
        // first among the snippets a prototype quoted.
        let text = if u == "acme:ben" {
            format!("!bebop jazz standards got me through my {secret}")
        } else {
            "I love bebop jazz standards".to_owned()
        };
        ev(format!(
            r#""type":"dialogue_turn","user_id":"{u}","session_id":"s-{u}","role":"user","text":"{text}""#
        ));
    }
    produce_lines(dir.path(), &topic, 1, &lines);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "acme-token-0123456789 acme\n").unwrap();
    let config = cfg.write_with(&format!(
        "[tenancy]\nseparator = \":\"\n[steam]\nenabled = true\n[serve]\nrefresh_interval = \"200ms\"\ntokens_file = \"{}\"\n",
        tokens.display()
    ));
    Pipeline::run_to_idle(&config);
    let uri = cfg.lancedb_uri();
    let prototypes = sql_text(&uri, "SELECT users, content FROM prototypes");
    assert!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM prototypes WHERE users >= 3"
        ) >= 1,
        "no community was published, so nothing was attacked: {prototypes}"
    );
    for leak in [secret, "got me through", only_ben, "I love"] {
        assert!(
            !prototypes.contains(leak),
            "{leak:?} is published: {prototypes}"
        );
    }

    let service = Service::start(&config);
    let ask =
        r#"{"user_id":"acme:ann","query":"bebop jazz standards","k":10,"collaborative":true}"#;
    let deadline = Instant::now() + Duration::from_secs(60);
    let answer = loop {
        let (status, body) = service.post("/v1/retrieve", Some("acme-token-0123456789"), ask);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if !v["collaborative"].as_array().unwrap().is_empty() {
            break v;
        }
        assert!(Instant::now() < deadline, "no collaborative answer: {body}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let collab = answer["collaborative"].to_string();
    assert!(
        albums.iter().any(|a| collab.contains(a)),
        "the prototype names none of the shared albums: {collab}"
    );
    let text = answer.to_string();
    for leak in [secret, "got me through", only_ben, "acme:ben", "bootleg"] {
        assert!(!text.contains(leak), "{leak:?} reached ann: {text}");
    }
}

/// A TCP proxy to `target` that forwards until `frozen` is set, then holds
/// every connection, old and new, without a byte either way: an object
/// store that stopped answering.
fn freezable_proxy(target: &'static str) -> (String, Arc<AtomicBool>) {
    use std::io::{Read, Write};
    let frozen = Arc::new(AtomicBool::new(false));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let f = frozen.clone();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(server) = std::net::TcpStream::connect(target) else {
                continue;
            };
            for (mut from, mut to) in [
                (client.try_clone().unwrap(), server.try_clone().unwrap()),
                (server, client),
            ] {
                let f = f.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    loop {
                        while f.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                while f.load(Ordering::Relaxed) {
                                    std::thread::sleep(Duration::from_millis(50));
                                }
                                if to.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
        }
    });
    (addr, frozen)
}

/// A token revoked while the service is stuck reading its tables (the
/// object store stopped answering, after the service started on it) stops
/// working within seconds; the new one works. Under 6e978f1 the tokens file
/// was re-read only between refreshes, so a stuck store kept revoked tokens
/// valid. An emptied tokens file keeps the tokens in force instead of
/// locking every client out, and the scheme is matched without regard to
/// case.
#[test]
fn a_revoked_token_stops_working_while_a_refresh_is_stalled() {
    let dir = tempfile::tempdir().unwrap();
    let (endpoint, frozen) = freezable_proxy("127.0.0.1:8333");
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "old-token-0123456789 acme\n").unwrap();
    let config = dir.path().join("serve.toml");
    let mut options = String::new();
    for (k, v) in S3_OPTIONS {
        let v = if k == "aws_endpoint" {
            endpoint.as_str()
        } else {
            v
        };
        options.push_str(&format!("{k} = \"{v}\"\n"));
    }
    std::fs::write(
        &config,
        format!(
            "[tenancy]\nseparator = \":\"\n[lancedb]\nuri = \"s3://lancedb/{}\"\n\
             [lancedb.storage_options]\n{options}\
             [embed]\nmodel_dir = \"{}\"\nsparse_model_dir = \"{}\"\n\
             [serve]\nrefresh_interval = \"200ms\"\ntokens_file = \"{}\"\n",
            unique("stalled"),
            model_dir().display(),
            sparse_model_dir().display(),
            tokens.display()
        ),
    )
    .unwrap();
    let service = Service::start_until(&config, "/healthz", "ok\n");
    // From now on every read of the tables hangs.
    frozen.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(600));
    // A request that needs no table: authenticated, it is a 400 (no
    // user_id); refused, a 401.
    let ask = |token: &str| service.post("/v1/retrieve", Some(token), "{}").0;
    assert_eq!(ask("old-token-0123456789"), 400, "{}", service.log_text());
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(&tokens, "new-token-0123456789 acme\n").unwrap();
    let rotated = Instant::now();
    while ask("old-token-0123456789") != 401 {
        assert!(
            rotated.elapsed() < Duration::from_secs(5),
            "the revoked token still works {:?} after the rotation:\n{}",
            rotated.elapsed(),
            service.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(ask("new-token-0123456789"), 400);
    // Emptied (a Secret being rewritten): the tokens in force stay.
    std::fs::write(&tokens, "").unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(ask("new-token-0123456789"), 400, "{}", service.log_text());
    assert!(
        service.log_text().contains("holds no tokens"),
        "{}",
        service.log_text()
    );
    // `bearer` in any case.
    for scheme in ["bearer", "BEARER"] {
        let (status, body) = service.post_with_headers(
            "/v1/retrieve",
            &format!("Authorization: {scheme} new-token-0123456789\r\n"),
            "{}",
        );
        assert_eq!(status, 400, "{scheme}: {body}");
    }
}

/// Issue 44, item 2, as tenant globex against tenant acme, both through
/// `POST /v1/events` with their own tokens. Squatting: globex sends
/// acme's next `event_id` first; acme's event is still stored (under
/// 6e978f1 it got a 202 and was dropped as a duplicate). Oracle: globex
/// reuses an `event_id` acme already stored; globex's turn gets its own
/// vector, not acme's (under 6e978f1 the embed stage reused acme's).
#[test]
fn one_tenants_event_ids_neither_hide_nor_stand_in_for_anothers() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-event-ids");
    seed_topic(dir.path(), &topic, 1);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 50,
    };
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        "acme-token-0123456789 acme\nglobex-token-0123456789 globex\n",
    )
    .unwrap();
    let config = cfg.write_with(&format!(
        "[tenancy]\nseparator = \":\"\n[steam]\nenabled = true\n[serve]\nrefresh_interval = \"200ms\"\naccept_events = true\ntokens_file = \"{}\"\n",
        tokens.display()
    ));
    let pipeline = Pipeline::start(&config, None);
    let service = Service::start_until(&config, "/healthz", "ok\n");
    let uri = cfg.lancedb_uri();
    let mut ts = 1_764_000_000_000i64;
    let mut send = |token: &str, user: &str, id: &str, text: &str| {
        ts += 1000;
        let body = format!(
            r#"[{{"schema_version":1,"type":"dialogue_turn","event_id":"{id}","timestamp":{ts},"user_id":"{user}","session_id":"s-{user}","role":"user","text":"{text}"}}]"#
        );
        let (status, answer) = service.post("/v1/events", Some(token), &body);
        assert_eq!(status, 202, "{answer}");
    };
    let stored = |table: &str, id: &str| {
        format!("SELECT count(*) AS n FROM {table} WHERE event_id = '{id}'")
    };
    let wait_count = |uri: &str, sql: &str, want: i64, timeout: Duration| {
        let deadline = Instant::now() + timeout;
        while try_sql_count(uri, sql) != Some(want) {
            assert!(
                Instant::now() < deadline,
                "{sql}: want {want}\n{}\n--- run ---\n{}\n--- serve ---\n{}",
                sql_text(
                    uri,
                    "SELECT user_id, event_id, text FROM interactions ORDER BY event_id"
                ),
                pipeline.log_text(),
                service.log_text()
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    let wait = Duration::from_secs(60);

    // Squatting.
    send(
        "globex-token-0123456789",
        "globex:eve",
        "acme-d-2",
        "globex got here first",
    );
    wait_count(&uri, &stored("interactions", "acme-d-2"), 1, wait);
    send(
        "acme-token-0123456789",
        "acme:ann",
        "acme-d-2",
        "ann loves modal jazz records",
    );
    wait_count(&uri, &stored("interactions", "acme-d-2"), 2, wait);
    wait_count(&uri, &stored("turn_vectors", "acme-d-2"), 2, wait);
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM interactions WHERE event_id = 'acme-d-2' AND user_id = 'acme:ann' AND text LIKE '%modal jazz%'"
        ),
        1,
        "acme's own event is stored as acme sent it"
    );

    // Oracle.
    send(
        "acme-token-0123456789",
        "acme:ann",
        "acme-d-7",
        "my salary is ninety thousand euros",
    );
    wait_count(&uri, &stored("turn_vectors", "acme-d-7"), 1, wait);
    send(
        "globex-token-0123456789",
        "globex:eve",
        "acme-d-7",
        "what is the weather like in Lisbon",
    );
    wait_count(&uri, &stored("turn_vectors", "acme-d-7"), 2, wait);
    let vectors = sql_text(
        &uri,
        "SELECT user_id, embedding FROM turn_vectors WHERE event_id = 'acme-d-7' ORDER BY user_id",
    );
    let of = |user: &str| {
        vectors
            .lines()
            .find(|l| l.contains(user))
            .and_then(|l| l.split_once(user))
            .map(|(_, rest)| rest.trim().to_owned())
            .unwrap_or_else(|| panic!("no vector of {user}: {vectors}"))
    };
    let (ann, eve) = (of("acme:ann"), of("globex:eve"));
    assert!(ann.len() > 100, "{vectors}");
    assert_ne!(ann, eve, "globex's turn was given acme's vector");
    // Each re-send is still stored once, per user.
    send(
        "globex-token-0123456789",
        "globex:eve",
        "acme-d-7",
        "what is the weather like in Lisbon",
    );
    send(
        "acme-token-0123456789",
        "acme:ann",
        "acme-d-8",
        "a later turn, to know the re-send was read",
    );
    wait_count(&uri, &stored("interactions", "acme-d-8"), 1, wait);
    assert_eq!(sql_count(&uri, &stored("interactions", "acme-d-7")), 2);
    drop(service);
    drop(pipeline);
}

/// Issue 44, items 9–10: tables written while every user was one tenant
/// (no `tenancy.separator`) hold links, communities and prototypes between
/// users that a separator later puts in different tenants. Under 6e978f1
/// the pipeline restored them and went on voting and publishing across
/// tenants; now it refuses to start and names `steamrf migrate`, which
/// deletes them, and after it no link joins two tenants.
#[test]
fn links_between_tenants_are_refused_at_start_and_repaired_by_migrate() {
    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-split-tenants");
    let mut lines = Vec::new();
    let mut n = 0;
    let mut ev = |body: String| {
        n += 1;
        lines.push(format!(
            r#"{{"schema_version":1,"event_id":"{topic}-{n}","timestamp":{},{body}}}"#,
            1_764_000_000_000i64 + n * 1000
        ));
    };
    let albums = ["Kind of Blue", "Blue Train", "Giant Steps"];
    for (i, t) in albums.iter().enumerate() {
        ev(format!(
            r#""type":"item","item_id":"jazz{i}","title":"{t}","categories":["Jazz"]"#
        ));
    }
    for u in [
        "acme:ann",
        "acme:ben",
        "acme:cat",
        "globex:gus",
        "globex:hal",
        "globex:ida",
    ] {
        for i in 0..albums.len() {
            ev(format!(
                r#""type":"click","user_id":"{u}","item_id":"jazz{i}""#
            ));
        }
    }
    produce_lines(dir.path(), &topic, 1, &lines);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let one_tenant = cfg.write_with("[tenancy]\nseparator = \"\"\n[steam]\nenabled = true\n");
    Pipeline::run_to_idle(&one_tenant);
    let uri = cfg.lancedb_uri();
    let across = "SELECT count(*) AS n FROM memory_links WHERE split_part(from_user, ':', 1) <> split_part(to_user, ':', 1)";
    assert!(
        sql_count(&uri, across) > 0,
        "nothing links acme to globex, so nothing is attacked"
    );
    let split = dir.path().join("split.toml");
    std::fs::write(
        &split,
        std::fs::read_to_string(&one_tenant)
            .unwrap()
            .replace("separator = \"\"", "separator = \":\""),
    )
    .unwrap();
    let mut refused = Pipeline::start(&split, Some("3s"));
    let status = refused.wait(Duration::from_secs(120));
    let log = refused.log_text();
    assert!(
        !status.success(),
        "started on links between tenants:\n{log}"
    );
    assert!(log.contains("steamrf migrate"), "{log}");
    let out = std::process::Command::new(steamrf_bin())
        .args(["migrate", "--config"])
        .arg(&split)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["links_across_tenants"].as_u64().unwrap() > 0,
        "{report}"
    );
    assert!(
        report["prototypes_across_tenants"].as_u64().unwrap() > 0,
        "{report}"
    );
    assert_eq!(sql_count(&uri, across), 0);
    // The pipeline starts again; its communities stay within tenants.
    Pipeline::run_to_idle(&split);
    assert_eq!(sql_count(&uri, across), 0);
    let again = std::process::Command::new(steamrf_bin())
        .args(["migrate", "--config"])
        .arg(&split)
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(report["links_across_tenants"], 0, "{report}");
}

/// Issue 44, item 8: memory ids can be neither steered nor predicted.
/// Ann has a profile; a client then sends a click of hers whose
/// `event_id` is "profile". Under 6e978f1 that click's memory took the
/// profile memory's id (FNV-1a of user and event) and its row replaced the
/// profile; now both are kept, each under its own keyed 128-bit id. The
/// ids are those the deployment's `steam.id_key` gives, none is the one a
/// client could compute with the public key, and a restart under another
/// key is refused instead of doubling every profile.
#[test]
fn memory_ids_can_be_neither_steered_nor_predicted() {
    use steamrf_operators::steam::IdKey;

    let dir = tempfile::tempdir().unwrap();
    let topic = unique("it-memory-ids");
    let ts = 1_764_000_000_000i64;
    let lines = [
        format!(
            r#"{{"schema_version":1,"type":"item","event_id":"{topic}-i","timestamp":{ts},"item_id":"jazz0","title":"Kind of Blue","categories":["Jazz"]}}"#
        ),
        format!(
            r#"{{"schema_version":1,"type":"profile","event_id":"p-ann","timestamp":{},"user_id":"ann","attributes":{{"age":31,"likes":"jazz piano"}}}}"#,
            ts + 1000
        ),
        format!(
            r#"{{"schema_version":1,"type":"click","event_id":"profile","timestamp":{},"user_id":"ann","item_id":"jazz0"}}"#,
            ts + 2000
        ),
    ];
    produce_lines(dir.path(), &topic, 1, &lines);
    let cfg = PipelineConfig {
        dir: dir.path(),
        topic: &topic,
        group: &format!("{topic}-g"),
        dlq: &format!("{topic}-dlq"),
        max_rows: 1000,
        linger_ms: 100,
    };
    let secret = "it-deployment-secret";
    let config = cfg.write_with(&format!("[steam]\nenabled = true\nid_key = \"{secret}\"\n"));
    Pipeline::run_to_idle(&config);
    let uri = cfg.lancedb_uri();
    let id_of = |filter: &str| {
        let text = sql_text(
            &uri,
            &format!("SELECT memory_id FROM memories WHERE user_id = 'ann' AND {filter}"),
        );
        let ids: Vec<&str> = text
            .split(|c: char| !c.is_ascii_hexdigit())
            .filter(|w| w.len() == 32)
            .collect();
        assert_eq!(ids.len(), 1, "{filter}: {text}");
        ids[0].to_owned()
    };
    let everything = || sql_text(&uri, "SELECT memory_id, content FROM memories");
    assert_eq!(
        sql_count(
            &uri,
            "SELECT count(*) AS n FROM memories WHERE user_id = 'ann'"
        ),
        2,
        "the click called \"profile\" and the profile are two memories:\n{}",
        everything()
    );
    let key = IdKey::from_secret(secret);
    assert_eq!(
        id_of("content LIKE 'User profile:%jazz piano%'"),
        key.profile("ann").to_string(),
        "the profile memory kept its content and its id:\n{}",
        everything()
    );
    assert_eq!(
        id_of("content NOT LIKE 'User profile:%'"),
        key.memory("ann", "profile").to_string()
    );
    let public = IdKey::default();
    let predicted = format!(
        "SELECT count(*) AS n FROM memories WHERE memory_id IN ('{}', '{}')",
        public.profile("ann"),
        public.memory("ann", "profile")
    );
    assert_eq!(sql_count(&uri, &predicted), 0, "{}", everything());

    // Another key would give the same user and events other ids.
    let other = dir.path().join("other-key.toml");
    std::fs::write(
        &other,
        std::fs::read_to_string(&config)
            .unwrap()
            .replace(secret, "another-secret"),
    )
    .unwrap();
    let mut refused = Pipeline::start(&other, Some("3s"));
    let status = refused.wait(Duration::from_secs(120));
    let log = refused.log_text();
    assert!(!status.success(), "started under another id key:\n{log}");
    assert!(log.contains("steam.id_key"), "{log}");
}

/// Issue 44, item 3: one user with a huge history (60,000 turns of 1 KB,
/// sessions of 1,000 turns), asked for by 16 clients at once while a new
/// turn of theirs lands every 500 ms (so each refresh evicts them), stalls
/// no one, with two threads spinning on the machine meanwhile: the other
/// users are answered throughout, `/healthz` within a
/// second, the replica's RSS stays within `serve.cache_bytes` + 300 MiB,
/// answers carry bounded text, and the service reads the user once per
/// change, not once per client. The latency target (others' p99 under
/// 100 ms) is `steamrf bench hammer`'s to report (docs/security.md);
/// here a second would mean starvation.
#[test]
fn one_hammered_huge_user_starves_no_one() {
    let (text, r) = steamrf_result([
        "bench",
        "hammer",
        "--big-rows",
        "60000",
        "--users",
        "50",
        "--requests",
        "200",
        "--duration",
        "8s",
        "--cache-bytes",
        "128MiB",
        // Under CPU load: fills overlap more, and the RSS bound failed
        // only then (443 MiB against 428 on a new machine).
        "--busy-threads",
        "2",
    ]);
    assert_eq!(r["other_errors"], 0.0, "{text}");
    assert_eq!(r["big_errors"], 0.0, "{text}");
    assert!(r["big_ok"] > 0.0, "{text}");
    assert!(r["other_p99_ms"] < 1000.0, "{text}");
    assert!(r["healthz_max_ms"] < 1000.0, "{text}");
    assert_eq!(r["healthz_failed"], 0.0, "{text}");
    assert!(r["rss_peak_mib"] <= r["rss_budget_mib"], "{text}");
    // Ten items of at most serve.max_item_bytes (8 KiB) each, with their
    // provenance: a session of 1,000 turns is never handed over whole.
    assert!(r["answer_bytes_max"] < 120_000.0, "{text}");
    // The 50 others once each, and u0 once per change (and once at first):
    // not once per client.
    assert!(
        r["user_reads"] <= 50.0 + r["big_writes"] + 2.0,
        "concurrent misses for one user were not shared: {text}"
    );
}
