//! `steamrf migrate`: brings tables written by an earlier steamrf to the
//! schema this build writes. Ingest and the STEAM stage refuse an
//! unmigrated table by name and say to run it ([`pending`]).
//!
//! One migration so far: **vectors out of `interactions`**. Until
//! 2026-12, `interactions` carried a 384-float `embedding` column, null on
//! every click and purchase. It cost each click row 1,536 bytes in memory
//! and made every idempotent write join over it (about 3x the merge time of
//! the same rows without it). Now the vectors of dialogue turns live in
//! `turn_vectors`, keyed by the turn's `event_id`. The migration
//! 1. copies every non-null `interactions.embedding` into `turn_vectors`
//!    (insert if absent, so it can be run again after a crash), then
//! 2. drops the column from `interactions` (a metadata-only commit in
//!    Lance: the old data files are left in place until the next
//!    `optimize`/cleanup).
//!
//! Stop every ingest instance first; `serve` may keep running (it reads
//! columns by name, and finds the turn vectors in `turn_vectors` after
//! step 1).
//!
//! Then **keyed 128-bit memory ids**. Until 2026-12, a memory's id was
//! FNV-1a of its user and forming event (63 bits, `Int64` columns): anyone
//! could compute and steer one. Now it is a keyed BLAKE3 hash of 128 bits
//! under `steam.id_key` (`steamrf_operators::steam::ids`), written as 32
//! hex digits in `Utf8` columns. The migration maps each stored id to the
//! id this build gives the same memory: the profile memory's, or that of
//! its first interaction (the event that formed it) when the old hash of
//! that event is the stored id; any other (none is expected) gets an id
//! hashed from the user and the old id. It rewrites `memory_links` and
//! `prototypes` through that map (links or members it cannot map are
//! dropped; the STEAM stage rebuilds communities and prototypes on start),
//! then `memories` last, each table in one commit, so a run cut short is
//! run again. It holds the three tables in memory while it runs (a memory
//! is about 1.7 KB). Stop every ingest instance and let the community
//! writer catch up on the changes topic first: records written before the
//! migration carry old ids and are skipped as malformed.
//!
//! And one repair: **links between tenants**. Links, communities and
//! prototypes never cross tenants, but tables written under another
//! `tenancy.separator` (or before one was set) may hold links that do under
//! the one configured now. The STEAM stage refuses to start on them and
//! names this command, which deletes those links and every prototype with a
//! member at either end of one; the STEAM stage rebuilds its communities
//! from what is left, within tenants.

use arrow_array::{RecordBatch, RecordBatchIterator};
use futures::TryStreamExt;
use lancedb::query::{ExecutableQuery, QueryBase, Select};
use steamrf_schemas::TableName;

use steamrf_operators::steam::IdKey;

use crate::config::LanceDbConfig;
use crate::error::{Error, Result};
use crate::sink::admin::pending;

mod keyed_ids;

/// Rows per `turn_vectors` write while copying.
const COPY_ROWS: usize = 8192;

/// What [`migrate`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    /// Turn vectors found in `interactions.embedding`.
    pub turn_vectors_found: u64,
    /// Of those, rows inserted into `turn_vectors` (the rest were there).
    pub turn_vectors_inserted: u64,
    /// Columns dropped, as `table.column`.
    pub dropped: Vec<String>,
    /// Links between tenants deleted from `memory_links`.
    pub links_across_tenants: u64,
    /// Prototypes built across tenants deleted from `prototypes`.
    pub prototypes_across_tenants: u64,
    /// Memory ids rewritten as keyed 128-bit ids.
    pub memory_ids_rewritten: u64,
    /// Of those, ids that could not be traced to their forming event.
    pub memory_ids_untraced: u64,
    /// Links and prototypes dropped because an end or the prototype's own
    /// id named no stored memory.
    pub dangling_dropped: u64,
}

/// Runs every pending migration on the database `cfg` names, with memory
/// ids keyed under `key`, and the repair of links between tenants under
/// `separator` (module docs). Idempotent: on an up-to-date database it
/// changes nothing.
///
/// # Errors
/// LanceDB failures; the migration can then simply be run again.
pub async fn migrate(cfg: &LanceDbConfig, separator: Option<char>, key: &IdKey) -> Result<Report> {
    let db = crate::sink::connect(cfg).await?;
    let mut report = Report::default();
    move_turn_vectors(&db, &mut report).await?;
    keyed_ids::migrate(&db, key, &mut report).await?;
    split_tenants(&db, separator, &mut report).await?;
    Ok(report)
}

/// Deletes the links between users of different tenants and the prototypes
/// with a member at either end of one.
async fn split_tenants(
    db: &lancedb::Connection,
    separator: Option<char>,
    report: &mut Report,
) -> Result<()> {
    use arrow_array::cast::AsArray;
    use steamrf_operators::steam::MemoryId;
    use steamrf_schemas::memory::MemoryTable;
    use steamrf_schemas::tenancy::tenant_of;

    use crate::sink::ids::{read_id_lists, read_ids, sql_list};

    let open = |t: MemoryTable| async move {
        match db.open_table(t.as_str()).execute().await {
            Ok(t) => Ok(Some(t)),
            Err(lancedb::Error::TableNotFound { .. }) => Ok(None),
            Err(e) => Err(Error::lance(format!("opening {}", t.as_str()))(e)),
        }
    };
    let Some(links) = open(MemoryTable::MemoryLinks).await? else {
        return Ok(());
    };
    let read = |t: &lancedb::Table, columns: &'static [&'static str]| {
        let t = t.clone();
        async move {
            let what = || format!("reading {}", t.name());
            t.query()
                .select(Select::columns(columns))
                .execute()
                .await
                .map_err(Error::lance(what()))?
                .try_collect::<Vec<RecordBatch>>()
                .await
                .map_err(Error::lance(what()))
        }
    };
    let mut crossing: Vec<(MemoryId, MemoryId)> = Vec::new();
    for b in read(&links, &["from_id", "to_id", "from_user", "to_user"]).await? {
        let (from, to) = (
            read_ids(b.column(0), "memory_links.from_id")?,
            read_ids(b.column(1), "memory_links.to_id")?,
        );
        let (fu, tu) = (
            b.column(2).as_string::<i32>(),
            b.column(3).as_string::<i32>(),
        );
        for r in 0..b.num_rows() {
            if tenant_of(fu.value(r), separator) != tenant_of(tu.value(r), separator) {
                crossing.push((from[r], to[r]));
            }
        }
    }
    if crossing.is_empty() {
        return Ok(());
    }
    for chunk in crossing.chunks(500) {
        let filter = chunk
            .iter()
            .map(|(f, t)| format!("(from_id = '{f}' AND to_id = '{t}')"))
            .collect::<Vec<_>>()
            .join(" OR ");
        report.links_across_tenants += crate::sink::admin::delete_counted(&links, &filter).await?;
    }
    let ends: std::collections::HashSet<MemoryId> =
        crossing.iter().flat_map(|&(f, t)| [f, t]).collect();
    if let Some(prototypes) = open(MemoryTable::Prototypes).await? {
        let mut doomed = Vec::new();
        for b in read(&prototypes, &["prototype_id", "member_ids"]).await? {
            let ids = read_ids(b.column(0), "prototypes.prototype_id")?;
            let members = read_id_lists(b.column(1), "prototypes.member_ids")?;
            for (id, members) in ids.into_iter().zip(members) {
                if members.iter().any(|m| ends.contains(m)) {
                    doomed.push(id);
                }
            }
        }
        if !doomed.is_empty() {
            let filter = format!("prototype_id IN ({})", sql_list(&doomed));
            report.prototypes_across_tenants =
                crate::sink::admin::delete_counted(&prototypes, &filter).await?;
        }
    }
    tracing::info!(
        links = report.links_across_tenants,
        prototypes = report.prototypes_across_tenants,
        ?separator,
        "Repaired: links and prototypes between tenants deleted."
    );
    Ok(())
}

/// The migration of turn vectors out of `interactions` (module docs).
async fn move_turn_vectors(db: &lancedb::Connection, report: &mut Report) -> Result<()> {
    let interactions = match db
        .open_table(TableName::Interactions.as_str())
        .execute()
        .await
    {
        Ok(t) => t,
        Err(lancedb::Error::TableNotFound { .. }) => return Ok(()),
        Err(e) => return Err(Error::lance("opening interactions")(e)),
    };
    let schema = interactions
        .schema()
        .await
        .map_err(Error::lance("reading the schema of interactions"))?;
    if pending(TableName::Interactions.as_str(), &schema).is_none() {
        return Ok(());
    }
    let vectors = crate::sink::open_or_create(db, TableName::TurnVectors).await?;
    let target = TableName::TurnVectors.schema();
    // The sparse columns are newer than that layout: null on copied rows.
    let sparse = steamrf_schemas::tables::sparse_fields();
    let columns: Vec<&str> = target
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .filter(|c| sparse.iter().all(|f| f.name() != c))
        .collect();
    let mut stream = interactions
        .query()
        .only_if("embedding IS NOT NULL")
        .select(Select::columns(&columns))
        .execute()
        .await
        .map_err(Error::lance("reading interactions"))?;
    let mut pending_rows: Vec<RecordBatch> = Vec::new();
    let mut held = 0;
    while let Some(b) = stream
        .try_next()
        .await
        .map_err(Error::lance("reading interactions"))?
    {
        held += b.num_rows();
        // The columns in `turn_vectors`' order, under its schema.
        let mut cols = b.columns().to_vec();
        cols.extend(
            sparse
                .iter()
                .map(|f| arrow_array::new_null_array(f.data_type(), b.num_rows())),
        );
        pending_rows.push(RecordBatch::try_new(target.clone(), cols)?);
        if held >= COPY_ROWS {
            copy(&vectors, std::mem::take(&mut pending_rows), report).await?;
            held = 0;
        }
    }
    copy(&vectors, pending_rows, report).await?;
    interactions
        .drop_columns(&["embedding"])
        .await
        .map_err(Error::lance("dropping interactions.embedding"))?;
    report.dropped.push("interactions.embedding".into());
    tracing::info!(
        found = report.turn_vectors_found,
        inserted = report.turn_vectors_inserted,
        "Migrated: turn vectors moved from interactions to turn_vectors."
    );
    Ok(())
}

/// Inserts the rows of `batches` that `turn_vectors` lacks.
async fn copy(
    table: &lancedb::Table,
    batches: Vec<RecordBatch>,
    report: &mut Report,
) -> Result<()> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if rows == 0 {
        return Ok(());
    }
    let batch = arrow_select::concat::concat_batches(&TableName::TurnVectors.schema(), &batches)?;
    let batch = crate::sink::dedup(TableName::TurnVectors, &batch)?;
    let mut merge = table.merge_insert(TableName::TurnVectors.key_columns());
    merge.when_not_matched_insert_all();
    let schema = batch.schema();
    let r = merge
        .execute(Box::new(RecordBatchIterator::new([Ok(batch)], schema)))
        .await
        .map_err(Error::lance("writing turn_vectors"))?;
    report.turn_vectors_found += rows as u64;
    report.turn_vectors_inserted += r.num_inserted_rows;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::cast::AsArray;
    use arrow_schema::{Field, Schema};
    use steamrf_schemas::tables::{embedding_field, turn_vectors};

    use super::*;
    use crate::sink::LanceSink;

    /// `interactions` as steamrf wrote it before the split: the current
    /// columns with `embedding` after `text`, set on the turns.
    fn old_interactions() -> (RecordBatch, Vec<f32>) {
        let events = [
            r#"{"type":"click","schema_version":1,"event_id":"c1","timestamp":1000,"user_id":"u","item_id":"i1"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t'1","timestamp":2000,"user_id":"u","session_id":"s","role":"user","text":"jazz"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"t2","timestamp":3000,"user_id":"v","session_id":"s","role":"user","text":"blues"}"#,
        ];
        let now = crate::sink::fixture(&events, 0).interactions.unwrap();
        let mut vectors = vec![0.25f32; steamrf_schemas::tables::EMBEDDING_DIM];
        vectors.extend(vec![-0.5f32; steamrf_schemas::tables::EMBEDDING_DIM]);
        let tv = turn_vectors(&now, &[1, 2], &vectors).unwrap();
        // The old column: null on the click, the vectors on the turns.
        let emb = tv.column_by_name("embedding").unwrap().as_fixed_size_list();
        let emb = arrow_select::interleave::interleave(
            &[
                &arrow_array::new_null_array(embedding_field().data_type(), 1),
                emb as &dyn arrow_array::Array,
            ],
            &[(0, 0), (1, 0), (1, 1)],
        )
        .unwrap();
        let at = now.schema().index_of("text").unwrap() + 1;
        let mut fields: Vec<Field> = now
            .schema()
            .fields()
            .iter()
            .map(|f| (**f).clone())
            .collect();
        fields.insert(at, embedding_field());
        let mut cols = now.columns().to_vec();
        cols.insert(at, emb);
        let old = RecordBatch::try_new(Arc::new(Schema::new(fields)), cols).unwrap();
        (old, vectors)
    }

    fn config(dir: &std::path::Path) -> LanceDbConfig {
        let mut cfg = crate::config::Config::load_with_env(None, [])
            .unwrap()
            .lancedb;
        cfg.uri = dir.to_string_lossy().into_owned();
        cfg
    }

    #[tokio::test]
    async fn old_interactions_are_refused_then_migrated_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let db = crate::sink::connect(&cfg).await.unwrap();
        let (old, vectors) = old_interactions();
        let schema = old.schema();
        let reader: Box<dyn arrow_array::RecordBatchReader + Send> =
            Box::new(RecordBatchIterator::new([Ok(old)], schema));
        db.create_table("interactions", reader)
            .execute()
            .await
            .unwrap();
        // Ingest refuses it, and says what to run.
        let err = LanceSink::open(&cfg, crate::metrics::Metrics::new(&[]))
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("steamrf migrate"), "{err}");

        let r = migrate(&cfg, None, &IdKey::default()).await.unwrap();
        assert_eq!(r.turn_vectors_found, 2);
        assert_eq!(r.turn_vectors_inserted, 2);
        assert_eq!(r.dropped, ["interactions.embedding"]);
        // Now it opens, every row is kept, and the vectors are where the
        // embed stage looks for them.
        let sink = LanceSink::open(&cfg, crate::metrics::Metrics::new(&[]))
            .await
            .unwrap();
        let rows = sink
            .table(TableName::Interactions)
            .count_rows(None)
            .await
            .unwrap();
        assert_eq!(rows, 3);
        let stored = sink
            .stored_vectors(&[("u", "t'1"), ("v", "t2"), ("u", "c1")])
            .await
            .unwrap();
        assert_eq!(stored.len(), 2);
        let key = |u: &str, e: &str| (u.to_owned(), e.to_owned());
        assert_eq!(stored[&key("u", "t'1")], vectors[..384]);
        assert_eq!(stored[&key("v", "t2")], vectors[384..]);
        // A second run finds nothing to do.
        assert_eq!(
            migrate(&cfg, None, &IdKey::default()).await.unwrap(),
            Report::default()
        );
        // And an empty database is no error.
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            migrate(&config(empty.path()), None, &IdKey::default())
                .await
                .unwrap(),
            Report::default()
        );
    }
}
