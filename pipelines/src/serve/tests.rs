use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use futures::future::BoxFuture;
use serde_json::{Value, json};
use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_operators::embed::Embedder;
use steamrf_operators::passage;
use steamrf_operators::rank;
use steamrf_operators::rfmem::{self, RfMemParams};
use steamrf_operators::steam::memory::{Memory, Observation, UserMemories};
use steamrf_operators::steam::{MemoryId, SteamParams, SteamState};
use steamrf_schemas::tables::EMBEDDING_DIM;
use tokio::sync::Semaphore;

use super::auth::Auth;
use super::cache::{Changes, Entry, EntryKind, ItemInfo, Loader, UserCorpus, UserData};
use super::recommend::rank;
use super::*;
use crate::config::ServeConfig;

fn unit(axis: &[(usize, f32)]) -> Vec<f32> {
    let mut v = vec![0.0f32; EMBEDDING_DIM];
    for &(i, x) in axis {
        v[i] = x;
    }
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    v
}

fn obs(event: &str, item: &str, v: Vec<f32>) -> Observation {
    Observation {
        event_id: event.into(),
        timestamp_ms: 0,
        embedding: v,
        item_id: Some(item.into()),
        title: Some(item.into()),
        categories: vec!["jazz".into()],
        text: None,
    }
}

fn config() -> ServeConfig {
    Config::load_with_env(None, []).unwrap().serve
}

/// Three acme users who like jazz (a published prototype), and a globex
/// user with the very same taste, who must stay invisible to acme.
fn steam_state() -> SteamState {
    let params = SteamParams {
        tenant_separator: Some(':'),
        ..SteamParams::default()
    };
    let mut steam = SteamState::new(params, EMBEDDING_DIM);
    let jazz = |i: f32| unit(&[(0, 1.0), (1, 0.1 * i)]);
    let o = steam
        .observe(vec![
            ("acme:ann".into(), obs("a1", "blue-train", jazz(1.0))),
            ("acme:ben".into(), obs("b1", "dave", jazz(2.0))),
            // Only ben chose it: never named to ann.
            ("acme:ben".into(), obs("b2", "rare-bootleg", jazz(2.0))),
            ("acme:cat".into(), obs("c1", "dave", jazz(1.5))),
            ("globex:dan".into(), obs("d1", "secret-album", jazz(1.2))),
            ("globex:eve".into(), obs("e1", "x", jazz(1.3))),
            ("globex:fay".into(), obs("f1", "y", jazz(1.4))),
        ])
        .unwrap();
    steam.link(&CpuKernel::default(), &o.changed).unwrap();
    steam
}

/// A user's passage windows: their vectors, each one's row and turns.
#[derive(Clone, Default)]
struct Windows {
    vectors: Vec<f32>,
    owner: Vec<u32>,
    spans: Vec<(u32, u32)>,
}

/// The users' rows and memories, as the tables would give them.
struct Fixed {
    steam: SteamState,
    corpora: HashMap<String, (Vec<Entry>, Vec<f32>)>,
    /// Users whose sessions have passage windows (answered as units).
    windows: HashMap<String, Windows>,
    /// Items each user interacted with, oldest first.
    histories: HashMap<String, Vec<String>>,
}

impl Loader for Fixed {
    fn user<'a>(
        &'a self,
        _cfg: &'a ServeConfig,
        _snap: &'a Snapshot,
        user_id: &'a str,
    ) -> BoxFuture<'a, Result<UserData>> {
        Box::pin(async move {
            let (entries, rows) = self.corpora.get(user_id).cloned().unwrap_or_default();
            let store = |rows: Vec<f32>| {
                rfmem::VectorStore::flat(
                    Corpus::from_vec(rows, EMBEDDING_DIM).unwrap(),
                    CpuKernel::default(),
                )
            };
            let lexical = steamrf_operators::lexical::Bm25Index::new(
                entries.iter().map(|e| e.content.as_str()),
                Default::default(),
            );
            let index = match self.windows.get(user_id).cloned() {
                None => passage::PassageIndex::new(
                    store(rows),
                    store(Vec::new()),
                    Vec::new(),
                    Some(lexical),
                )
                .unwrap(),
                // As the cache builds it: no row-level BM25, the windows'
                // own text for the units'.
                Some(w) => {
                    let texts: Vec<&str> = w
                        .owner
                        .iter()
                        .zip(&w.spans)
                        .map(|(&r, &(a, b))| entries[r as usize].turns_text(a as usize, b as usize))
                        .collect();
                    let units = passage::Units::new(
                        w.spans.clone(),
                        Some(steamrf_operators::lexical::Bm25Index::new(
                            texts,
                            Default::default(),
                        )),
                    );
                    passage::PassageIndex::new(store(rows), store(w.vectors), w.owner, None)
                        .and_then(|ix| ix.with_units(units))
                        .unwrap()
                }
            };
            Ok(UserData {
                corpus: UserCorpus { entries, index },
                memories: UserMemories {
                    user_id: user_id.to_owned(),
                    memories: self
                        .steam
                        .user(user_id)
                        .map(|u| u.memories.clone())
                        .unwrap_or_default(),
                },
                unresolved: false,
                history: self.histories.get(user_id).cloned().unwrap_or_default(),
                rows_cut: 0,
                bytes: 1000,
            })
        })
    }

    fn memories<'a>(&'a self, ids: &'a [MemoryId]) -> BoxFuture<'a, Result<Vec<Memory>>> {
        Box::pin(async move {
            Ok(ids
                .iter()
                .filter_map(|&id| self.steam.memory(id).cloned())
                .collect())
        })
    }
}

fn fixed() -> Fixed {
    let jazz = |i: f32| unit(&[(0, 1.0), (1, 0.1 * i)]);
    let entries = vec![
        Entry {
            kind: EntryKind::Dialogue,
            id: "t1".into(),
            content: "user: I love Coltrane's ballads".into(),
            table: "interactions",
            source_event_ids: vec!["t1".into()],
            source: Some((0, 41)),
            windows: Vec::new(),
            turn_ends: Vec::new(),
        },
        Entry {
            kind: EntryKind::Dialogue,
            id: "t2".into(),
            content: "user: my cat is called Miles".into(),
            table: "interactions",
            source_event_ids: vec!["t2".into()],
            source: Some((0, 42)),
            windows: Vec::new(),
            turn_ends: Vec::new(),
        },
    ];
    let mut rows = jazz(0.5);
    rows.extend(unit(&[(5, 1.0)]));
    let (sessions, session_rows, windows) = two_sessions();
    Fixed {
        steam: steam_state(),
        corpora: HashMap::from([
            ("acme:ann".to_owned(), (entries, rows)),
            ("acme:sam".to_owned(), (sessions, session_rows)),
        ]),
        windows: HashMap::from([("acme:sam".to_owned(), windows)]),
        histories: HashMap::from([("acme:ann".to_owned(), vec!["blue-train".to_owned()])]),
    }
}

/// acme:sam's two sessions: s0 (9 turns) with windows over turns 6..9
/// (cosine 0.99 to axis 0) and 0..3 (0.90), s1 (3 turns) with one over
/// 0..3 (0.95). Asked along axis 0, the windows rank s0 6..9, s1, s0 0..3.
fn two_sessions() -> (Vec<Entry>, Vec<f32>, Windows) {
    let session = |id: &str, turns: usize| {
        let lines: Vec<String> = (0..turns).map(|t| format!("user: {id} turn {t}")).collect();
        let mut ends = Vec::new();
        let mut at = 0u32;
        for l in &lines {
            at += l.len() as u32;
            ends.push(at);
            at += 1;
        }
        Entry {
            kind: EntryKind::Session,
            id: id.into(),
            content: lines.join("\n"),
            table: "interactions",
            source_event_ids: (0..turns).map(|t| format!("{id}-e{t}")).collect(),
            source: Some((0, 1)),
            windows: Vec::new(),
            turn_ends: ends,
        }
    };
    let (mut s0, mut s1) = (session("s0", 9), session("s1", 3));
    let win = |id: &str, start: u32, end: u32| cache::Window {
        event_id: format!("{id}-e{}", end - 1),
        start,
        end,
    };
    s0.windows = vec![win("s0", 6, 9), win("s0", 0, 3)];
    s1.windows = vec![win("s1", 0, 3)];
    let at = |cos: f32| unit(&[(0, cos), (7, (1.0 - cos * cos).sqrt())]);
    let mut rows = unit(&[(0, 1.0)]);
    rows.extend(at(0.9));
    let mut vectors = at(0.99);
    vectors.extend(at(0.90));
    vectors.extend(at(0.95));
    (
        vec![s0, s1],
        rows,
        Windows {
            vectors,
            owner: vec![0, 0, 1],
            spans: vec![(6, 9), (0, 3), (0, 3)],
        },
    )
}

/// The shared part: the catalogue and the published prototypes.
fn snapshot() -> Snapshot {
    let jazz = |i: f32| unit(&[(0, 1.0), (1, 0.1 * i)]);
    let mut items = HashMap::new();
    items.insert(
        "dave".to_owned(),
        ItemInfo {
            title: "Dave".into(),
            embedding: jazz(1.8),
        },
    );
    items.insert(
        "far".to_owned(),
        ItemInfo {
            title: "Far".into(),
            embedding: unit(&[(9, 1.0)]),
        },
    );
    let prototypes = steam_state()
        .prototypes()
        .map(|p| (p.id, p.clone()))
        .collect();
    let mut s = Snapshot::new(items, prototypes);
    s.versions = BTreeMap::from([("interactions", 3)]);
    s
}

async fn start(auth: Auth, publish: bool) -> (String, Arc<AppState>) {
    start_with(auth, publish, |_| {}, None).await
}

/// A service on a free port, served as `steamrf serve` serves it.
async fn start_with(
    auth: Auth,
    publish: bool,
    tweak: impl FnOnce(&mut ServeConfig),
    embedder: Option<Arc<dyn Embedder>>,
) -> (String, Arc<AppState>) {
    let mut cfg = config();
    cfg.max_request_bytes = crate::config::ByteSize(64 * 1024);
    tweak(&mut cfg);
    let (header_timeout, max_connections) = (cfg.header_timeout, cfg.max_connections);
    let st = Arc::new(
        AppState::new(
            cfg,
            Some(':'),
            embedder,
            auth,
            ServeMetrics::new(),
            Snapshot::default(),
            Arc::new(fixed()),
        )
        // "dave" (ben and cat) is named to ann, "rare-bootleg" (ben) is not.
        .with_min_users(2),
    );
    if publish {
        st.publish(snapshot());
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(crate::http::serve_connections(
        listener,
        router(st.clone()),
        header_timeout,
        max_connections,
        std::future::pending(),
    ));
    (format!("http://{addr}"), st)
}

async fn post(base: &str, path: &str, token: Option<&str>, body: &str) -> (u16, Value) {
    let mut r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn qv(v: &[f32]) -> Value {
    json!(v)
}

#[tokio::test]
async fn retrieve_answers_with_provenance_explanation_and_the_community() {
    let (base, _) = start(Auth::open(), true).await;
    let q = unit(&[(0, 1.0), (1, 0.05)]);
    let (status, v) = post(
        &base,
        "/v1/retrieve",
        None,
        &json!({"user_id": "acme:ann", "query_vector": qv(&q), "k": 2}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 2);
    assert_eq!(items[0]["id"], "t1");
    assert_eq!(items[0]["kind"], "dialogue");
    assert_eq!(items[0]["provenance"]["table"], "interactions");
    assert_eq!(items[0]["provenance"]["offset"], 41);
    let ex = &v["explanation"];
    assert_eq!(ex["corpus_rows"], 2);
    assert!(ex["path"] == "familiarity" || ex["path"] == "recollection");
    assert!(ex["probe"]["k"].as_u64().unwrap() >= 1);
    assert!(ex["latency"]["total_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(ex["table_versions"]["interactions"], 3);
    // The acme jazz community is published (3 users); its other users show
    // up only as memory ids and the items enough of them chose (min_users
    // 2 here), and globex (same taste) not at all.
    let collab = v["collaborative"].as_array().unwrap();
    assert_eq!(collab.len(), 1, "{v}");
    assert_eq!(collab[0]["users"], 3);
    let text = v.to_string();
    assert!(
        !text.contains("secret-album")
            && !text.contains("globex")
            && !text.contains("rare-bootleg"),
        "{text}"
    );
    assert!(
        collab[0]["item_ids"]
            .as_array()
            .unwrap()
            .contains(&json!("dave"))
    );
    // Forced paths, and the local-to-global step switched off.
    for mode in ["familiarity", "recollection"] {
        let (status, v) = post(
            &base,
            "/v1/retrieve",
            None,
            &json!({"user_id": "acme:ann", "query_vector": qv(&q), "options": {"mode": mode}, "collaborative": false})
                .to_string(),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["explanation"]["path"], mode);
        assert_eq!(v["explanation"]["rule"], "forced");
        assert!(v["collaborative"].as_array().unwrap().is_empty());
    }
    // A user the tables do not know: an empty answer, not an error.
    let (status, v) = post(
        &base,
        "/v1/retrieve",
        None,
        &json!({"user_id": "acme:nobody", "query_vector": qv(&q)}).to_string(),
    )
    .await;
    assert_eq!(status, 200);
    assert!(v["items"].as_array().unwrap().is_empty());
}

#[test]
fn without_a_k_the_turn_budget_alone_bounds_the_units() {
    let p = RfMemParams {
        k: 10,
        ..RfMemParams::default()
    };
    let req = |body: Value| -> RetrieveRequest {
        steamrf_schemas::api::parse(body.to_string().as_bytes()).unwrap()
    };
    let no_k = req(json!({"user_id": "u", "query": "x"}));
    let b = retrieve::unit_budget(&no_k, &p, 30);
    assert_eq!((b.units, b.turns), (30, 30), "as many units as turns");
    // A budget below k keeps k: the turns bound it anyway.
    assert_eq!(retrieve::unit_budget(&no_k, &p, 4).units, 10);
    for asked in [
        json!({"user_id": "u", "query": "x", "k": 10}),
        json!({"user_id": "u", "query": "x", "options": {"k": 10}}),
    ] {
        let b = retrieve::unit_budget(&req(asked), &p, 30);
        assert_eq!((b.units, b.turns), (10, 30), "k units at most");
    }
}

#[tokio::test]
async fn per_session_spreads_an_answer_over_sessions() {
    let (base, _) = start(Auth::open(), false).await;
    let q = qv(&unit(&[(0, 1.0)]));
    let ask = |extra: Value| {
        let mut body = json!({"user_id": "acme:sam", "query_vector": q, "k": 3,
            "options": {"mode": "familiarity"}});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    let spans = |v: &Value| -> Vec<(String, u64, u64)> {
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                (
                    i["id"].as_str().unwrap().to_owned(),
                    i["passage"]["start"].as_u64().unwrap(),
                    i["passage"]["end"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let s = |id: &str, a, b| (id.to_owned(), a, b);
    // The configured default (no cap): s0 gives two units.
    let (status, v) = post(&base, "/v1/retrieve", None, &ask(json!({}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        spans(&v),
        [s("s0", 6, 9), s("s1", 0, 3), s("s0", 0, 3)],
        "{v}"
    );
    // One unit per session: s0's second place goes.
    let (status, v) = post(&base, "/v1/retrieve", None, &ask(json!({"per_session": 1}))).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(spans(&v), [s("s0", 6, 9), s("s1", 0, 3)], "{v}");
    assert_eq!(
        v["items"][1]["provenance"]["source_event_ids"],
        json!(["s1-e0", "s1-e1", "s1-e2"])
    );
    // 0 is no cap, as configured.
    let (_, v) = post(&base, "/v1/retrieve", None, &ask(json!({"per_session": 0}))).await;
    assert_eq!(spans(&v).len(), 3, "{v}");
    // Not a count: a 400 naming the field.
    let (status, v) = post(
        &base,
        "/v1/retrieve",
        None,
        &ask(json!({"per_session": -1})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["field"], "per_session", "{v}");
}

#[tokio::test]
async fn bad_requests_get_a_400_naming_the_field() {
    let (base, st) = start(Auth::open(), true).await;
    let q = unit(&[(0, 1.0)]);
    let cases = [
        (
            json!({"user_id": "acme:ann", "query_vector": qv(&q), "querry": 1}).to_string(),
            "querry",
        ),
        (json!({"query_vector": qv(&q)}).to_string(), "user_id"),
        (
            json!({"user_id": "", "query_vector": qv(&q)}).to_string(),
            "user_id",
        ),
        (json!({"user_id": "acme:ann"}).to_string(), "query"),
        (
            json!({"user_id": "acme:ann", "query": "jazz", "query_vector": qv(&q)}).to_string(),
            "query",
        ),
        (
            json!({"user_id": "acme:ann", "query": "jazz"}).to_string(),
            "query",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": [1.0, 2.0]}).to_string(),
            "query_vector",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": vec![0.0; 384]}).to_string(),
            "query_vector",
        ),
        (
            format!(
                "{{\"user_id\": \"acme:ann\", \"query_vector\": [1e39{}]}}",
                ", 0.5".repeat(383)
            ),
            "query_vector",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": ["a"]}).to_string(),
            "query_vector[0]",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": qv(&q), "k": 0}).to_string(),
            "k",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": qv(&q), "options": {"alpha": 2.0}})
                .to_string(),
            "options.alpha",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": qv(&q), "options": {"alhpa": 0.5}})
                .to_string(),
            "options.alhpa",
        ),
        (
            json!({"user_id": "acme:ann", "query_vector": qv(&q), "options": {"mode": "psychic"}})
                .to_string(),
            "options.mode",
        ),
        ("{not json".to_owned(), "body"),
    ];
    for (body, field) in cases {
        let (status, v) = post(&base, "/v1/retrieve", None, &body).await;
        assert_eq!(status, 400, "{body:.80}: {v}");
        assert_eq!(v["error"]["code"], "invalid_request");
        assert_eq!(v["error"]["field"], field, "{body:.80}: {v}");
    }
    for (body, field) in [
        (
            json!({"user_id": "acme:ann", "candidates": []}),
            "candidates",
        ),
        (
            json!({"user_id": "acme:ann", "candidates": ["dave", ""]}),
            "candidates[1]",
        ),
        (
            json!({"user_id": "acme:ann", "candidates": "dave"}),
            "candidates",
        ),
        (
            json!({"user_id": "acme:ann", "candidates": ["dave"], "k": 0}),
            "k",
        ),
    ] {
        let (status, v) = post(&base, "/v1/recommend", None, &body.to_string()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["field"], field, "{body}: {v}");
    }
    // Too large: 413 before parsing.
    let huge = format!("{{\"user_id\": \"{}\"}}", "x".repeat(100_000));
    assert_eq!(post(&base, "/v1/retrieve", None, &huge).await.0, 413);
    // Unknown route: a JSON 404.
    let (status, v) = post(&base, "/v1/nope", None, "{}").await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    // The service kept serving, and counted the rejections.
    let (status, _) = post(
        &base,
        "/v1/retrieve",
        None,
        &json!({"user_id": "acme:ann", "query_vector": qv(&q)}).to_string(),
    )
    .await;
    assert_eq!(status, 200);
    let m = st.metrics.render();
    assert!(
        m.contains("steamrf_serve_requests_total{route=\"retrieve\",status=\"400\"} 15"),
        "{m}"
    );
}

#[tokio::test]
async fn tokens_are_scoped_to_tenants() {
    let auth = Auth::parse("acme-reader-0123456789 acme\nadmin-token-0123456789 *\n").unwrap();
    let (base, _) = start(auth, true).await;
    let q = unit(&[(0, 1.0)]);
    let body = |user: &str| json!({"user_id": user, "query_vector": qv(&q)}).to_string();
    let (status, v) = post(&base, "/v1/retrieve", None, &body("acme:ann")).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("unauthenticated"))
    );
    let (status, _) = post(
        &base,
        "/v1/retrieve",
        Some("wrong-token-0123456789"),
        &body("acme:ann"),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = post(
        &base,
        "/v1/retrieve",
        Some("acme-reader-0123456789"),
        &body("acme:ann"),
    )
    .await;
    assert_eq!(status, 200);
    let (status, v) = post(
        &base,
        "/v1/retrieve",
        Some("acme-reader-0123456789"),
        &body("globex:dan"),
    )
    .await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["field"], "user_id");
    let rec = json!({"user_id": "globex:dan", "candidates": ["dave"]}).to_string();
    assert_eq!(
        post(&base, "/v1/recommend", Some("acme-reader-0123456789"), &rec)
            .await
            .0,
        403
    );
    assert_eq!(
        post(&base, "/v1/recommend", Some("admin-token-0123456789"), &rec)
            .await
            .0,
        200
    );
}

/// Attempts to cross the tenant boundary: other tenants' users under any
/// spelling, users without a tenant, a token in the wrong place; and what an
/// allowed answer reveals about another tenant with the same taste (nothing).
#[tokio::test]
async fn the_tenant_boundary_cannot_be_crossed() {
    let auth = Auth::parse("acme-reader-0123456789 acme\n").unwrap();
    let (base, _) = start(auth, true).await;
    let token = Some("acme-reader-0123456789");
    let q = unit(&[(0, 1.0), (1, 0.12)]);
    for user in [
        "globex:dan",
        "GLOBEX:dan",
        "Acme:ann",
        " acme:ann",
        "globex",
        "dan",
        "globex:acme:ann",
    ] {
        let body = json!({"user_id": user, "query_vector": qv(&q)}).to_string();
        let (status, v) = post(&base, "/v1/retrieve", token, &body).await;
        assert_eq!(status, 403, "{user:?}: {v}");
        assert_eq!(v["error"]["field"], "user_id");
        let rec = json!({"user_id": user, "candidates": ["dave", "secret-album"]}).to_string();
        assert_eq!(
            post(&base, "/v1/recommend", token, &rec).await.0,
            403,
            "{user:?}"
        );
    }
    // The token must be a bearer token in the header, exactly.
    for header in [
        "acme-reader-0123456789",
        "Bearer acme-reader-012345678",
        "Basic acme-reader-0123456789",
    ] {
        let resp = reqwest::Client::new()
            .post(format!("{base}/v1/retrieve"))
            .header("authorization", header)
            .body(json!({"user_id": "acme:ann", "query": "jazz"}).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{header:?}");
    }
    // Allowed: acme's own user, with the local-to-global step. globex has
    // the same taste and its own published community: none of it shows.
    for mode in ["familiarity", "recollection"] {
        let body = json!({"user_id": "acme:ann", "query_vector": qv(&q), "k": 10,
            "options": {"mode": mode}, "collaborative": true})
        .to_string();
        let (status, v) = post(&base, "/v1/retrieve", token, &body).await;
        assert_eq!(status, 200, "{v}");
        let text = v.to_string();
        // globex's users, items and event ids.
        for leak in ["globex", "secret-album", "\"d1\"", "\"e1\"", "\"f1\""] {
            assert!(!text.contains(leak), "{leak} leaked: {text}");
        }
        // Other acme users appear only as ids: never a user id or their text.
        for other in ["acme:ben", "acme:cat"] {
            assert!(!text.contains(other), "{other} leaked: {text}");
        }
    }
    let rec =
        json!({"user_id": "acme:ann", "candidates": ["dave", "secret-album", "far"]}).to_string();
    let (status, v) = post(&base, "/v1/recommend", token, &rec).await;
    assert_eq!(status, 200, "{v}");
    let text = v.to_string();
    assert!(
        !text.contains("globex") && !text.contains("\"d1\""),
        "{text}"
    );
}

#[tokio::test]
async fn recommend_ranks_with_reasons_and_unknown_items_last() {
    let (base, _) = start(Auth::open(), true).await;
    let (status, v) = post(
        &base,
        "/v1/recommend",
        None,
        &json!({"user_id": "acme:ann", "candidates": ["mystery", "far", "dave"]}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let ranked = v["ranked"].as_array().unwrap();
    let ids: Vec<&str> = ranked
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["dave", "far", "mystery"]);
    assert!(ranked[0]["seen"].as_f64().unwrap() > 0.0);
    assert!(ranked[0]["neighbours"].as_f64().unwrap() > 0.0);
    let reason = ranked[0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("similar users") && reason.contains("users like you"),
        "{v}"
    );
    assert!(
        ranked[2]["reason"]
            .as_str()
            .unwrap()
            .starts_with("unknown item")
    );
}

#[tokio::test]
async fn a_fused_ranker_follows_its_weights_and_reports_each_signal() {
    // Item-CF weighs most: "far" was chosen by both users who chose ann's
    // "blue-train"; STEAM prefers "dave" (her community's choice).
    let (base, st) = start_with(
        Auth::open(),
        false,
        |c| {
            c.ranker.steam = 0.2;
            c.ranker.item_cf = 0.8;
        },
        None,
    )
    .await;
    let mut snap = snapshot();
    // Globex's users (another tenant) choose "dave" by the dozen and tie it
    // to "blue-train": acme's ranking must not move (issue 44, items 9–10).
    let globex: Vec<String> = (0..40).map(|n| format!("globex:g{n}")).collect();
    let mut pairs = vec![
        ("acme:x1", "blue-train"),
        ("acme:x1", "far"),
        ("acme:x2", "blue-train"),
        ("acme:x2", "far"),
        ("acme:x3", "dave"),
    ];
    for g in &globex {
        pairs.push((g, "dave"));
        pairs.push((g, "blue-train"));
    }
    snap.item_cf = Some(Arc::new(rank::TenantItemCf::new(pairs, Some(':'))));
    st.publish(snap);
    let (status, v) = post(
        &base,
        "/v1/recommend",
        None,
        &json!({"user_id": "acme:ann", "candidates": ["dave", "far", "mystery"]}).to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let ranked = v["ranked"].as_array().unwrap();
    let ids: Vec<&str> = ranked
        .iter()
        .map(|r| r["item_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["far", "dave", "mystery"], "{v}");
    assert_eq!(ranked[0]["signals"]["item_cf"], 1.0);
    assert_eq!(ranked[1]["signals"]["popularity"], 1.0);
    assert!(
        ranked[0]["signals"]["steam"].as_f64().unwrap()
            < ranked[1]["signals"]["steam"].as_f64().unwrap()
    );
    assert!(
        ranked[0]["reason"].as_str().unwrap().contains("item-CF"),
        "{v}"
    );
    assert!(ranked[2].get("signals").is_none());
    assert_eq!(v["truncated"], false);

    // Issue 44, items 9–10: ranker work honours the request deadline. Past
    // it the fusion stops; the answer keeps STEAM's order and says so.
    let view = st
        .view("acme:ann", true, Instant::now() + Duration::from_secs(5))
        .await
        .unwrap();
    let req: RecommendRequest = serde_json::from_value(
        json!({"user_id": "acme:ann", "candidates": ["dave", "far", "mystery"]}),
    )
    .unwrap();
    let cut = rank(&st, &view, req, Instant::now());
    assert!(cut.truncated);
    let ids: Vec<&str> = cut.ranked.iter().map(|r| r.item_id.as_str()).collect();
    assert_eq!(ids, ["dave", "far", "mystery"], "STEAM's order");
    assert!(cut.ranked.iter().all(|r| r.signals.is_none()));
    assert_eq!(
        st.metrics.cut.with_label_values(&["rank_deadline"]).get(),
        1
    );
}

#[tokio::test]
async fn readiness_waits_for_the_first_snapshot_and_openapi_is_served() {
    let (base, st) = start(Auth::open(), false).await;
    let get = |p: &'static str| {
        let base = base.clone();
        async move {
            let r = reqwest::get(format!("{base}{p}")).await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    assert_eq!(get("/healthz").await.0, 200);
    assert_eq!(get("/readyz").await.0, 503);
    st.publish(snapshot());
    assert_eq!(get("/readyz").await.0, 200);
    let (status, doc) = get("/openapi.json").await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&doc).unwrap();
    for path in [
        "/v1/retrieve",
        "/v1/recommend",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(
            doc["paths"].get(path).is_some(),
            "{path} missing from docs/openapi.json"
        );
    }
    // The documented request fields are exactly the accepted ones.
    let props = |schema: &str| -> Vec<String> {
        let mut v: Vec<String> = doc["components"]["schemas"][schema]["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        props("RetrieveRequest"),
        [
            "collaborative",
            "k",
            "max_turns",
            "options",
            "per_session",
            "query",
            "query_vector",
            "user_id"
        ]
    );
    assert_eq!(props("RecommendRequest"), ["candidates", "k", "user_id"]);
    let mut options: Vec<String> = serde_json::to_value(RfMemParams::default())
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    options.sort();
    assert_eq!(props("RfMemOptions"), options);
    let (status, metrics) = get("/metrics").await;
    assert_eq!(status, 200);
    assert!(metrics.contains("steamrf_serve_cache_bytes 0"), "{metrics}");
}

#[test]
fn every_serve_metric_is_documented() {
    crate::metrics::assert_documented(&ServeMetrics::new().render(), 15);
}

#[tokio::test]
async fn options_may_not_ask_for_more_work_than_the_server_allows() {
    let (base, _) = start(Auth::open(), true).await;
    let q = qv(&unit(&[(0, 1.0)]));
    for (options, k, field, limit) in [
        (json!({"beam": 10_000}), None, "options.beam", "4"),
        (json!({"fanout": 2}), None, "options.fanout", "1"),
        (json!({"depth": 11}), None, "options.depth", "10"),
        (
            json!({"max_candidates": 10_000}),
            None,
            "options.max_candidates",
            "4096",
        ),
        (
            json!({"kmeans_iters": 1000}),
            None,
            "options.kmeans_iters",
            "50",
        ),
        (json!({"probe_k": 5000}), None, "options.probe_k", "1000"),
        (json!({}), Some(1001), "k", "1000"),
        (json!({"k": 1001}), None, "options.k", "1000"),
    ] {
        let mut body = json!({"user_id": "acme:ann", "query_vector": q, "options": options});
        if let Some(k) = k {
            body["k"] = json!(k);
        }
        let (status, v) = post(&base, "/v1/retrieve", None, &body.to_string()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["field"], field, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(&format!("limit of {limit}")), "{message}");
    }
    for (turns, message) in [(1001, "limit of 1000"), (0, "at least 1")] {
        let body = json!({"user_id": "acme:ann", "query_vector": q, "max_turns": turns});
        let (status, v) = post(&base, "/v1/retrieve", None, &body.to_string()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["field"], "max_turns", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(message),
            "{v}"
        );
    }
    // Less work than configured is fine.
    let (status, v) = post(
        &base,
        "/v1/retrieve",
        None,
        &json!({"user_id": "acme:ann", "query_vector": q,
                "options": {"beam": 2, "depth": 3, "mode": "recollection"}})
        .to_string(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

type EmbedResult =
    Result<steamrf_operators::embed::Embeddings, steamrf_operators::embed::EmbedError>;

/// An embedder whose answer is `f(texts)`: the failures and delays a
/// service test needs.
struct FnEmbedder<F>(steamrf_operators::embed::EmbedStats, F);

impl<F> Embedder for FnEmbedder<F>
where
    F: Fn(Vec<String>) -> BoxFuture<'static, EmbedResult> + Send + Sync + 'static,
{
    fn dim(&self) -> usize {
        EMBEDDING_DIM
    }
    fn model_id(&self) -> &str {
        "test"
    }
    fn precision(&self) -> &'static str {
        "f32"
    }
    fn embed(&self, texts: Vec<String>) -> BoxFuture<'static, EmbedResult> {
        (self.1)(texts)
    }
    fn stats(&self) -> &steamrf_operators::embed::EmbedStats {
        &self.0
    }
}

fn fn_embedder<F>(f: F) -> Option<Arc<dyn Embedder>>
where
    F: Fn(Vec<String>) -> BoxFuture<'static, EmbedResult> + Send + Sync + 'static,
{
    Some(Arc::new(FnEmbedder(Default::default(), f)))
}

#[tokio::test]
async fn recollection_stops_at_the_request_deadline_with_what_it_has() {
    let (base, st) = start_with(
        Auth::open(),
        true,
        |c| c.request_timeout = Duration::from_nanos(1),
        None,
    )
    .await;
    let body = json!({"user_id": "acme:ann", "query_vector": qv(&unit(&[(0, 1.0)])),
                      "options": {"mode": "recollection"}});
    let (status, v) = post(&base, "/v1/retrieve", None, &body.to_string()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["explanation"]["truncated"], true, "{v}");
    // The first round always runs: a cut answer is not empty.
    assert_eq!(v["explanation"]["rounds"], 1, "{v}");
    assert!(!v["items"].as_array().unwrap().is_empty(), "{v}");
    assert!(
        st.metrics
            .render()
            .contains("steamrf_retrieve_cut_total{reason=\"deadline\"} 1")
    );
    // Within the deadline nothing is cut.
    let (base, _) = start(Auth::open(), true).await;
    let (status, v) = post(&base, "/v1/retrieve", None, &body.to_string()).await;
    assert_eq!(
        (status, &v["explanation"]["truncated"]),
        (200, &json!(false))
    );
}

#[tokio::test]
async fn work_stops_when_the_client_goes_away() {
    let done = Arc::new(AtomicU64::new(0));
    let (base, st) = start_with(
        Auth::open(),
        true,
        |c| c.max_in_flight = 1,
        fn_embedder({
            // 500 ms, then counts the embedding it finished.
            let done = done.clone();
            move |texts| {
                let done = done.clone();
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    done.fetch_add(1, Ordering::SeqCst);
                    Ok(steamrf_operators::embed::Embeddings {
                        dim: EMBEDDING_DIM,
                        vectors: texts.iter().flat_map(|_| unit(&[(0, 1.0)])).collect(),
                        ..Default::default()
                    })
                })
            }
        }),
    )
    .await;
    let body = json!({"user_id": "acme:ann", "query": "jazz"}).to_string();
    // The client gives up after 100 ms and closes the connection.
    let gave_up = reqwest::Client::new()
        .post(format!("{base}/v1/retrieve"))
        .body(body.clone())
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(gave_up.is_err());
    // Its request's work was dropped: the embedding never finished and the
    // one permit is free at once, not after the 500 ms it would have taken.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(st.in_flight.available_permits(), 1);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(done.load(Ordering::SeqCst), 0);
    // A patient client is answered.
    assert_eq!(post(&base, "/v1/retrieve", None, &body).await.0, 200);
    assert_eq!(done.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn overload_is_shed_with_503_and_retry_after() {
    let (base, st) = start_with(Auth::open(), true, |c| c.max_in_flight = 2, None).await;
    let held = st.in_flight.clone().acquire_many_owned(2).await.unwrap();
    let body = json!({"user_id": "acme:ann", "query_vector": qv(&unit(&[(0, 1.0)]))}).to_string();
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/retrieve"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert!(resp.headers().contains_key("x-request-id"));
    let v: Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    // Bad requests are still told what is wrong, and health answers.
    assert_eq!(post(&base, "/v1/retrieve", None, "{").await.0, 400);
    assert_eq!(
        reqwest::get(format!("{base}/readyz"))
            .await
            .unwrap()
            .status(),
        200
    );
    drop(held);
    assert_eq!(post(&base, "/v1/retrieve", None, &body).await.0, 200);
    let m = st.metrics.render();
    assert!(m.contains("steamrf_serve_shed_total 1"), "{m}");
}

#[tokio::test]
async fn internal_errors_carry_only_a_request_id() {
    let (base, _) = start_with(
        Auth::open(),
        true,
        |_| {},
        // A failure that names its endpoint, as the remote embedder's does.
        fn_embedder(|_| {
            Box::pin(async {
                Err(steamrf_operators::embed::EmbedError::Remote {
                    url: "http://embedder.internal:8080/v1/embeddings".into(),
                    reason: "HTTP 500: upstream secret body".into(),
                    retryable: true,
                })
            })
        }),
    )
    .await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/v1/retrieve"))
        .body(json!({"user_id": "acme:ann", "query": "jazz"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 500);
    let id = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    let text = resp.text().await.unwrap();
    for secret in ["embedder.internal", "8080", "secret", "HTTP 500"] {
        assert!(!text.contains(secret), "{text}");
    }
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["error"]["code"], "internal");
    assert_eq!(v["error"]["request_id"], id.as_str());
    assert!(v["error"]["message"].as_str().unwrap().contains(&id));
}

#[tokio::test]
async fn readiness_fails_when_refreshes_keep_failing() {
    let (base, st) = start_with(
        Auth::open(),
        true,
        |c| c.max_staleness = Duration::from_millis(300),
        None,
    )
    .await;
    let readyz = || async {
        let r = reqwest::get(format!("{base}/readyz")).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(readyz().await.0, 200);
    // No refresh succeeds (nothing calls refreshed()): stale after 300 ms.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, why) = readyz().await;
    assert_eq!(status, 503);
    assert!(why.starts_with("stale: no successful refresh"), "{why}");
    // The snapshot is still served meanwhile; one good refresh makes it ready.
    let body = json!({"user_id": "acme:ann", "query_vector": qv(&unit(&[(0, 1.0)]))}).to_string();
    assert_eq!(post(&base, "/v1/retrieve", None, &body).await.0, 200);
    st.refreshed();
    assert_eq!(readyz().await.0, 200);
}

#[tokio::test]
async fn a_rotated_tokens_file_is_reloaded_and_a_broken_one_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, "old-token-0123456789 acme\n").unwrap();
    let (mut file, auth) = TokensFile::load(path.to_str().unwrap()).unwrap();
    let (base, st) = start(auth, true).await;
    let body = json!({"user_id": "acme:ann", "query_vector": qv(&unit(&[(0, 1.0)]))}).to_string();
    let call = |t: &'static str| {
        let (base, body) = (base.clone(), body.clone());
        async move { post(&base, "/v1/retrieve", Some(t), &body).await.0 }
    };
    assert_eq!(call("old-token-0123456789").await, 200);
    // Rotation: the new token works and the old one stops, without a restart.
    std::fs::write(&path, "new-token-0123456789 acme\n").unwrap();
    file.poll(&st).await;
    assert_eq!(call("new-token-0123456789").await, 200);
    assert_eq!(call("old-token-0123456789").await, 401);
    // A broken file (short token) keeps the tokens in force.
    std::fs::write(&path, "short acme\n").unwrap();
    file.poll(&st).await;
    assert_eq!(call("new-token-0123456789").await, 200);
    // So does an emptied or truncated one (no token left would lock
    // everyone out), and a missing one.
    for cut in ["", "# rotating\n", "new-tok"] {
        std::fs::write(&path, cut).unwrap();
        file.poll(&st).await;
        assert_eq!(call("new-token-0123456789").await, 200, "{cut:?}");
    }
    std::fs::remove_file(&path).unwrap();
    file.poll(&st).await;
    assert_eq!(call("new-token-0123456789").await, 200);
    let m = st.metrics.render();
    assert!(
        m.contains("steamrf_serve_token_reloads_total{result=\"ok\"} 1")
            && m.contains("steamrf_serve_token_reloads_total{result=\"error\"} 5"),
        "{m}"
    );
}

#[tokio::test]
async fn slow_clients_are_cut_off_and_do_not_starve_others() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (base, _) = start_with(
        Auth::open(),
        true,
        |c| {
            c.header_timeout = Duration::from_millis(500);
            c.body_timeout = Duration::from_millis(500);
        },
        None,
    )
    .await;
    let addr = base.trim_start_matches("http://").to_owned();
    // 200 connections that start their headers and never finish them.
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
        c.write_all(b"POST /v1/retrieve HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(c);
    }
    // A normal client is answered meanwhile, within a second.
    let body = json!({"user_id": "acme:ann", "query_vector": qv(&unit(&[(0, 1.0)]))}).to_string();
    let t = Instant::now();
    assert_eq!(post(&base, "/v1/retrieve", None, &body).await.0, 200);
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The server closes every slow connection at the header timeout.
    for mut c in slow {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "a slow connection was left open");
    }
    // A body that never arrives gets a 408.
    let mut c = tokio::net::TcpStream::connect(&addr).await.unwrap();
    c.write_all(
        b"POST /v1/retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"user",
    )
    .await
    .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), c.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(head.contains("request_timeout"), "{head}");
}

/// A loader whose user reads wait for the test's word (a slow table read).
struct Gated {
    inner: Fixed,
    gate: Arc<Semaphore>,
    /// User reads begun.
    reads: Arc<AtomicU64>,
}

impl Gated {
    fn new(gate: &Arc<Semaphore>) -> Self {
        Self {
            inner: fixed(),
            gate: gate.clone(),
            reads: Arc::default(),
        }
    }
}

impl Loader for Gated {
    fn user<'a>(
        &'a self,
        cfg: &'a ServeConfig,
        snap: &'a Snapshot,
        user_id: &'a str,
    ) -> BoxFuture<'a, Result<UserData>> {
        Box::pin(async move {
            self.reads.fetch_add(1, Ordering::Relaxed);
            drop(self.gate.acquire().await.unwrap());
            self.inner.user(cfg, snap, user_id).await
        })
    }

    fn memories<'a>(&'a self, ids: &'a [MemoryId]) -> BoxFuture<'a, Result<Vec<Memory>>> {
        self.inner.memories(ids)
    }
}

/// Issue 44, item 7: a refresh that lands while a view's user fill runs
/// (it publishes a new snapshot, then evicts the prototype whose members
/// changed) must not leave the members the view then reads from the old
/// snapshot cached under the new generation, where they would be served
/// to the community's users until the next change. Under 6e978f1 the
/// members fill took the generation after the user fill and kept them.
#[tokio::test]
async fn members_read_from_a_snapshot_a_refresh_replaced_are_not_kept() {
    let gate = Arc::new(Semaphore::new(0));
    let st = Arc::new(AppState::new(
        config(),
        Some(':'),
        None,
        Auth::open(),
        ServeMetrics::new(),
        Snapshot::default(),
        Arc::new(Gated::new(&gate)),
    ));
    st.publish(snapshot());
    let ann_protos: Vec<MemoryId> = {
        let s = steam_state();
        let ann = s.user("acme:ann").unwrap().memories[0].id;
        vec![s.communities().community_of(ann).unwrap()]
    };
    assert!(st.snapshot().prototypes.contains_key(&ann_protos[0]));
    let viewing = tokio::spawn({
        let st = st.clone();
        async move {
            st.view("acme:ann", true, Instant::now() + Duration::from_secs(30))
                .await
                .map(|v| v.members.len())
        }
    });
    // The view is waiting on ann's rows: a refresh lands.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!viewing.is_finished());
    st.publish(snapshot());
    let evicted = st.cache.invalidate(&Changes {
        prototypes: ann_protos.iter().copied().collect(),
        ..Default::default()
    });
    assert_eq!(evicted, 0, "nothing was cached yet");
    gate.add_permits(1);
    let members = viewing.await.unwrap().unwrap();
    assert_eq!(members, 1, "the view is answered from what it read");
    assert!(
        st.cache.members(ann_protos[0]).is_none(),
        "members of the replaced snapshot were cached under the new generation"
    );
    // A view that starts after the refresh reads and keeps them.
    gate.add_permits(1);
    st.view("acme:ann", true, Instant::now() + Duration::from_secs(30))
        .await
        .unwrap();
    assert!(st.cache.members(ann_protos[0]).is_some());
}

/// Issue 44, item 3: concurrent misses for one user (an agent retrying,
/// or a client hammering one large user) share one read and one fill
/// permit instead of each reading and building the same corpus; other
/// users still get permits of their own.
#[tokio::test]
async fn concurrent_misses_for_one_user_share_one_read() {
    let gate = Arc::new(Semaphore::new(0));
    let loader = Arc::new(Gated::new(&gate));
    let reads = loader.reads.clone();
    let cfg = config();
    let permits = cfg.max_in_flight;
    let st = Arc::new(AppState::new(
        cfg,
        Some(':'),
        None,
        Auth::open(),
        ServeMetrics::new(),
        Snapshot::default(),
        loader,
    ));
    st.publish(snapshot());
    let deadline = Instant::now() + Duration::from_secs(30);
    let views: Vec<_> = (0..16)
        .map(|_| {
            let st = st.clone();
            tokio::spawn(async move {
                st.view("acme:ann", false, deadline)
                    .await
                    .map(|v| v.user.corpus.entries.len())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(reads.load(Ordering::Relaxed), 1, "one read for 16 misses");
    assert_eq!(st.fills.available_permits(), permits - 1);
    gate.add_permits(1);
    for v in views {
        assert!(v.await.unwrap().unwrap() > 0);
    }
    assert_eq!(reads.load(Ordering::Relaxed), 1);
    let lookups = |r| {
        st.metrics
            .cache_lookups
            .with_label_values(&["user", r])
            .get()
    };
    assert_eq!((lookups("miss"), lookups("joined")), (1, 15));
    // Cached now; another user reads on their own.
    st.view("acme:ann", false, deadline).await.unwrap();
    gate.add_permits(1);
    st.view("acme:ben", false, deadline).await.unwrap();
    assert_eq!(reads.load(Ordering::Relaxed), 2);
    assert_eq!(st.fills.available_permits(), permits);
}

/// `serve.max_connections`: idle clients holding every slot keep the
/// service from accepting more (instead of growing its descriptors and
/// memory without bound); a waiting client is answered as soon as one
/// closes, and every one of them once the header timeout frees the slots.
#[tokio::test]
async fn open_connections_are_capped_and_a_waiting_client_gets_the_next_slot() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (base, _) = start_with(
        Auth::open(),
        true,
        |c| {
            c.max_connections = 4;
            c.header_timeout = Duration::from_secs(30);
        },
        None,
    )
    .await;
    let addr = base.trim_start_matches("http://").to_owned();
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut waiting = tokio::net::TcpStream::connect(&addr).await.unwrap();
    waiting
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let early =
        tokio::time::timeout(Duration::from_millis(500), waiting.read_to_end(&mut buf)).await;
    assert!(early.is_err(), "a fifth connection was served: {buf:?}");
    drop(idle.pop());
    tokio::time::timeout(Duration::from_secs(5), waiting.read_to_end(&mut buf))
        .await
        .expect("the freed slot went to the waiting client")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"),
        "{buf:?}"
    );
}
