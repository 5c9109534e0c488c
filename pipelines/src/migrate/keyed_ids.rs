//! The migration of 63-bit memory ids to keyed 128-bit ids (see the
//! parent module's docs): the map from each stored id to its new one, then
//! `memory_links`, `prototypes` and, last, `memories` rewritten through it.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{Array, ArrayRef, RecordBatch, RecordBatchIterator, StringArray};
use arrow_schema::SchemaRef;
use futures::TryStreamExt;
use lancedb::database::CreateTableMode;
use lancedb::query::ExecutableQuery;
use steamrf_operators::steam::ids::{legacy_fnv, legacy_fnv_profile};
use steamrf_operators::steam::{IdKey, MemoryId};
use steamrf_schemas::memory::MemoryTable;

use super::Report;
use crate::error::{Error, Result};
use crate::sink::admin::has_legacy_ids;
use crate::sink::ids::{id_lists_array, ids_array};

/// Rewrites the memory tables that still hold 63-bit ids.
pub(super) async fn migrate(
    db: &lancedb::Connection,
    key: &IdKey,
    report: &mut Report,
) -> Result<()> {
    let mut legacy = Vec::new();
    for t in MemoryTable::ALL {
        let name = t.as_str();
        let table = match db.open_table(name).execute().await {
            Ok(table) => table,
            Err(lancedb::Error::TableNotFound { .. }) => continue,
            Err(e) => return Err(Error::lance(format!("opening {name}"))(e)),
        };
        let schema = table
            .schema()
            .await
            .map_err(Error::lance(format!("reading the schema of {name}")))?;
        if has_legacy_ids(name, &schema) {
            legacy.push((t, table));
        }
    }
    if legacy.is_empty() {
        return Ok(());
    }
    let memories = match legacy.iter().find(|(t, _)| *t == MemoryTable::Memories) {
        Some((_, table)) => read_all(table).await?,
        // Memories were rewritten by a run cut short after them: nothing
        // left to map links or prototypes to.
        None => Vec::new(),
    };
    let map = id_map(&memories, key, report)?;
    // Memories last: until they are rewritten, a second run rebuilds the map.
    legacy.sort_by_key(|(t, _)| *t == MemoryTable::Memories);
    for (t, table) in legacy {
        let batches = if t == MemoryTable::Memories {
            memories.clone()
        } else {
            read_all(&table).await?
        };
        let mut out = Vec::with_capacity(batches.len());
        for b in &batches {
            let (batch, dropped) = rewrite(t, b, &map)?;
            report.dangling_dropped += dropped;
            out.push(batch);
        }
        let schema = t.schema();
        let reader: Box<dyn arrow_array::RecordBatchReader + Send> = Box::new(
            RecordBatchIterator::new(out.into_iter().map(Ok), schema.clone()),
        );
        db.create_table(t.as_str(), reader)
            .mode(CreateTableMode::Overwrite)
            .execute()
            .await
            .map_err(Error::lance(format!("rewriting {}", t.as_str())))?;
    }
    tracing::info!(
        rewritten = report.memory_ids_rewritten,
        untraced = report.memory_ids_untraced,
        dangling_dropped = report.dangling_dropped,
        "Migrated: memory ids are keyed 128-bit ids."
    );
    Ok(())
}

async fn read_all(table: &lancedb::Table) -> Result<Vec<RecordBatch>> {
    let what = || format!("reading {}", table.name());
    table
        .query()
        .execute()
        .await
        .map_err(Error::lance(what()))?
        .try_collect()
        .await
        .map_err(Error::lance(what()))
}

/// Each stored memory's old id and its id under `key`: the profile
/// memory's, or that of the event that formed it when the old hash of that
/// event is the stored id, else one hashed from the user and the old id.
fn id_map(
    memories: &[RecordBatch],
    key: &IdKey,
    report: &mut Report,
) -> Result<HashMap<i64, MemoryId>> {
    let mut map = HashMap::new();
    for b in memories {
        let (ids, users, first) = (
            column(b, "memory_id")?.as_primitive::<Int64Type>(),
            column(b, "user_id")?.as_string::<i32>(),
            column(b, "interaction_ids")?.as_list::<i32>(),
        );
        for r in 0..b.num_rows() {
            let (old, user) = (ids.value(r), users.value(r));
            let events = first.value(r);
            let event = events.as_string::<i32>().iter().flatten().next();
            let new = if old == legacy_fnv_profile(user) {
                key.profile(user)
            } else if let Some(e) = event.filter(|e| legacy_fnv(user, e) == old) {
                key.memory(user, e)
            } else {
                report.memory_ids_untraced += 1;
                key.legacy(user, old)
            };
            map.insert(old, new);
            report.memory_ids_rewritten += 1;
        }
    }
    Ok(map)
}

fn column<'a>(b: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef> {
    b.column_by_name(name).ok_or_else(|| Error::Internal {
        message: format!("a memory table without column {name}"),
    })
}

/// `b` (rows of `t` with 63-bit ids) under `t`'s schema with the ids
/// mapped; rows whose ids do not map are dropped (their count returned).
fn rewrite(
    t: MemoryTable,
    b: &RecordBatch,
    map: &HashMap<i64, MemoryId>,
) -> Result<(RecordBatch, u64)> {
    let ids = |name: &str| -> Result<Vec<Option<MemoryId>>> {
        let col = column(b, name)?.as_primitive::<Int64Type>();
        Ok((0..col.len())
            .map(|r| {
                col.is_valid(r)
                    .then(|| map.get(&col.value(r)).copied())
                    .flatten()
            })
            .collect())
    };
    let (keep, replaced): (Vec<bool>, Vec<(&str, ArrayRef)>) = match t {
        MemoryTable::Memories => {
            let id = ids("memory_id")?;
            let community = ids("community_id")?;
            let keep: Vec<bool> = id.iter().map(Option::is_some).collect();
            let community: StringArray = community
                .iter()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(c, _)| c.map(|c| c.to_string()))
                .collect();
            (
                keep,
                vec![
                    (
                        "memory_id",
                        Arc::new(ids_array(id.into_iter().flatten())) as ArrayRef,
                    ),
                    ("community_id", Arc::new(community)),
                ],
            )
        }
        MemoryTable::MemoryLinks => {
            let (from, to) = (ids("from_id")?, ids("to_id")?);
            let keep: Vec<bool> = from
                .iter()
                .zip(&to)
                .map(|(f, t)| f.is_some() && t.is_some())
                .collect();
            let ends = |ids: &[Option<MemoryId>]| -> ArrayRef {
                // Both ends of a kept row map.
                Arc::new(ids_array(
                    ids.iter()
                        .zip(&keep)
                        .filter(|(_, k)| **k)
                        .filter_map(|(id, _)| *id),
                ))
            };
            let (from, to) = (ends(&from), ends(&to));
            (keep, vec![("from_id", from), ("to_id", to)])
        }
        MemoryTable::Prototypes => {
            let id = ids("prototype_id")?;
            let members = column(b, "member_ids")?.as_list::<i32>();
            let keep: Vec<bool> = id.iter().map(Option::is_some).collect();
            let lists: Vec<Vec<MemoryId>> = (0..members.len())
                .filter(|&r| keep[r])
                .map(|r| {
                    members
                        .value(r)
                        .as_primitive::<Int64Type>()
                        .values()
                        .iter()
                        .filter_map(|m| map.get(m).copied())
                        .collect()
                })
                .collect();
            (
                keep,
                vec![
                    (
                        "prototype_id",
                        Arc::new(ids_array(id.into_iter().flatten())) as ArrayRef,
                    ),
                    (
                        "member_ids",
                        Arc::new(id_lists_array(lists.iter().map(Vec::as_slice))),
                    ),
                ],
            )
        }
    };
    let kept = arrow_array::BooleanArray::from(keep);
    let dropped = (kept.len() - kept.true_count()) as u64;
    let schema: SchemaRef = t.schema();
    let columns = schema
        .fields()
        .iter()
        .map(|f| match replaced.iter().find(|(n, _)| n == f.name()) {
            // Built from the kept rows only (a kept row's ids all map).
            Some((_, col)) => Ok(col.clone()),
            None => Ok(arrow_select::filter::filter(column(b, f.name())?, &kept)?),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((RecordBatch::try_new(schema, columns)?, dropped))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use arrow_array::{Float32Array, Int32Array, Int64Array, ListArray};
    use arrow_schema::{DataType, Field, Schema};
    use steamrf_operators::steam::memory::Memory;
    use steamrf_operators::steam::{SteamParams, SteamState};
    use steamrf_schemas::tables::EMBEDDING_DIM;

    use super::*;
    use crate::sink::ids::{read_id_lists, read_ids};

    /// `t`'s schema as steamrf wrote it before 2026-12: `Int64` ids.
    fn legacy_schema(t: MemoryTable) -> SchemaRef {
        let fields: Vec<Field> = t
            .schema()
            .fields()
            .iter()
            .map(|f| match f.name().as_str() {
                "memory_id" | "community_id" | "from_id" | "to_id" | "prototype_id" => {
                    f.as_ref().clone().with_data_type(DataType::Int64)
                }
                "member_ids" => {
                    f.as_ref()
                        .clone()
                        .with_data_type(DataType::List(Arc::new(Field::new(
                            "item",
                            DataType::Int64,
                            true,
                        ))))
                }
                _ => f.as_ref().clone(),
            })
            .collect();
        Arc::new(Schema::new(fields))
    }

    fn memory(user: &str, events: &[&str]) -> Memory {
        Memory {
            id: MemoryId::default(),
            user_id: user.into(),
            content: format!("{user}'s interests"),
            embedding: vec![1.0 / (EMBEDDING_DIM as f32).sqrt(); EMBEDDING_DIM],
            interactions: events.iter().map(|e| (*e).to_owned()).collect(),
            items: vec!["i1".into()],
            community: None,
            created_ms: 1,
            updated_ms: 2,
            version: 1,
            facets: BTreeMap::new(),
            recent: Vec::new(),
        }
    }

    async fn create(db: &lancedb::Connection, t: MemoryTable, batch: RecordBatch) {
        let schema = batch.schema();
        let reader: Box<dyn arrow_array::RecordBatchReader + Send> =
            Box::new(RecordBatchIterator::new([Ok(batch)], schema));
        db.create_table(t.as_str(), reader).execute().await.unwrap();
    }

    /// An earlier steamrf's tables: ann's profile memory and a memory she
    /// formed from e1, ben's memory from b1, one memory whose id no event
    /// explains; a link between ann and ben and one to a memory that is
    /// gone; their prototype, with a member that is gone.
    #[tokio::test]
    async fn old_ids_are_refused_then_rewritten_once_under_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let db = lancedb::connect(&dir.path().to_string_lossy())
            .execute()
            .await
            .unwrap();
        let (ann_p, ann_e1, ben_b1, odd, gone) = (
            legacy_fnv_profile("ann"),
            legacy_fnv("ann", "e1"),
            legacy_fnv("ben", "b1"),
            42i64,
            7i64,
        );
        let mems = [
            memory("ann", &["p1"]),
            memory("ann", &["e1", "e2"]),
            memory("ben", &["b1"]),
            memory("cat", &["c1"]),
        ];
        let now = crate::steam::memories_batch(&mems.iter().collect::<Vec<_>>()).unwrap();
        let mut cols = now.columns().to_vec();
        cols[0] = Arc::new(Int64Array::from(vec![ann_p, ann_e1, ben_b1, odd]));
        let community = now.schema().index_of("community_id").unwrap();
        cols[community] = Arc::new(Int64Array::from(vec![
            None,
            Some(ann_e1),
            Some(ann_e1),
            None,
        ]));
        let old = RecordBatch::try_new(legacy_schema(MemoryTable::Memories), cols).unwrap();
        create(&db, MemoryTable::Memories, old).await;
        let links = RecordBatch::try_new(
            legacy_schema(MemoryTable::MemoryLinks),
            vec![
                Arc::new(Int64Array::from(vec![ann_e1, ann_e1])),
                Arc::new(Int64Array::from(vec![ben_b1, gone])),
                Arc::new(StringArray::from(vec!["ann", "ann"])),
                Arc::new(StringArray::from(vec!["ben", "dan"])),
                Arc::new(Float32Array::from(vec![0.9, 0.8])),
            ],
        )
        .unwrap();
        create(&db, MemoryTable::MemoryLinks, links).await;
        let members = ListArray::from_iter_primitive::<Int64Type, _, _>([Some(vec![
            Some(ann_e1),
            Some(ben_b1),
            Some(gone),
        ])]);
        let emb = crate::steam::memories_batch(&[&mems[0]]).unwrap();
        let protos = RecordBatch::try_new(
            legacy_schema(MemoryTable::Prototypes),
            vec![
                Arc::new(Int64Array::from(vec![ann_e1])),
                Arc::new(StringArray::from(vec!["jazz"])),
                emb.column_by_name("embedding").unwrap().clone(),
                Arc::new(members),
                Arc::new(Int32Array::from(vec![2])),
            ],
        )
        .unwrap();
        create(&db, MemoryTable::Prototypes, protos).await;

        // The write path refuses them and names the command.
        for t in MemoryTable::ALL {
            let err = crate::sink::open_or_create_named(&db, t.as_str(), t.schema())
                .await
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains("steamrf migrate") && err.contains("63-bit"),
                "{err}"
            );
        }

        let key = IdKey::from_secret("deployment secret");
        let mut report = Report::default();
        migrate(&db, &key, &mut report).await.unwrap();
        assert_eq!(
            (
                report.memory_ids_rewritten,
                report.memory_ids_untraced,
                report.dangling_dropped
            ),
            (4, 1, 1)
        );
        let open = |t: MemoryTable| crate::sink::open_or_create_named(&db, t.as_str(), t.schema());
        let (memories, links, prototypes) = (
            open(MemoryTable::Memories).await.unwrap(),
            open(MemoryTable::MemoryLinks).await.unwrap(),
            open(MemoryTable::Prototypes).await.unwrap(),
        );
        let (ann_e1, ben_b1) = (key.memory("ann", "e1"), key.memory("ben", "b1"));
        let mut got = Vec::new();
        for b in read_all(&memories).await.unwrap() {
            let ids = read_ids(column(&b, "memory_id").unwrap(), "m").unwrap();
            let community =
                crate::sink::ids::read_opt_ids(column(&b, "community_id").unwrap(), "c").unwrap();
            let users = column(&b, "user_id").unwrap().as_string::<i32>();
            for r in 0..b.num_rows() {
                got.push((users.value(r).to_owned(), ids[r], community[r]));
            }
        }
        got.sort();
        let mut want = vec![
            ("ann".to_owned(), key.profile("ann"), None),
            ("ann".to_owned(), ann_e1, Some(ann_e1)),
            ("ben".to_owned(), ben_b1, Some(ann_e1)),
            ("cat".to_owned(), key.legacy("cat", odd), None),
        ];
        want.sort();
        assert_eq!(got, want);
        let l = read_all(&links).await.unwrap();
        assert_eq!(l.iter().map(RecordBatch::num_rows).sum::<usize>(), 1);
        assert_eq!(
            read_ids(column(&l[0], "from_id").unwrap(), "f").unwrap(),
            [ann_e1]
        );
        assert_eq!(
            read_ids(column(&l[0], "to_id").unwrap(), "t").unwrap(),
            [ben_b1]
        );
        let p = read_all(&prototypes).await.unwrap();
        assert_eq!(
            read_ids(column(&p[0], "prototype_id").unwrap(), "p").unwrap(),
            [ann_e1]
        );
        assert_eq!(
            read_id_lists(column(&p[0], "member_ids").unwrap(), "m").unwrap(),
            [vec![ann_e1, ben_b1]]
        );

        // The STEAM stage restores them under this key, and refuses another.
        let params = |secret: &str| SteamParams {
            evolve: steamrf_operators::steam::memory::EvolveParams {
                id_key: IdKey::from_secret(secret),
                ..Default::default()
            },
            ..SteamParams::default()
        };
        let state = SteamState::new(params("deployment secret"), EMBEDDING_DIM);
        let state = crate::steam::load_state(&memories, &links, state)
            .await
            .unwrap();
        assert_eq!(state.len(), 4);
        let other = SteamState::new(params("another secret"), EMBEDDING_DIM);
        let err = crate::steam::load_state(&memories, &links, other)
            .await
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("steam.id_key"), "{err}");

        // A second run finds nothing to do.
        let mut again = Report::default();
        migrate(&db, &key, &mut again).await.unwrap();
        assert_eq!(again, Report::default());
    }
}
