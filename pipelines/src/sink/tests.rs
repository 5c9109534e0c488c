use arrow_array::RecordBatchIterator;
use arrow_array::cast::AsArray;
use lancedb::Connection;

use super::index::{key_index, segments_to_merge};
use super::merge::dedup_absent;
use super::tables::primary_key_declared;
use super::*;

fn batches(events: &[String]) -> steamrf_schemas::TableBatches {
    fixture(events, 0)
}

fn click(id: &str) -> String {
    format!(
        r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"u","item_id":"i"}}"#
    )
}

fn item(event: &str, ts: i64, title: &str) -> String {
    format!(
        r#"{{"type":"item","schema_version":1,"event_id":"{event}","timestamp":{ts},"item_id":"i1","title":"{title}"}}"#
    )
}

/// The default LanceDB settings, pointed at `dir`.
fn lancedb_config(dir: &std::path::Path) -> LanceDbConfig {
    let defaults = crate::config::Config::load_with_env(None, [])
        .unwrap()
        .lancedb;
    LanceDbConfig {
        uri: dir.to_str().unwrap().to_owned(),
        ..defaults
    }
}

async fn sink() -> (tempfile::TempDir, LanceSink) {
    sink_with(500_000).await
}

async fn sink_with(reindex_rows: u64) -> (tempfile::TempDir, LanceSink) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LanceDbConfig {
        reindex_rows,
        ..lancedb_config(dir.path())
    };
    let sink = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    (dir, sink)
}

async fn count(s: &LanceSink, t: TableName) -> usize {
    s.table(t).count_rows(None).await.unwrap()
}

#[tokio::test]
async fn interactions_are_idempotent_by_event_id() {
    let (_dir, s) = sink().await;
    let b = batches(&[click("a"), click("b"), click("a")]);
    let batch = b.interactions.unwrap();
    let first = s.write(TableName::Interactions, &batch).await.unwrap();
    assert_eq!(
        (first.inserted, first.skipped),
        (2, 0),
        "the in-batch duplicate is dropped before the merge"
    );
    let replay = s.write(TableName::Interactions, &batch).await.unwrap();
    assert_eq!((replay.inserted, replay.updated, replay.skipped), (0, 0, 2));
    assert_eq!(count(&s, TableName::Interactions).await, 2);
    let more = batches(&[click("b"), click("c")]).interactions.unwrap();
    s.write(TableName::Interactions, &more).await.unwrap();
    assert_eq!(count(&s, TableName::Interactions).await, 3);
    assert_eq!(s.metrics.total_rows_written(), 3);
}

#[test]
fn the_hashed_dedup_keeps_what_the_general_one_keeps() {
    let b = batches(&[click("a"), click("b"), click("a"), click("c"), click("b")])
        .interactions
        .unwrap();
    let all = fresh::keys_of(&b, "event_id").unwrap();
    let (kept, rows) = dedup_absent(TableName::Interactions, &b, all).unwrap();
    let general = dedup(TableName::Interactions, &b).unwrap();
    assert_eq!(kept, general);
    assert_eq!(rows, fresh::keys_of(&general, "event_id").unwrap());
    let offsets = kept
        .column_by_name("source_offset")
        .unwrap()
        .as_primitive::<arrow_array::types::Int64Type>()
        .values()
        .to_vec();
    assert_eq!(offsets, [0, 1, 3], "first occurrences, in order");
    let unique = batches(&[click("x"), click("y")]).interactions.unwrap();
    let all = fresh::keys_of(&unique, "event_id").unwrap();
    let (same, rows) = dedup_absent(TableName::Interactions, &unique, all).unwrap();
    assert_eq!((same.num_rows(), rows.len()), (2, 2));
}

/// New `interactions` tables store their id columns with LZ4 (the
/// schema's `lance-encoding:compression` hint); a table created before
/// the hint keeps its schema and takes the new batches, on the fresh
/// path and the exact one.
#[tokio::test]
async fn the_id_encoding_hint_reaches_new_tables_and_old_ones_still_take_batches() {
    let t = TableName::Interactions;
    let (_dir, s) = sink().await;
    let schema = s.table(t).schema().await.unwrap();
    let hint = |schema: &arrow_schema::Schema| {
        schema
            .field_with_name("event_id")
            .unwrap()
            .metadata()
            .get("lance-encoding:compression")
            .cloned()
    };
    assert_eq!(hint(&schema).as_deref(), Some("lz4"));

    let dir = tempfile::tempdir().unwrap();
    let db = lancedb::connect(dir.path().to_str().unwrap())
        .execute()
        .await
        .unwrap();
    let plain: Vec<arrow_schema::Field> = t
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone().with_metadata(Default::default()))
        .collect();
    db.create_empty_table(t.as_str(), Arc::new(arrow_schema::Schema::new(plain)))
        .execute()
        .await
        .unwrap();
    let old = LanceSink::open(&lancedb_config(dir.path()), Metrics::new(&[]))
        .await
        .unwrap();
    assert_eq!(hint(&old.table(t).schema().await.unwrap()), None);
    let batch = batches(&[click("a"), click("b")]).interactions.unwrap();
    assert_eq!(old.write(t, &batch).await.unwrap().inserted, 2);
    let replay = batches(&[click("b"), click("c")]).interactions.unwrap();
    let r = old.write(t, &replay).await.unwrap();
    assert_eq!((r.inserted, r.skipped), (1, 1));
    assert_eq!(count(&old, t).await, 3);
}

#[tokio::test]
async fn key_index_is_created_and_kept_up_to_date() {
    let (_dir, s) = sink_with(3).await;
    let t = TableName::Interactions;
    let first = batches(&[click("a"), click("b")]).interactions.unwrap();
    s.write(t, &first).await.unwrap();
    assert_eq!(
        key_index(s.table(t), t).await.unwrap(),
        None,
        "below reindex_rows: no index yet"
    );
    let second = batches(&[click("c"), click("d")]).interactions.unwrap();
    s.write(t, &second).await.unwrap();
    // The update runs beside the writes, on its own handle; the writer's
    // handle sees it from its next commit on (here: moved explicitly).
    s.settle().await;
    s.table(t).checkout_latest().await.unwrap();
    assert!(
        key_index(s.table(t), t).await.unwrap().is_some(),
        "4 rows >= 3: indexed"
    );
    // Through the index, on indexed and unindexed fragments alike, replays add nothing.
    let third = batches(&[click("e")]).interactions.unwrap();
    s.write(t, &third).await.unwrap();
    for b in [&first, &second, &third] {
        let r = s.write(t, b).await.unwrap();
        assert_eq!((r.inserted, r.updated), (0, 0));
    }
    assert_eq!(count(&s, t).await, 5);
    let stats = s
        .table(t)
        .index_stats(key_index(s.table(t), t).await.unwrap().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stats.num_indexed_rows + stats.num_unindexed_rows, 5);
}

#[test]
fn index_updates_merge_like_a_binary_counter() {
    // Equal updates of 1: the segments are the set bits of the count.
    let mut sizes: Vec<u64> = Vec::new();
    let mut merged_rows = 0;
    for n in 1..=1000u64 {
        let m = segments_to_merge(&sizes, 1);
        let folded: u64 = sizes.drain(sizes.len() - m..).sum();
        merged_rows += folded + 1;
        sizes.push(folded + 1);
        assert_eq!(sizes.len() as u32, n.count_ones(), "after {n} updates");
        assert!(sizes.windows(2).all(|w| w[0] > w[1]), "{sizes:?}");
    }
    // Each row is merged about log2(1000) times, not ~500 times as
    // when every update folds in the whole index.
    assert!(merged_rows <= 1000 * 11, "{merged_rows}");
    // A large update folds in every smaller segment; a small one none.
    assert_eq!(segments_to_merge(&[8, 4, 2], 100), 3);
    assert_eq!(segments_to_merge(&[8, 4, 2], 1), 0);
    assert_eq!(segments_to_merge(&[8, 4, 2], 2), 3, "carries all the way");
    assert_eq!(segments_to_merge(&[8, 4, 1], 1), 1);
    assert_eq!(segments_to_merge(&[], 5), 0);
}

#[tokio::test]
async fn index_updates_add_segments_and_lookups_read_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LanceDbConfig {
        reindex_rows: 1,
        // Every write looks its keys up, through the index.
        fresh_keys: 0,
        ..lancedb_config(dir.path())
    };
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let t = TableName::Interactions;
    let mut written = Vec::new();
    for round in 0..6 {
        let ids: Vec<String> = (0..2).map(|i| format!("r{round}-{i}")).collect();
        let events: Vec<String> = ids.iter().map(|id| click(id)).collect();
        let b = batches(&events).interactions.unwrap();
        let r = s.write(t, &b).await.unwrap();
        assert_eq!(r.inserted, 2);
        s.settle().await;
        written.push(b);
    }
    s.table(t).checkout_latest().await.unwrap();
    let segments = index_segments(s.table(t), "event_id").await.unwrap();
    assert!(
        (2..6).contains(&segments),
        "tiers, neither one segment nor one per update: {segments}"
    );
    // Replays of every batch, whichever segment holds their keys, add nothing.
    for b in &written {
        let r = s.write(t, b).await.unwrap();
        assert_eq!((r.inserted, r.skipped), (0, 2));
    }
    assert_eq!(count(&s, t).await, 12);
}

/// Regression (seen in the two-instance e2e test): two instances creating
/// the tables at once left one with a handle that every retry failed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creators_both_write() {
    for round in 0..6 {
        let dir = tempfile::tempdir().unwrap();
        let cfg = lancedb_config(dir.path());
        let (a, b) = tokio::join!(
            LanceSink::open(&cfg, Metrics::new(&[])),
            LanceSink::open(&cfg, Metrics::new(&[]))
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        for (s, id) in [(&a, "a"), (&b, "b")] {
            let batch = batches(&[item(id, 1000, "t")]).items.unwrap();
            let mut attempt = 0;
            while let Err(e) = s.write(TableName::Items, &batch).await {
                attempt += 1;
                assert!(attempt < 3, "round {round}: {id} keeps failing: {e:#}");
            }
        }
        assert_eq!(
            count(&a, TableName::Items).await,
            1,
            "round {round}: same item_id"
        );
    }
}

/// Writes `batch` into `interactions`, retrying failed commits as the
/// pipeline's writer does; returns how many were retried.
async fn write_retrying(s: &LanceSink, batch: &RecordBatch) -> usize {
    let mut attempt = 0;
    while let Err(e) = s.write(TableName::Interactions, batch).await {
        attempt += 1;
        assert!(attempt < 5, "a write keeps failing: {e:#}");
    }
    attempt
}

/// Tables made before steamrf declared their key are upgraded when opened;
/// opening again (or by a second instance) changes nothing.
#[tokio::test]
async fn opening_declares_the_key_the_primary_key_also_on_old_tables() {
    let dir = tempfile::tempdir().unwrap();
    let db = lancedb::connect(dir.path().to_str().unwrap())
        .execute()
        .await
        .unwrap();
    let name = TableName::Interactions;
    let old = open_or_create_named(&db, name.as_str(), name.schema())
        .await
        .unwrap();
    assert!(!primary_key_declared(&old, name.key()).await.unwrap());
    let t = open_or_create(&db, name).await.unwrap();
    assert!(primary_key_declared(&t, name.key()).await.unwrap());
    let again = open_or_create(&db, name).await.unwrap();
    assert!(primary_key_declared(&again, name.key()).await.unwrap());
    // The stale handle from before the upgrade learns it too.
    ensure_primary_key(&old, name.key()).await.unwrap();
}

/// Instances that start together on a fresh store race to create every
/// table. Each must come up with the table the winner made: the losers see
/// `TableAlreadyExists` or a Lance commit conflict, never an error that
/// stops them (CI saw one of three instances die on `creating turn_vectors`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_racing_to_create_a_table_all_open_it() {
    for round in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let uri = dir.path().to_str().unwrap().to_owned();
        let name = TableName::Interactions;
        let openers = (0..6).map(|_| {
            let uri = uri.clone();
            tokio::spawn(async move {
                let db = lancedb::connect(&uri).execute().await.unwrap();
                open_or_create(&db, name).await.map(|_| ())
            })
        });
        for (i, r) in futures::future::join_all(openers)
            .await
            .into_iter()
            .enumerate()
        {
            r.unwrap()
                .unwrap_or_else(|e| panic!("round {round}, instance {i}: {e:#}"));
        }
        let db = lancedb::connect(&uri).execute().await.unwrap();
        assert_eq!(db.table_names().execute().await.unwrap(), [name.as_str()]);
    }
}

/// Two writers insert the same new keys at the same moment, round after
/// round: a batch replayed by the instance that took over a partition
/// while the one that lost it still writes it (a broker restart makes
/// this happen). Each key must be stored once. Both merges find the keys
/// absent and each commit only adds a fragment, so LanceDB sees no
/// conflict unless the commits name the keys they insert (lance issue
/// 4585): [`insert_absent`] does, on either side of `reindex_rows`.
async fn same_new_keys_from_two_writers(reindex_rows: u64) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LanceDbConfig {
        reindex_rows,
        ..lancedb_config(dir.path())
    };
    let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let rounds = 30;
    let mut retries = 0;
    for round in 0..rounds {
        let ids: Vec<String> = (0..25).map(|i| click(&format!("r{round}-{i}"))).collect();
        let batch = batches(&ids).interactions.unwrap();
        let write =
            |s: LanceSink, batch: RecordBatch| async move { write_retrying(&s, &batch).await };
        let (ra, rb) = tokio::join!(
            tokio::spawn(write(a.clone(), batch.clone())),
            tokio::spawn(write(b.clone(), batch))
        );
        retries += ra.unwrap() + rb.unwrap();
    }
    a.settle().await;
    b.settle().await;
    let t = a.table(TableName::Interactions);
    t.checkout_latest().await.unwrap();
    assert_eq!(
        key_index(t, TableName::Interactions)
            .await
            .unwrap()
            .is_some(),
        reindex_rows > 0,
        "the merges ran on the path under test"
    );
    assert_eq!(
        t.count_rows(None).await.unwrap(),
        25 * rounds,
        "{retries} writes retried"
    );
    eprintln!(
        "same new keys from two writers (reindex_rows {reindex_rows}): {retries} writes retried"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_inserting_the_same_new_keys_store_each_once() {
    same_new_keys_from_two_writers(0).await;
}

/// The same through the key's BTree index, where LanceDB's own
/// `merge_insert` stored such keys twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_inserting_the_same_new_keys_through_the_index_store_each_once() {
    same_new_keys_from_two_writers(20).await;
}

/// Two writers (separate connections, as two processes) commit to the
/// same table at once, with overlapping keys (a replay racing a live
/// write): every key once, none lost. Failed commits are retried, as the
/// pipeline's writer does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_on_one_table_write_each_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lancedb_config(dir.path());
    let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let run = |s: LanceSink, from: usize| async move {
        let mut retries = 0;
        for chunk in (from..from + 1200).collect::<Vec<_>>().chunks(25) {
            let ids: Vec<String> = chunk.iter().map(|i| click(&format!("e{i}"))).collect();
            let batch = batches(&ids).interactions.unwrap();
            retries += write_retrying(&s, &batch).await;
        }
        retries
    };
    // Keys 0..1200 and 600..1800: 600 written by both, concurrently.
    let (ra, rb) = tokio::join!(tokio::spawn(run(a.clone(), 0)), tokio::spawn(run(b, 600)));
    let retries = ra.unwrap() + rb.unwrap();
    let t = a.table(TableName::Interactions);
    t.checkout_latest().await.unwrap();
    assert_eq!(t.count_rows(None).await.unwrap(), 1800, "{retries} retries");
    let out = crate::sql::query(
        &cfg,
        "SELECT count(DISTINCT event_id) AS n FROM interactions",
    )
    .await
    .unwrap();
    use arrow_array::cast::AsArray;
    let distinct = out[0]
        .column(0)
        .as_primitive::<arrow_array::types::Int64Type>()
        .value(0);
    assert_eq!(distinct, 1800);
    eprintln!("two writers: {retries} commits retried");
}

fn paths(s: &LanceSink) -> (u64, u64) {
    let n = |p: &str| {
        s.metrics
            .fresh_writes
            .with_label_values(&["interactions", p])
            .get()
    };
    (n("fresh"), n("exact"))
}

fn clicks(ids: std::ops::Range<usize>) -> RecordBatch {
    let ids: Vec<String> = ids.map(|i| click(&format!("e{i}"))).collect();
    batches(&ids).interactions.unwrap()
}

/// New keys skip the lookup; a replay, a re-send among new keys, and a
/// replay after a restart (the ledger reloaded from the table) take it
/// and add nothing.
#[tokio::test]
async fn fresh_batches_skip_the_lookup_and_replays_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lancedb_config(dir.path());
    let t = TableName::Interactions;
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    for r in [0..10, 10..20] {
        assert_eq!(s.write(t, &clicks(r)).await.unwrap().inserted, 10);
    }
    assert_eq!(paths(&s), (2, 0));
    let replay = s.write(t, &clicks(0..10)).await.unwrap();
    assert_eq!((replay.inserted, replay.skipped), (0, 10));
    let resend = s.write(t, &clicks(15..25)).await.unwrap();
    assert_eq!((resend.inserted, resend.skipped), (5, 5));
    assert_eq!(paths(&s), (2, 2));
    assert_eq!(count(&s, t).await, 25);
    drop(s);
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let replay = s.write(t, &clicks(20..25)).await.unwrap();
    assert_eq!(replay.inserted, 0);
    s.write(t, &clicks(25..30)).await.unwrap();
    assert_eq!(paths(&s), (1, 1));
    assert_eq!(count(&s, t).await, 30);
}

/// A batch that repeats a key is not fresh (the ledger sees the key
/// twice): it takes the exact path, which stores the key once; the
/// next batch of new keys is fresh again.
#[tokio::test]
async fn a_batch_repeating_a_key_takes_the_exact_path_and_stores_it_once() {
    let (_dir, s) = sink().await;
    let t = TableName::Interactions;
    let twice = batches(&[click("a"), click("b"), click("a")])
        .interactions
        .unwrap();
    let w = s.write(t, &twice).await.unwrap();
    assert_eq!((w.inserted, w.skipped), (2, 0));
    assert_eq!(paths(&s), (0, 1));
    let next = batches(&[click("c"), click("d")]).interactions.unwrap();
    assert_eq!(s.write(t, &next).await.unwrap().inserted, 2);
    assert_eq!(paths(&s), (1, 1));
    assert_eq!(count(&s, t).await, 4);
}

/// A fresh batch whose keys another writer committed after this
/// writer's ledger was current (the instance that lost a partition
/// still writing it): the commit conflicts, and the lookup finds them.
#[tokio::test]
async fn a_fresh_batch_another_writer_committed_meanwhile_is_looked_up() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lancedb_config(dir.path());
    let t = TableName::Interactions;
    let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    b.write(t, &clicks(0..5)).await.unwrap();
    a.write(t, &clicks(5..15)).await.unwrap();
    let again = b.write(t, &clicks(5..15)).await.unwrap();
    assert_eq!((again.inserted, again.skipped), (0, 10));
    assert_eq!(paths(&b), (1, 1), "tried fresh, then looked up");
    // b learned a's keys from its commit: a replay now goes straight to the lookup.
    b.write(t, &clicks(5..15)).await.unwrap();
    assert_eq!(paths(&b), (1, 2));
    let table = a.table(t);
    table.checkout_latest().await.unwrap();
    assert_eq!(table.count_rows(None).await.unwrap(), 15);
}

/// A sink that has written clicks 0..5 (so its ledger is loaded), and
/// a second connection to the same tables.
async fn ledger_loaded_and_another_connection() -> (tempfile::TempDir, LanceSink, Connection) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = lancedb_config(dir.path());
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    s.write(TableName::Interactions, &clicks(0..5))
        .await
        .unwrap();
    let other = connect(&cfg).await.unwrap();
    (dir, s, other)
}

/// Another instance overwrites the table after this one loaded its
/// ledger (both created it at once): the fresh commit from the ledger's
/// version can never pass, so the failed write drops the ledger and the
/// retry, as the writer retries, reloads it and lands.
#[tokio::test]
async fn an_overwrite_after_the_ledger_loaded_is_survived_by_a_retry() {
    let t = TableName::Interactions;
    let (_dir, s, other) = ledger_loaded_and_another_connection().await;
    let empty = RecordBatch::new_empty(t.schema());
    other
        .create_table(
            t.as_str(),
            Box::new(RecordBatchIterator::new([Ok(empty)], t.schema()))
                as Box<dyn arrow_array::RecordBatchReader + Send>,
        )
        .mode(lancedb::database::CreateTableMode::Overwrite)
        .execute()
        .await
        .unwrap();
    let batch = clicks(5..10);
    let mut failures = 0;
    while let Err(e) = s.write(t, &batch).await {
        failures += 1;
        assert!(failures < 3, "the retry did not recover: {e}");
    }
    assert_eq!(count(&s, t).await, 5, "the overwrite emptied the table");
}

/// Rows added by another tool without naming their keys (a plain
/// append): the next fresh commit conflicts with it, and the ledger
/// reloads from the table.
#[tokio::test]
async fn an_append_the_ledger_cannot_read_reloads_it() {
    let t = TableName::Interactions;
    let (_dir, s, other) = ledger_loaded_and_another_connection().await;
    let table = other.open_table(t.as_str()).execute().await.unwrap();
    let appended = clicks(5..10);
    let schema = appended.schema();
    table
        .add(Box::new(RecordBatchIterator::new([Ok(appended)], schema))
            as Box<dyn arrow_array::RecordBatchReader + Send>)
        .execute()
        .await
        .unwrap();
    let w = s.write(t, &clicks(8..12)).await.unwrap();
    assert_eq!((w.inserted, w.skipped), (2, 2));
    assert!(s.tables[&t].ledger.lock().await.is_none(), "to be reloaded");
    let w = s.write(t, &clicks(5..10)).await.unwrap();
    assert_eq!(w.inserted, 0, "the reloaded ledger knows the appended keys");
    assert_eq!(paths(&s), (1, 2));
    assert_eq!(count(&s, t).await, 12);
}

/// Two writers upsert the same new items at the same moment, through
/// the key's index (as two instances ingesting one catalogue): each item
/// once, at its newest version. LanceDB's own `merge_insert` commits
/// without naming the keys on that path and stored such items twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_upserting_the_same_new_items_through_the_index_store_each_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LanceDbConfig {
        reindex_rows: 20,
        ..lancedb_config(dir.path())
    };
    let a = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let b = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let rounds = 20;
    let mut retries = 0;
    for round in 0..rounds {
        // Writer a has version 1 of each item, writer b version 2.
        let version = |v: i64| -> RecordBatch {
            let events: Vec<String> = (0..25)
                .map(|i| {
                    format!(
                        r#"{{"type":"item","schema_version":1,"event_id":"r{round}-{i}-v{v}","timestamp":{},"item_id":"r{round}-{i}","title":"v{v}"}}"#,
                        1000 * v
                    )
                })
                .collect();
            batches(&events).items.unwrap()
        };
        let write = |s: LanceSink, batch: RecordBatch| async move {
            let mut tries = 0;
            while let Err(e) = s.write(TableName::Items, &batch).await {
                tries += 1;
                assert!(tries < 20, "{e}");
            }
            tries
        };
        let (ra, rb) = tokio::join!(
            tokio::spawn(write(a.clone(), version(1))),
            tokio::spawn(write(b.clone(), version(2)))
        );
        retries += ra.unwrap() + rb.unwrap();
    }
    a.settle().await;
    b.settle().await;
    let t = a.table(TableName::Items);
    t.checkout_latest().await.unwrap();
    assert!(
        key_index(t, TableName::Items).await.unwrap().is_some(),
        "the merges ran through the index"
    );
    assert_eq!(
        t.count_rows(None).await.unwrap(),
        25 * rounds,
        "{retries} retries"
    );
    let old = t.count_rows(Some("title = 'v1'".into())).await.unwrap();
    assert_eq!(old, 0, "every item at its newest version");
}

#[tokio::test]
async fn items_upsert_newest_wins_and_replays_converge() {
    let (_dir, s) = sink().await;
    let v2 = batches(&[item("e2", 2000, "New title")]).items.unwrap();
    let v1 = batches(&[item("e1", 1000, "Old title")]).items.unwrap();
    s.write(TableName::Items, &v2).await.unwrap();
    // An older version arriving late changes nothing; a replay of v2 neither.
    let late = s.write(TableName::Items, &v1).await.unwrap();
    assert_eq!((late.inserted, late.updated), (0, 0));
    let replay = s.write(TableName::Items, &v2).await.unwrap();
    assert_eq!((replay.inserted, replay.updated), (0, 0));
    let v3 = batches(&[item("e3", 3000, "Newest"), item("e0", 500, "Ancient")])
        .items
        .unwrap();
    let up = s.write(TableName::Items, &v3).await.unwrap();
    assert_eq!(
        (up.inserted, up.updated),
        (0, 1),
        "within a batch the newest row is kept"
    );
    assert_eq!(count(&s, TableName::Items).await, 1);
    let rows = crate::sql::query_table(s.table(TableName::Items), "SELECT title FROM t")
        .await
        .unwrap();
    let titles = arrow_cast::pretty::pretty_format_batches(&rows)
        .unwrap()
        .to_string();
    assert!(titles.contains("Newest"), "{titles}");
}

#[tokio::test]
async fn stored_versions_finds_keys_with_quotes() {
    let (_dir, s) = sink().await;
    let it = |id: &str, ev: &str, ts: i64| {
        format!(
            r#"{{"type":"item","schema_version":1,"event_id":"{ev}","timestamp":{ts},"item_id":"{id}","title":"t"}}"#
        )
    };
    let events = vec![it("it-e1", "e1", 10), it("it-e'2", "e'2", 20)];
    let b = batches(&events);
    s.write(TableName::Items, b.items.as_ref().unwrap())
        .await
        .unwrap();
    let click = batches(&[click("c'1")]);
    s.write(
        TableName::Interactions,
        click.interactions.as_ref().unwrap(),
    )
    .await
    .unwrap();
    let items = s
        .stored_versions(TableName::Items, &["it-e1", "it-e'2", "absent"])
        .await
        .unwrap();
    assert_eq!(items.len(), 2, "{items:?}");
    assert_eq!(items["it-e'2"], (20, "e'2".to_owned()));
    // Per user: another user's row under the same event_id is not it.
    let seen = s
        .stored_turns(
            TableName::Interactions,
            &[("u", "c'1"), ("u", "nope"), ("other", "c'1")],
        )
        .await
        .unwrap();
    assert_eq!(
        seen,
        HashMap::from([(("u".to_owned(), "c'1".to_owned()), 1000)])
    );
}

/// Issue 44, item 4, as the issue gives it: with four keys remembered,
/// e1…e5 (one batch each) push e1 out of the ledger; e1 re-sent with a
/// newer timestamp beside a new event is looked up (key by key, not the
/// whole batch) and stored once. Under 6e978f1 `interactions` held e1
/// twice.
#[tokio::test]
async fn a_re_send_of_a_forgotten_event_with_a_newer_timestamp_is_stored_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LanceDbConfig {
        fresh_keys: 4,
        ..lancedb_config(dir.path())
    };
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let at = |id: &str, ts: i64| {
        format!(
            r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"u","item_id":"i"}}"#
        )
    };
    for n in 1..=5 {
        let b = batches(&[at(&format!("e{n}"), n * 1000)]);
        s.write(TableName::Interactions, b.interactions.as_ref().unwrap())
            .await
            .unwrap();
    }
    let b = batches(&[at("e1", 9000), at("e6", 9000)]);
    let stats = s
        .write(TableName::Interactions, b.interactions.as_ref().unwrap())
        .await
        .unwrap();
    assert_eq!(stats.inserted, 1, "{stats:?}");
    assert_eq!(count(&s, TableName::Interactions).await, 6);
    let lookups = s
        .metrics
        .suspect_lookups
        .with_label_values(&["interactions"])
        .get();
    assert_eq!(lookups, 1, "e1 alone was looked up");
}

/// Issue 44, item 2: an `event_id` is unique per user, not table-wide.
/// Another tenant's row under the same `event_id`, written first, neither
/// hides this one (under 6e978f1 it was dropped as a duplicate) nor
/// stands in for it; a re-send of either is still stored once, on the
/// fresh path and on the exact path alike.
#[tokio::test]
async fn one_event_id_of_two_users_is_two_rows_and_each_is_stored_once() {
    let (_dir, s) = sink().await;
    let turn = |user: &str, id: &str, text: &str| {
        format!(
            r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":1000,"user_id":"{user}","session_id":"s","role":"user","text":"{text}"}}"#
        )
    };
    let write = |events: Vec<String>| {
        let s = &s;
        async move {
            let b = batches(&events);
            s.write(TableName::Interactions, b.interactions.as_ref().unwrap())
                .await
                .unwrap()
        }
    };
    // The squatter first, then the owner (fresh path: a new key each).
    assert_eq!(
        write(vec![turn("globex:eve", "acme-d-2", "squat")])
            .await
            .inserted,
        1
    );
    assert_eq!(
        write(vec![turn("acme:ann", "acme-d-2", "mine")])
            .await
            .inserted,
        1
    );
    // Both in one batch, with a re-send of each (the exact path).
    let stats = write(vec![
        turn("acme:ann", "acme-d-3", "a"),
        turn("globex:eve", "acme-d-3", "b"),
        turn("acme:ann", "acme-d-3", "a"),
        turn("globex:eve", "acme-d-2", "squat again"),
    ])
    .await;
    assert_eq!(stats.inserted, 2, "{stats:?}");
    assert_eq!(
        write(vec![turn("acme:ann", "acme-d-2", "re-sent")])
            .await
            .inserted,
        0
    );
    let rows = s
        .stored_turns(
            TableName::Interactions,
            &[
                ("acme:ann", "acme-d-2"),
                ("globex:eve", "acme-d-2"),
                ("acme:ann", "acme-d-3"),
                ("globex:eve", "acme-d-3"),
            ],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    let n = s
        .table(TableName::Interactions)
        .count_rows(None)
        .await
        .unwrap();
    assert_eq!(n, 4);
}

/// A `turn_vectors` table written before the sparse columns existed gains
/// them, all null, when a new build opens it; its rows stay.
#[tokio::test]
async fn an_older_turn_vectors_table_gains_the_sparse_columns_on_open() {
    let (dir, s) = sink().await;
    drop(s);
    let cfg = lancedb_config(dir.path());
    let db = connect(&cfg).await.unwrap();
    db.drop_table("turn_vectors", &[]).await.unwrap();
    let full = TableName::TurnVectors.schema();
    let old = Arc::new(arrow_schema::Schema::new(
        full.fields()[..full.fields().len() - 2].to_vec(),
    ));
    let row = RecordBatch::try_new(
        old.clone(),
        old.fields()
            .iter()
            .map(|f| match f.name().as_str() {
                "embedding" => steamrf_schemas::tables::embedding_array(
                    &[0.5; steamrf_schemas::tables::EMBEDDING_DIM],
                    1,
                )
                .unwrap(),
                _ => arrow_array::new_null_array(f.data_type(), 1),
            })
            .map(|a| match a.data_type() {
                arrow_schema::DataType::Utf8 => {
                    Arc::new(arrow_array::StringArray::from(vec!["x"])) as arrow_array::ArrayRef
                }
                arrow_schema::DataType::Int32 => Arc::new(arrow_array::Int32Array::from(vec![0])),
                arrow_schema::DataType::Int64 => Arc::new(arrow_array::Int64Array::from(vec![0])),
                arrow_schema::DataType::Timestamp(..) => Arc::new(
                    arrow_array::TimestampMillisecondArray::from(vec![0]).with_timezone("UTC"),
                ),
                _ => a,
            })
            .collect(),
    )
    .unwrap();
    db.create_table("turn_vectors", row)
        .execute()
        .await
        .unwrap();
    let s = LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let t = s.table(TableName::TurnVectors);
    assert_eq!(
        t.schema().await.unwrap().fields().len(),
        full.fields().len()
    );
    assert_eq!(t.count_rows(None).await.unwrap(), 1);
    assert_eq!(t.count_rows(Some("terms IS NULL".into())).await.unwrap(), 1);
    // Opening again changes nothing.
    drop(s);
    LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
}

#[tokio::test]
async fn reopening_checks_the_schema() {
    let (dir, s) = sink().await;
    drop(s);
    let cfg = lancedb_config(dir.path());
    LanceSink::open(&cfg, Metrics::new(&[])).await.unwrap();
    let db = connect(&cfg).await.unwrap();
    db.drop_table("profiles", &[]).await.unwrap();
    let wrong = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
        "user_id",
        arrow_schema::DataType::Utf8,
        false,
    )]));
    db.create_empty_table("profiles", wrong)
        .execute()
        .await
        .unwrap();
    let err = LanceSink::open(&cfg, Metrics::new(&[]))
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("table profiles exists with a different schema"),
        "{err}"
    );
}
