//! The tables' BTree indexes: created when missing, new fragments indexed
//! as segments merged like a binary counter, so keeping a key index up to
//! date costs the new rows, not the table.

use std::collections::HashMap;

use lance::index::DatasetIndexExt as _;
use lancedb::Table;
use lancedb::index::Index;
use lancedb::table::OptimizeAction;
use steamrf_schemas::TableName;

use crate::error::{Error, Result};

/// Brings a BTree index on each of `columns` up to date: creates the
/// missing ones, and indexes new fragments in the existing ones as a new
/// segment, merged with the newest segments as [`segments_to_merge`] says.
///
/// # Errors
/// LanceDB failures.
pub async fn ensure_btree(table: &Table, columns: &[&str]) -> Result<()> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    let mut existed = false;
    for c in columns {
        if indices.iter().any(|i| i.columns == [*c]) {
            existed = true;
            continue;
        }
        table
            .create_index(&[*c], Index::BTree(Default::default()))
            .execute()
            .await
            .map_err(Error::lance(format!(
                "creating the {c} index of {}",
                table.name()
            )))?;
    }
    if !existed {
        return Ok(());
    }
    let Some(handle) = table.dataset() else {
        // Not a local or object-store table: LanceDB's default update.
        return table
            .optimize(OptimizeAction::Index(Default::default()))
            .await
            .map(drop)
            .map_err(Error::lance(format!(
                "updating the indexes of {}",
                table.name()
            )));
    };
    let dataset = handle
        .get()
        .await
        .map_err(Error::lance(format!("reading {}", table.name())))?;
    for index in indices
        .iter()
        .filter(|i| columns.iter().any(|c| i.columns == [*c]))
    {
        let (sizes, unindexed) = segment_rows(&dataset, &index.name).await?;
        let merge = segments_to_merge(&sizes, unindexed);
        table
            .optimize(OptimizeAction::Index(
                lancedb::table::OptimizeOptions::merge(merge).index_names(vec![index.name.clone()]),
            ))
            .await
            .map_err(Error::lance(format!(
                "updating the {} index of {}",
                index.name,
                table.name()
            )))?;
    }
    Ok(())
}

/// The rows of each segment of index `name` (oldest first), and the rows
/// no segment covers.
pub(super) async fn segment_rows(dataset: &lance::Dataset, name: &str) -> Result<(Vec<u64>, u64)> {
    let segments = dataset
        .load_indices_by_name(name)
        .await
        .map_err(|e| Error::lance(format!("reading the {name} index"))(e.into()))?;
    let rows: HashMap<u32, u64> = dataset
        .get_fragments()
        .iter()
        .map(|f| {
            let n = f.metadata().physical_rows.unwrap_or(0);
            (f.id() as u32, n as u64)
        })
        .collect();
    let bitmaps: Vec<_> = segments
        .iter()
        .filter_map(|s| s.fragment_bitmap.as_ref())
        .collect();
    let sizes = bitmaps
        .iter()
        .map(|b| b.iter().map(|f| rows.get(&f).copied().unwrap_or(0)).sum())
        .collect();
    let unindexed = rows
        .iter()
        .filter(|(f, _)| !bitmaps.iter().any(|b| b.contains(**f)))
        .map(|(_, n)| n)
        .sum();
    Ok((sizes, unindexed))
}

/// The segments of the BTree index on `column` of `table` (0: no index).
///
/// # Errors
/// LanceDB failures, or a table that is not local or on object storage.
pub async fn index_segments(table: &Table, column: &str) -> Result<usize> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    let Some(index) = indices.iter().find(|i| i.columns == [column]) else {
        return Ok(0);
    };
    let handle = table.dataset().ok_or_else(|| Error::Internal {
        message: format!("{} is not a native table", table.name()),
    })?;
    let dataset = handle
        .get()
        .await
        .map_err(Error::lance(format!("reading {}", table.name())))?;
    let (sizes, _) = segment_rows(&dataset, &index.name).await?;
    Ok(sizes.len())
}

/// How many of an index's newest segments an update folds together with
/// the rows no segment covers yet (`sizes`: each segment's rows, oldest
/// first), so that updating a large table costs what it adds, not what it
/// holds.
///
/// LanceDB's default update merges the newest segment with the new rows,
/// and with a single segment that is every key of the table: an update
/// every `lancedb.reindex_rows` rows then sorts the whole key column, so the
/// index's cost per ingested row grows with the table. Here the new rows
/// become a segment of their own, merged with the newest segments only
/// while they are at least as large together as the next older one (a
/// binary counter's carries, as in an LSM tree's tiers): each key is merged
/// O(log(table / update)) times, and there are as many segments. A lookup
/// asks every segment.
pub(super) fn segments_to_merge(sizes: &[u64], new_rows: u64) -> usize {
    let mut carried = new_rows;
    let mut merged = 0;
    for &older in sizes.iter().rev() {
        if carried < older {
            break;
        }
        carried += older;
        merged += 1;
    }
    merged
}

/// The columns of `name` with a BTree index: the key (idempotent writes),
/// and for the per-user tables also `user_id` (the retrieval service reads
/// one user's rows at a time).
pub fn indexed_columns(name: TableName) -> &'static [&'static str] {
    match name {
        TableName::Interactions | TableName::TurnVectors | TableName::Passages => {
            &["event_id", "user_id"]
        }
        TableName::Items => &["item_id"],
        TableName::Profiles => &["user_id"],
    }
}

/// The name of the index on `name`'s key column, if there is one.
#[cfg(test)]
pub(super) async fn key_index(table: &Table, name: TableName) -> Result<Option<String>> {
    let indices = table
        .list_indices()
        .await
        .map_err(Error::lance("listing indices"))?;
    Ok(indices
        .into_iter()
        .find(|i| i.columns == [name.key()])
        .map(|i| i.name))
}
