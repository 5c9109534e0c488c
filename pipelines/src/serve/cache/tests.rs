use std::time::Duration;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;

use steamrf_schemas::tables::{EMBEDDING_DIM, turn_vectors, with_embeddings};

use super::tables::{INTERACTION_COLUMNS, PASSAGE_COLUMNS, TURN_VECTOR_COLUMNS};
use super::*;
use crate::config::{Config, CorpusKind};

fn project(b: &RecordBatch, names: &[&str]) -> RecordBatch {
    let idx: Vec<usize> = names
        .iter()
        .map(|n| b.schema().index_of(n).unwrap())
        .collect();
    b.project(&idx).unwrap()
}

fn axis(i: usize) -> Vec<f32> {
    let mut v = vec![0.0; EMBEDDING_DIM];
    v[i] = 1.0;
    v
}

/// Dialogue turns (two sessions), a click on an embedded item and one
/// on an unknown item, as the tables hold them: `interactions`,
/// `turn_vectors`, `items`.
fn tables() -> (RecordBatch, RecordBatch, RecordBatch) {
    let events = [
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t2","timestamp":2000,"user_id":"u","session_id":"s1","role":"assistant","text":"Try Blue Train."}"#,
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t1","timestamp":1000,"user_id":"u","session_id":"s1","role":"user","text":"More Coltrane?"}"#,
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t3","timestamp":3000,"user_id":"u","session_id":"s2","role":"user","text":"My cat is Miles."}"#,
        r#"{"type":"click","schema_version":1,"event_id":"c1","timestamp":4000,"user_id":"u","item_id":"i1"}"#,
        r#"{"type":"click","schema_version":1,"event_id":"c2","timestamp":5000,"user_id":"u","item_id":"nope"}"#,
        r#"{"type":"item","schema_version":1,"event_id":"it","timestamp":10,"item_id":"i1","title":"Blue Train"}"#,
    ];
    let t = crate::sink::fixture(&events, 0);
    let mut vecs = axis(0);
    vecs.extend(axis(1));
    vecs.extend(axis(2));
    let inter = t.interactions.unwrap();
    let tv = turn_vectors(&inter, &[0, 1, 2], &vecs).unwrap();
    let items = with_embeddings(&t.items.unwrap(), &[0], &axis(3)).unwrap();
    (
        project(&inter, INTERACTION_COLUMNS),
        project(&tv, TURN_VECTOR_COLUMNS),
        project(&items, &["item_id", "title", "embedding"]),
    )
}

fn load(group_sessions: bool) -> (UserData, HashMap<String, ItemInfo>) {
    let mut cfg = Config::load_with_env(None, []).unwrap().serve;
    cfg.group_sessions = group_sessions;
    // A ranker that reads the history (it is not kept otherwise).
    cfg.ranker.item_cf = 0.5;
    cfg.kinds = vec![
        CorpusKind::Memory,
        CorpusKind::Dialogue,
        CorpusKind::Interaction,
    ];
    let (inter, tv, items) = tables();
    let items = catalogue(&[items]);
    let stored = UserRows {
        interactions: &[inter],
        turn_vectors: &[tv],
        passages: &[],
    };
    (
        build_user(&cfg, &items, "u", stored, Vec::new()).unwrap(),
        items,
    )
}

/// `passages` rows: the window ending at t2 (covering t1..t2, along axis
/// 5), and one naming a forgotten turn.
fn window_t2() -> RecordBatch {
    let schema = Arc::new(arrow_schema::Schema::new(
        PASSAGE_COLUMNS
            .iter()
            .map(|c| {
                steamrf_schemas::TableName::Passages
                    .schema()
                    .field_with_name(c)
                    .unwrap()
                    .clone()
            })
            .collect::<Vec<_>>(),
    ));
    // The window ending at t2 covers t1..t2; one names a forgotten turn.
    let mut v = axis(5);
    v.extend(axis(6));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(arrow_array::StringArray::from(vec!["t2", "gone"])),
            Arc::new(arrow_array::StringArray::from(vec!["s1", "s1"])),
            Arc::new(arrow_array::StringArray::from(vec!["t1", "t0"])),
            steamrf_schemas::tables::embedding_array(&v, 2).unwrap(),
        ],
    )
    .unwrap()
}

#[test]
fn windows_score_the_max_of_their_turns_sparse_vectors() {
    use steamrf_operators::embed::SparseVec;
    use steamrf_operators::passage::{UnitBudget, UnitParams, retrieve_units_until};
    use steamrf_operators::rfmem::{Mode, RfMemParams};
    let cfg = Config::load_with_env(None, []).unwrap().serve;
    let (inter, tv, items) = tables();
    let items = catalogue(&[items]);
    // turn_vectors rows t2, t1, t3: t2 and t1 carry sparse vectors, t3 none.
    let tv = steamrf_schemas::tables::with_sparse_terms(
        &tv,
        &[Some((&[42], &[2.0])), Some((&[7], &[1.0])), None],
    )
    .unwrap();
    let stored = UserRows {
        interactions: &[inter],
        turn_vectors: &[tv],
        passages: &[window_t2()],
    };
    let u = build_user(&cfg, &items, "u", stored, Vec::new()).unwrap();
    let c = &u.corpus;
    assert!(c.index.has_sparse_units());
    let s1 = c.entries.iter().position(|e| e.id == "s1").unwrap();
    let p = RfMemParams {
        mode: Mode::Familiarity,
        k: 1,
        ..RfMemParams::default()
    };
    let budget = UnitBudget {
        units: 1,
        turns: 30,
    };
    // A query vector along no row, no text: only t2's term finds s1's window,
    // whose vector is the max of t1's and t2's.
    for (term, want) in [(42, 1.0), (7, 1.0)] {
        let q = SparseVec::from_pairs(vec![(term, 1.0)]);
        let a = retrieve_units_until(
            &c.index,
            &axis(9),
            None,
            Some(&q),
            &p,
            &UnitParams::default(),
            budget,
            &|| false,
        )
        .unwrap();
        assert_eq!(a.hits[0].row as usize, s1, "{a:?}");
        assert_eq!((a.hits[0].start, a.hits[0].end), (0, 2), "{a:?}");
        assert_eq!(a.hits[0].sparse, want, "{a:?}");
    }
    // Turns without sparse vectors (an older table): no sparse side.
    let (inter, tv, items) = tables();
    let stored = UserRows {
        interactions: &[inter],
        turn_vectors: &[tv],
        passages: &[window_t2()],
    };
    let u = build_user(&cfg, &catalogue(&[items]), "u", stored, Vec::new()).unwrap();
    assert!(u.corpus.index.has_units() && !u.corpus.index.has_sparse_units());
}

#[test]
fn sessions_carry_their_passage_windows_by_turn_offsets() {
    use steamrf_operators::passage::{
        HybridParams, UnitBudget, UnitParams, retrieve_units_until, retrieve_until,
    };
    use steamrf_operators::rfmem::{Mode, RfMemParams};
    // The default view: sessions with their windows, and interactions.
    let cfg = Config::load_with_env(None, []).unwrap().serve;
    assert!(cfg.kinds.contains(&CorpusKind::Passage));
    let (inter, tv, items) = tables();
    let items = catalogue(&[items]);
    let passages = window_t2();
    let stored = UserRows {
        interactions: &[inter],
        turn_vectors: &[tv],
        passages: &[passages],
    };
    let u = build_user(&cfg, &items, "u", stored, Vec::new()).unwrap();
    let c = &u.corpus;
    let sessions: Vec<&str> = c
        .entries
        .iter()
        .filter(|e| e.kind == EntryKind::Session)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(sessions, ["s1", "s2"]);
    assert!(c.entries.iter().all(|e| e.kind != EntryKind::Dialogue));
    let s1 = c.entries.iter().position(|e| e.id == "s1").unwrap();
    let s2 = c.entries.iter().position(|e| e.id == "s2").unwrap();
    assert_eq!(
        c.entries[s1].windows,
        [Window {
            event_id: "t2".into(),
            start: 0,
            end: 2
        }]
    );
    assert!(c.entries[s2].windows.is_empty());
    // s1's window, and every other row (s2, the click) as its own one.
    assert_eq!(c.index.windows(), c.entries.len());
    // The cache counts the window vectors as well as the rows'.
    assert!(
        u.bytes >= (c.entries.len() + c.index.windows()) * EMBEDDING_DIM * 4,
        "{} bytes",
        u.bytes
    );
    // A query along the window's vector finds s1 through it.
    let p = RfMemParams {
        mode: Mode::Familiarity,
        k: 1,
        ..RfMemParams::default()
    };
    let a = retrieve_until(
        &c.index,
        &axis(5),
        None,
        &p,
        &HybridParams::default(),
        &|| false,
    )
    .unwrap();
    assert_eq!(
        (a.hits[0].row as usize, a.hits[0].passage),
        (s1, c.index.first_window(s1 as u32)),
        "{a:?}"
    );
    // A row without windows of its own is still found densely.
    let a = retrieve_until(
        &c.index,
        &c.index.rows().vector(s2),
        None,
        &p,
        &HybridParams::default(),
        &|| false,
    )
    .unwrap();
    assert_eq!(a.hits[0].row as usize, s2, "{a:?}");
    // And the lexical side reads the windows' texts (a row without windows:
    // its content), as evidence units.
    let budget = UnitBudget {
        units: 3,
        turns: 30,
    };
    let a = retrieve_units_until(
        &c.index,
        &axis(9),
        Some("cat Miles"),
        None,
        &p,
        &UnitParams::default(),
        budget,
        &|| false,
    )
    .unwrap();
    assert_eq!(c.entries[a.hits[0].row as usize].id, "s2", "{a:?}");
}

#[test]
fn turns_and_interactions_become_rows_with_provenance() {
    let (u, items) = load(false);
    let u = &u.corpus;
    let rows: Vec<(EntryKind, &str, &str)> = u
        .entries
        .iter()
        .map(|e| (e.kind, e.id.as_str(), e.content.as_str()))
        .collect();
    // In time order; the click on an item without an embedding is not searchable.
    assert_eq!(
        rows,
        [
            (EntryKind::Dialogue, "t1", "user: More Coltrane?"),
            (EntryKind::Dialogue, "t2", "assistant: Try Blue Train."),
            (EntryKind::Dialogue, "t3", "user: My cat is Miles."),
            (EntryKind::Interaction, "c1", "click: Blue Train"),
        ]
    );
    assert_eq!(u.entries[0].source, Some((0, 1)));
    // Row i of the store is entry i: t1 was embedded as axis 1.
    assert_eq!(u.index.rows().vector(0)[1], 1.0);
    assert_eq!(u.index.rows().vector(3)[3], 1.0);
    assert!(items.contains_key("i1"));
    // The ranker's history holds every clicked item, oldest first.
    assert_eq!(load(false).0.history, ["i1", "nope"]);
}

#[test]
fn sessions_group_their_turns_in_order() {
    let (u, _) = load(true);
    assert!(u.unresolved, "the click on an unknown item was left out");
    let u = &u.corpus;
    let s1 = u.entries.iter().position(|e| e.id == "s1").unwrap();
    let e = &u.entries[s1];
    assert_eq!(e.kind, EntryKind::Session);
    assert_eq!(
        e.content,
        "user: More Coltrane?\nassistant: Try Blue Train."
    );
    assert_eq!(e.source_event_ids, ["t1", "t2"]);
    // The session's vector is the normalised mean of its turns'.
    let v = u.index.rows().vector(s1);
    let h = std::f32::consts::FRAC_1_SQRT_2;
    assert!((v[0] - h).abs() < 1e-6 && (v[1] - h).abs() < 1e-6);
    assert_eq!(u.entries.len(), 3, "two sessions and a click");
}

/// Writes one dialogue turn with its vector.
async fn write_turn(sink: &crate::sink::LanceSink, user: &str, id: &str, offset: i64) {
    let json = format!(
        r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":{offset},"user_id":"{user}","session_id":"s","role":"user","text":"turn {id}"}}"#
    );
    let inter = crate::sink::fixture(&[json], offset).interactions.unwrap();
    let tv = turn_vectors(&inter, &[0], &axis(offset as usize % 8)).unwrap();
    let t = steamrf_schemas::TableName::Interactions;
    sink.write(t, &inter).await.unwrap();
    let t = steamrf_schemas::TableName::TurnVectors;
    sink.write(t, &tv).await.unwrap();
}

fn users(batches: &[RecordBatch]) -> Vec<String> {
    let mut out: Vec<String> = batches
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
    out.sort();
    out.dedup();
    out
}

/// The rows `tables` give `user`.
async fn rows(tables: &Tables, cfg: &ServeConfig, snap: &Snapshot, user: &str) -> usize {
    tables
        .user(cfg, snap, user)
        .await
        .unwrap()
        .corpus
        .entries
        .len()
}

/// The users of the `interactions` rows changed since version `from`.
async fn changed_users(tables: &Tables, from: u64) -> Vec<String> {
    users(
        &tables
            .changed_rows("interactions", from, &["user_id"])
            .await
            .unwrap()
            .unwrap(),
    )
}

/// Through real LanceDB tables: past `serve.max_user_rows` a user's
/// corpus holds their most recent turns, by timestamp and then event
/// id (so equal timestamps cannot make the cut let everything in), and
/// says how many it left out.
#[tokio::test]
async fn a_user_is_served_their_most_recent_rows_only() {
    use crate::metrics::Metrics;
    use crate::sink::LanceSink;

    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::load_with_env(None, []).unwrap();
    config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
    config.serve.kinds = vec![CorpusKind::Dialogue];
    let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
        .await
        .unwrap();
    for (id, ts) in [("a1", 1), ("a2", 2), ("b3", 3), ("a3", 3), ("a4", 4)] {
        write_turn(&sink, "ann", id, ts).await;
    }
    write_turn(&sink, "ben", "b1", 9).await;
    let tables = Tables::new(
        crate::sink::connect(&config.lancedb).await.unwrap(),
        SignalSources::default(),
    );
    tables.versions().await.unwrap();
    let snap = tables.load_shared().await.unwrap();
    for (max, kept, cut) in [
        (10, &["a1", "a2", "a3", "b3", "a4"][..], 0),
        (3, &["a3", "b3", "a4"], 2),
        (2, &["b3", "a4"], 3),
        (1, &["a4"], 4),
    ] {
        config.serve.max_user_rows = max;
        let u = tables.user(&config.serve, &snap, "ann").await.unwrap();
        let ids: Vec<&str> = u.corpus.entries.iter().map(|e| e.id.as_str()).collect();
        assert_eq!(ids, kept, "max_user_rows = {max}");
        assert_eq!(u.rows_cut, cut, "max_user_rows = {max}");
        // Each kept turn found its vector under the same cut.
        assert_eq!(u.corpus.index.rows().len(), kept.len());
    }
}

/// A session answers with the turns of the window that matched, and
/// any text is cut at the byte limit on a character boundary.
#[test]
fn an_answer_hands_over_the_matched_window_within_its_byte_limit() {
    let (u, _) = load(true);
    let s1 = u.corpus.entries.iter().position(|e| e.id == "s1").unwrap();
    let e = &u.corpus.entries[s1];
    let w = |start, end| Window {
        event_id: String::new(),
        start,
        end,
    };
    let text = |win: Option<&Window>, max| {
        let a = e.answer_text(win, max);
        (a.content, a.truncated, a.source_event_ids)
    };
    let ids = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        text(Some(&w(0, 1)), 1000),
        ("user: More Coltrane?".to_owned(), false, ids(&["t1"]))
    );
    assert_eq!(text(Some(&w(1, 2)), 1000).0, "assistant: Try Blue Train.");
    assert_eq!(text(Some(&w(1, 2)), 1000).2, ids(&["t2"]));
    assert_eq!(text(Some(&w(0, 2)), 1000).0, e.content);
    assert_eq!(
        text(None, 1000),
        (e.content.clone(), false, ids(&["t1", "t2"]))
    );
    // A window past the turns (a stale one) hands over the whole row.
    assert_eq!(text(Some(&w(1, 9)), 1000).0, e.content);
    assert_eq!(
        text(Some(&w(0, 1)), 8),
        ("user: Mo".to_owned(), true, ids(&["t1"]))
    );
    // Cut inside the first turn: the second is not handed over.
    assert_eq!(text(None, 8), ("user: Mo".to_owned(), true, ids(&["t1"])));
    let wide = Entry {
        content: "ééé".to_owned(),
        turn_ends: Vec::new(),
        ..e.clone()
    };
    let a = wide.answer_text(None, 3);
    assert_eq!((a.content.as_str(), a.truncated), ("é", true));
}

/// Through real LanceDB tables: a user is read by id; appends, deletes
/// and rewrites are told apart, so that exactly the users whose rows
/// changed are evicted and a compaction evicts nobody.
#[tokio::test]
async fn users_are_read_by_id_and_changes_name_exactly_their_users() {
    use steamrf_schemas::TableName;

    use crate::metrics::Metrics;
    use crate::sink::LanceSink;

    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::load_with_env(None, []).unwrap();
    config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
    config.lancedb.reindex_rows = 1;
    // Turns as rows: the ids are the events'.
    config.serve.kinds = vec![
        CorpusKind::Memory,
        CorpusKind::Dialogue,
        CorpusKind::Interaction,
    ];
    let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
        .await
        .unwrap();
    let t = TableName::Interactions;
    write_turn(&sink, "ann", "a1", 1).await;
    write_turn(&sink, "o'brien", "o1", 2).await;
    write_turn(&sink, "ben", "b1", 3).await;
    let tables = Tables::new(
        crate::sink::connect(&config.lancedb).await.unwrap(),
        SignalSources::default(),
    );
    let v1 = tables.versions().await.unwrap()["interactions"];
    let snap = tables.load_shared().await.unwrap();
    let cfg = &config.serve;
    let u = tables.user(cfg, &snap, "o'brien").await.unwrap();
    let ids: Vec<&str> = u.corpus.entries.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, ["o1"], "a quote in the id is a literal, not SQL");
    assert!(u.bytes >= EMBEDDING_DIM * 4);
    assert_eq!(rows(&tables, cfg, &snap, "nobody").await, 0);

    // An append names its user only.
    write_turn(&sink, "ann", "a2", 4).await;
    let v2 = tables.versions().await.unwrap()["interactions"];
    assert!(v2 > v1);
    assert_eq!(changed_users(&tables, v1).await, ["ann"]);
    assert_eq!(rows(&tables, cfg, &snap, "ann").await, 2);

    // A delete (forget) names the deleted rows' user.
    let table = sink.table(t).clone();
    table.delete("user_id = 'ben'").await.unwrap();
    let v3 = tables.versions().await.unwrap()["interactions"];
    assert_eq!(changed_users(&tables, v2).await, ["ben"]);

    // A compaction moves rows without changing them: nobody.
    table
        .optimize(lancedb::table::OptimizeAction::Compact {
            options: Default::default(),
            remap_options: None,
        })
        .await
        .unwrap();
    let v4 = tables.versions().await.unwrap()["interactions"];
    assert!(v4 > v3, "the compaction made a version");
    assert_eq!(changed_users(&tables, v3).await, Vec::<String>::new());
    // Still readable by id after the rewrite.
    assert_eq!(rows(&tables, cfg, &snap, "ann").await, 2);
    // From before the table existed: cannot tell, drop everything.
    assert!(
        tables
            .changed_rows("interactions", 0, &["user_id"])
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn the_rankers_statistics_come_from_the_tables() {
    use crate::metrics::Metrics;
    use crate::sink::LanceSink;
    use steamrf_schemas::TableName;

    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::load_with_env(None, []).unwrap();
    config.lancedb.uri = dir.path().to_str().unwrap().to_owned();
    let sink = LanceSink::open(&config.lancedb, Metrics::new(&[]))
        .await
        .unwrap();
    let click = |id: &str, user: &str, item: &str| {
        format!(
            r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"{user}","item_id":"{item}"}}"#
        )
    };
    let events = [
        click("c1", "ann", "kind-of-blue"),
        click("c2", "ann", "blue-train"),
        click("c3", "ben", "kind-of-blue"),
        click("c4", "ben", "blue-train"),
        click("c5", "ben", "blue-train"),
        click("c6", "cat", "nevermind"),
        r#"{"type":"item","schema_version":1,"event_id":"i1","timestamp":10,"item_id":"kind-of-blue","title":"Kind of Blue","categories":["Jazz"]}"#.to_owned(),
        r#"{"type":"item","schema_version":1,"event_id":"i2","timestamp":10,"item_id":"blue-train","title":"Blue Train","categories":["Jazz"]}"#.to_owned(),
        r#"{"type":"item","schema_version":1,"event_id":"i3","timestamp":10,"item_id":"nevermind","title":"Nevermind","categories":["Rock"]}"#.to_owned(),
    ];
    let t = crate::sink::fixture(&events, 0);
    sink.write(TableName::Interactions, &t.interactions.unwrap())
        .await
        .unwrap();
    let items = t.items.unwrap();
    let vecs: Vec<f32> = (0..items.num_rows()).flat_map(axis).collect();
    let items = with_embeddings(&items, &[0, 1, 2], &vecs).unwrap();
    sink.write(TableName::Items, &items).await.unwrap();

    let tables = Tables::new(
        crate::sink::connect(&config.lancedb).await.unwrap(),
        SignalSources {
            item_template: Some(config.embed.item_template.clone()),
            item_cf: Some(Duration::from_secs(60)),
            tenant_separator: None,
        },
    );
    tables.versions().await.unwrap();
    let cf = tables.item_cf().await.unwrap();
    let cf = cf.of("anyone").expect("one tenant");
    // Distinct users: ben's second click on blue-train counts once.
    assert_eq!(cf.popularity("blue-train"), 2.0);
    assert_eq!(cf.popularity("nevermind"), 1.0);
    assert!((cf.cosine("kind-of-blue", "blue-train") - 1.0).abs() < 1e-12);
    assert_eq!(cf.cosine("kind-of-blue", "nevermind"), 0.0);
    let snap = tables.load_shared().await.unwrap();
    let text = snap.text.as_deref().expect("BM25 is built when asked for");
    let s = text.scores(&["kind-of-blue"], &["blue-train", "nevermind"]);
    assert!(s[0] > s[1], "the jazz album shares words: {s:?}");
    // Without the ranker asking, neither is kept.
    let plain = Tables::new(
        crate::sink::connect(&config.lancedb).await.unwrap(),
        SignalSources::default(),
    );
    plain.versions().await.unwrap();
    assert!(plain.load_shared().await.unwrap().text.is_none());
    assert!(plain.item_cf_interval().is_none());
}

fn sized(bytes: usize, unresolved: bool) -> Arc<UserData> {
    let cfg = Config::load_with_env(None, []).unwrap().serve;
    let mut u = build_user(&cfg, &HashMap::new(), "x", UserRows::default(), Vec::new()).unwrap();
    u.bytes = bytes;
    u.unresolved = unresolved;
    Arc::new(u)
}

#[test]
fn the_cache_stays_within_its_budget_least_recently_used_out_first() {
    let c = Cache::new(1000);
    let g = c.generation();
    assert_eq!(c.insert_user("a", sized(200, false), g), 0);
    assert_eq!(c.insert_user("b", sized(200, false), g), 0);
    assert_eq!(c.insert_user("c", sized(200, true), g), 0);
    assert!(c.user("a").is_some(), "a is now the most recently used");
    assert_eq!(c.insert_user("d", sized(200, false), g), 0);
    assert_eq!(c.insert_user("e", sized(200, false), g), 0);
    assert_eq!(c.stats().bytes, 1000);
    // Full: the least recently used (b) makes room.
    assert_eq!(c.insert_user("f", sized(200, false), g), 1);
    assert!(c.user("b").is_none() && c.user("a").is_some());
    assert!(c.stats().bytes <= 1000);
    // One entry over half the budget is served, not kept.
    assert_eq!(c.insert_user("huge", sized(501, false), g), 0);
    assert!(c.user("huge").is_none());
    // Invalidation drops the named users and the unresolved ones, and
    // a fill that began before it is not kept.
    let n = c.invalidate(&Changes {
        users: HashSet::from(["a".to_owned(), "zed".to_owned()]),
        unresolved: true,
        ..Changes::default()
    });
    assert_eq!(n, 2, "a and c");
    assert!(c.user("a").is_none() && c.user("c").is_none() && c.user("d").is_some());
    assert_eq!(c.insert_user("a", sized(10, false), g), 0);
    assert!(c.user("a").is_none(), "read before the invalidation: stale");
    c.insert_user("a", sized(10, false), c.generation());
    assert!(c.user("a").is_some());
    c.insert_members(MemoryId(7), Arc::new(Members::default()), c.generation());
    assert_eq!(c.stats().prototypes, 1);
    // A change of one user refuses only the fills of that user: one
    // user written to on every refresh keeps nobody else from being
    // kept (issue 44, item 3), and is kept itself between its writes.
    let g = c.generation();
    c.invalidate(&Changes {
        users: HashSet::from(["busy".to_owned()]),
        ..Changes::default()
    });
    c.insert_user("calm", sized(10, false), g);
    assert!(c.user("calm").is_some(), "another user's change");
    c.insert_user("busy", sized(10, false), g);
    assert!(c.user("busy").is_none(), "its own change");
    c.insert_members(MemoryId(8), Arc::new(Members::default()), g);
    assert_eq!(c.stats().prototypes, 2);
    c.insert_user("busy", sized(10, false), c.generation());
    assert!(c.user("busy").is_some());
    // Everything changed: every fill that began before is refused.
    let g = c.generation();
    c.invalidate(&Changes {
        all: true,
        ..Changes::default()
    });
    assert_eq!(c.stats(), CacheStats::default());
    c.insert_user("calm", sized(10, false), g);
    assert!(c.user("calm").is_none());
}
