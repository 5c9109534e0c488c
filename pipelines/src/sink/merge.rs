//! The idempotent writes: insert-if-absent on a table's key (a batch
//! deduplicated first, keys already stored skipped), and the upsert where a
//! row replaces the stored one only if it is newer by `(timestamp,
//! event_id)`; each one LanceDB commit, retried on a conflict.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{RecordBatch, UInt32Array};
use lancedb::Table;
use steamrf_schemas::TableName;

use super::fresh;
use crate::error::{Chain, Error, Result};

/// How many times [`merge_keyed`] recomputes a write that lost a commit
/// race to a concurrent write of the same keys.
pub(super) const INSERT_ATTEMPTS: u32 = 10;

/// Which rows of a keyed merge replace stored ones: the newer version of an
/// item or profile (by timestamp, then event id).
pub(super) const NEWER: &str = "target.timestamp < source.timestamp OR (target.timestamp = source.timestamp AND target.event_id < source.event_id)";

/// The exact path of an insert-if-absent table: [`dedup_absent`], then
/// [`insert_absent`]; returns `(rows after the dedup, inserted, updated,
/// version)`.
pub(super) async fn dedup_insert_absent(
    table: &Table,
    name: TableName,
    batch: &RecordBatch,
    rows: Vec<(u64, i64)>,
) -> lancedb::Result<(u64, u64, u64, u64)> {
    let (batch, rows) = dedup_absent(name, batch, rows).map_err(|e| lancedb::Error::Runtime {
        message: format!("deduplicating a batch for {}: {e}", name.as_str()),
    })?;
    let n = batch.num_rows() as u64;
    let (i, u, v) = insert_absent(table, name, batch, rows.iter().map(|r| r.0)).await?;
    Ok((n, i, u, v))
}

/// Inserts the rows of `batch` whose key ([`TableName::key_columns`]: the
/// pair `(event_id, user_id)`) is not in `table` yet (keys unique within
/// the batch), in one commit; returns `(inserted, 0, version)`. Both
/// columns carry a BTree index, so lance probes both and joins on the pair.
///
/// LanceDB's `merge_insert` finds the present keys through the key's BTree
/// index, but that path commits without naming the keys it inserted (lance
/// 14: only its unindexed path does), so two writers inserting the same new
/// key at once both commit it: a batch replayed by the instance that took
/// over a partition while the one that lost it still writes it. This runs
/// the same merge uncommitted, names every key of the batch in the commit
/// (an exact set of key hashes, the form lance compares exactly), and
/// commits it through lance: a concurrent commit that names one of the same
/// keys makes this one conflict, and the retry finds the keys present.
pub(super) async fn insert_absent(
    table: &Table,
    name: TableName,
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
) -> lancedb::Result<(u64, u64, u64)> {
    merge_keyed(table, name.key_columns(), batch, hashes, None).await
}

/// Upserts `batch` by `key` (keys unique within the batch): new keys are
/// inserted, stored rows replaced where [`NEWER`]; returns `(inserted,
/// updated, version)`. Committed as [`insert_absent`] commits, naming every
/// key of the batch, so two writers upserting the same new item at once
/// store it once: the later conflicts, and its retry updates the row the
/// first stored (or leaves it, if that one is newer).
pub(super) async fn upsert_newer(
    table: &Table,
    key: &str,
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
) -> lancedb::Result<(u64, u64, u64)> {
    merge_keyed(table, &[key], batch, hashes, Some(NEWER)).await
}

/// The merge of [`insert_absent`] (`update_if` None: matched rows are kept)
/// or [`upsert_newer`] (matched rows replaced where `update_if` holds), on
/// the columns `on`. The commit names the hashes of the first column's
/// values (`hashes`): two writers inserting one `event_id` for different
/// users conflict needlessly, and the retry finds the other's row is not
/// its pair.
pub(super) async fn merge_keyed(
    table: &Table,
    on: &[&str],
    batch: RecordBatch,
    hashes: impl Iterator<Item = u64> + Clone,
    update_if: Option<&str>,
) -> lancedb::Result<(u64, u64, u64)> {
    use lance::dataset::transaction::Operation;
    use lance::dataset::{CommitBuilder, MergeInsertBuilder, WhenMatched, WhenNotMatched};

    let handle = table.dataset().ok_or_else(|| not_native(table))?;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let dataset = handle.get().await?;
        let key = on[0];
        let mut job = MergeInsertBuilder::try_new(
            dataset.clone(),
            on.iter().map(|c| (*c).to_owned()).collect(),
        )?;
        job.when_matched(match update_if {
            Some(expr) => WhenMatched::update_if(&dataset, expr)?,
            None => WhenMatched::DoNothing,
        })
        .when_not_matched(WhenNotMatched::InsertAll);
        let mut merge = job
            .try_build()?
            .execute_uncommitted_batches(vec![batch.clone()])
            .await?;
        let (inserted, updated) = (merge.stats.num_inserted_rows, merge.stats.num_updated_rows);
        if inserted + updated == 0 {
            // Every key is present (and not older): nothing to commit.
            return Ok((0, 0, dataset.version().version));
        }
        if let Operation::Update {
            inserted_rows_filter,
            ..
        } = &mut merge.transaction.operation
        {
            *inserted_rows_filter = Some(fresh::exact_filter(&dataset, key, hashes.clone())?);
        }
        let mut commit = CommitBuilder::new(dataset);
        if let Some(rows) = merge.affected_rows.take() {
            commit = commit.with_affected_rows(rows);
        }
        match commit.execute(merge.transaction).await {
            Ok(committed) => {
                let version = committed.version().version;
                handle.update(committed);
                return Ok((inserted, updated, version));
            }
            Err(
                e @ (lance::Error::RetryableCommitConflict { .. }
                | lance::Error::TooMuchWriteContention { .. }),
            ) if attempt < INSERT_ATTEMPTS => {
                tracing::debug!(table = table.name(), attempt, error = %Chain(&e), "A keyed merge lost a commit race; recomputing it.");
                table.checkout_latest().await?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The `(user_id, event_id)` of `rows` of `batch`.
pub(super) fn pairs_at<'a>(
    batch: &'a RecordBatch,
    rows: &[usize],
) -> Result<Vec<(&'a str, &'a str)>> {
    let col = |n: &str| {
        batch
            .column_by_name(n)
            .map(|c| c.as_string::<i32>())
            .ok_or_else(|| Error::Internal {
                message: format!("a per-user batch lacks {n}"),
            })
    };
    let (users, ids) = (col("user_id")?, col("event_id")?);
    Ok(rows
        .iter()
        .map(|&r| (users.value(r), ids.value(r)))
        .collect())
}

/// Why `table` has no lance dataset handle (`Table::dataset`).
pub(super) fn not_native(table: &Table) -> lancedb::Error {
    lancedb::Error::NotSupported {
        message: format!("{} is not a local or object-store table", table.name()),
    }
}

/// The error message for a batch without `name`'s key or timestamp column.
pub(super) fn lacks_key(name: TableName) -> String {
    format!(
        "a batch for {} lacks {} or timestamp",
        name.as_str(),
        name.key()
    )
}

/// [`dedup`] for an insert-if-absent table, given each row's key hash and
/// timestamp ([`fresh::keys_of`]), returning with the batch those of the
/// kept rows. One SipHash per key serves the in-batch dedup, the ledger and
/// the commit's key set.
pub(super) fn dedup_absent(
    name: TableName,
    batch: &RecordBatch,
    rows: Vec<(u64, i64)>,
) -> Result<(RecordBatch, Vec<(u64, i64)>)> {
    let key = name.key();
    let lacks = || Error::Internal {
        message: lacks_key(name),
    };
    let general = || -> Result<(RecordBatch, Vec<(u64, i64)>)> {
        let batch = dedup(name, batch)?;
        let rows = fresh::keys_of(&batch, key).ok_or_else(lacks)?;
        Ok((batch, rows))
    };
    if rows.len() != batch.num_rows() {
        // Null keys (no table schema allows them).
        return general();
    }
    let keys = batch
        .column_by_name(key)
        .ok_or_else(lacks)?
        .as_string::<i32>();
    let users = batch
        .column_by_name("user_id")
        .ok_or_else(lacks)?
        .as_string::<i32>();
    let mut first =
        fresh::HashMap::<u64, u32>::with_capacity_and_hasher(rows.len(), Default::default());
    let mut repeats = Vec::new();
    for (i, (h, _)) in rows.iter().enumerate() {
        match first.entry(*h) {
            Entry::Vacant(v) => {
                v.insert(i as u32);
            }
            Entry::Occupied(o) => {
                let j = *o.get() as usize;
                if keys.value(j) != keys.value(i) || users.value(j) != users.value(i) {
                    // Two keys with one 64-bit hash, or one event_id of two
                    // users (both are stored): the general dedup.
                    return general();
                }
                repeats.push(i);
            }
        }
    }
    if repeats.is_empty() {
        return Ok((batch.clone(), rows));
    }
    let mut repeated = repeats.into_iter().peekable();
    let keep: Vec<u32> = (0..batch.num_rows())
        .filter(|&i| repeated.next_if_eq(&i).is_none())
        .map(|i| i as u32)
        .collect();
    let rows = keep.iter().map(|&i| rows[i as usize]).collect();
    let batch = arrow_select::take::take_record_batch(batch, &UInt32Array::from(keep))?;
    Ok((batch, rows))
}

/// Removes rows whose key ([`TableName::key_columns`]) repeats within the
/// batch: for the per-user tables the first occurrence of each
/// `(event_id, user_id)` stays; for items and profiles the newest by
/// `(timestamp, event_id)`. merge_insert requires unique source keys.
pub(crate) fn dedup(name: TableName, batch: &RecordBatch) -> Result<RecordBatch> {
    let col = |n: &str| {
        batch.column_by_name(n).ok_or_else(|| Error::Internal {
            message: format!("batch for {} lacks {n}", name.as_str()),
        })
    };
    let keys = col(name.key())?.as_string::<i32>();
    let mut keep: HashMap<&str, u32> = HashMap::with_capacity(batch.num_rows());
    match name {
        TableName::Interactions | TableName::TurnVectors | TableName::Passages => {
            // By (user_id, event_id): one event_id of two users is two rows.
            let users = col("user_id")?.as_string::<i32>();
            let mut pairs: HashMap<(&str, &str), u32> = HashMap::with_capacity(batch.num_rows());
            for (i, k) in keys.iter().enumerate() {
                pairs
                    .entry((k.unwrap_or_default(), users.value(i)))
                    .or_insert(i as u32);
            }
            if pairs.len() == batch.num_rows() {
                return Ok(batch.clone());
            }
            let mut idx: Vec<u32> = pairs.into_values().collect();
            idx.sort_unstable();
            return Ok(arrow_select::take::take_record_batch(
                batch,
                &UInt32Array::from(idx),
            )?);
        }
        TableName::Items | TableName::Profiles => {
            let ts = col("timestamp")?.as_primitive::<TimestampMillisecondType>();
            let ids = col("event_id")?.as_string::<i32>();
            let rank = |i: usize| (ts.value(i), ids.value(i));
            for (i, k) in keys.iter().enumerate() {
                match keep.entry(k.unwrap_or_default()) {
                    Entry::Vacant(v) => {
                        v.insert(i as u32);
                    }
                    Entry::Occupied(mut o) => {
                        if rank(i) > rank(*o.get() as usize) {
                            o.insert(i as u32);
                        }
                    }
                }
            }
        }
    }
    if keep.len() == batch.num_rows() {
        return Ok(batch.clone());
    }
    let mut idx: Vec<u32> = keep.into_values().collect();
    idx.sort_unstable();
    Ok(arrow_select::take::take_record_batch(
        batch,
        &UInt32Array::from(idx),
    )?)
}
