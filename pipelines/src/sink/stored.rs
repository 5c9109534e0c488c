//! What the stages read back before they write: the stored versions of
//! keys, the stored turns, vectors and session windows, each through the
//! key index ([`lookup`]).

use std::collections::HashMap;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{ArrayRef, RecordBatch};
use lancedb::Table;
use steamrf_schemas::TableName;

use super::LanceSink;
use super::admin;
use crate::error::{Error, Result};

/// The rows of `table` whose `key` is one of `keys` (and that match `also`),
/// `columns` only: `key IN (...)` in chunks of 1,000 literals, through the
/// key's BTree index where it has one.
///
/// # Errors
/// [`Error::Lance`] if a query fails.
pub(crate) async fn lookup(
    table: &Table,
    key: &str,
    keys: &[&str],
    columns: &[&str],
    also: Option<&str>,
) -> Result<Vec<RecordBatch>> {
    use futures::TryStreamExt;
    use lancedb::query::{ExecutableQuery, QueryBase, Select};

    let mut out = Vec::new();
    for chunk in keys.chunks(1000) {
        let list = chunk
            .iter()
            .map(|k| admin::quoted(k))
            .collect::<Vec<_>>()
            .join(",");
        let filter = match also {
            Some(a) => format!("{key} IN ({list}) AND {a}"),
            None => format!("{key} IN ({list})"),
        };
        let what = || format!("looking up {key}s in {}", table.name());
        let batches: Vec<RecordBatch> = table
            .query()
            .only_if(filter)
            .select(Select::columns(columns))
            .execute()
            .await
            .map_err(Error::lance(what()))?
            .try_collect()
            .await
            .map_err(Error::lance(what()))?;
        out.extend(batches);
    }
    Ok(out)
}

impl LanceSink {
    /// The stored `(timestamp, event_id)` of each of `keys` that exists in
    /// `name` (keys absent from the table are absent from the map).
    ///
    /// The embed stage uses it to embed each item version and each dialogue
    /// turn once: rows the write would skip are not embedded.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_versions(
        &self,
        name: TableName,
        keys: &[&str],
    ) -> Result<HashMap<String, (i64, String)>> {
        let mut out = HashMap::new();
        let key = name.key();
        let mut columns = vec![key, "timestamp"];
        if key != "event_id" {
            columns.push("event_id");
        }
        for b in lookup(self.table(name), key, keys, &columns, None).await? {
            let (Some(k), Some(ts), Some(ev)) = (
                b.column_by_name(key),
                b.column_by_name("timestamp"),
                b.column_by_name("event_id"),
            ) else {
                continue;
            };
            let (k, ts, ev) = (
                k.as_string::<i32>(),
                ts.as_primitive::<TimestampMillisecondType>(),
                ev.as_string::<i32>(),
            );
            for i in 0..b.num_rows() {
                out.insert(k.value(i).to_owned(), (ts.value(i), ev.value(i).to_owned()));
            }
        }
        Ok(out)
    }

    /// Which of `keys` (`(user_id, event_id)`) a per-user table holds, with
    /// `column` (`None` where null): a stored row is only ever another row
    /// of the same user (docs/security.md).
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    async fn stored_pairs(
        &self,
        name: TableName,
        keys: &[(&str, &str)],
        column: &str,
    ) -> Result<HashMap<(String, String), Option<ArrayRef>>> {
        use arrow_array::Array;

        let wanted: std::collections::HashSet<(&str, &str)> = keys.iter().copied().collect();
        let mut ids: Vec<&str> = keys.iter().map(|k| k.1).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut out = HashMap::new();
        let columns = ["event_id", "user_id", column];
        for b in lookup(self.table(name), "event_id", &ids, &columns, None).await? {
            let (Some(ev), Some(user), Some(col)) = (
                b.column_by_name("event_id"),
                b.column_by_name("user_id"),
                b.column_by_name(column),
            ) else {
                continue;
            };
            let (ev, user) = (ev.as_string::<i32>(), user.as_string::<i32>());
            for i in 0..b.num_rows() {
                if !wanted.contains(&(user.value(i), ev.value(i))) {
                    continue;
                }
                let value = col.is_valid(i).then(|| col.slice(i, 1));
                out.insert((user.value(i).to_owned(), ev.value(i).to_owned()), value);
            }
        }
        Ok(out)
    }

    /// The stored timestamp of each of `keys` (`(user_id, event_id)`) that a
    /// per-user table holds; the embed stage and the ledger's suspect keys
    /// ask only which are there.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_turns(
        &self,
        name: TableName,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), i64>> {
        Ok(self
            .stored_pairs(name, keys, "timestamp")
            .await?
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?.as_primitive::<TimestampMillisecondType>().value(0))))
            .collect())
    }

    /// The stored vector of each of the dialogue turns `keys` (`(user_id,
    /// event_id)`, from `turn_vectors`; turns without one are absent from
    /// the map). Only the same user's row is ever reused: under 6e978f1 a
    /// turn reusing another tenant's `event_id` was given that tenant's
    /// vector.
    ///
    /// A replayed batch carries the vectors its first attempt stored, so the
    /// STEAM stage observes a replayed turn as it would have the first time,
    /// and nothing is embedded twice.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn stored_vectors(
        &self,
        keys: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), Vec<f32>>> {
        Ok(self
            .stored_pairs(TableName::TurnVectors, keys, "embedding")
            .await?
            .into_iter()
            .filter_map(|(k, v)| {
                let v = v?;
                let list = v.as_fixed_size_list();
                let values = list.value(0);
                Some((
                    k,
                    values
                        .as_primitive::<arrow_array::types::Float32Type>()
                        .values()
                        .to_vec(),
                ))
            })
            .collect())
    }

    /// The stored dialogue turns of `sessions` (user, session):
    /// `(user, session, timestamp, event_id, "role: text")`, unordered.
    /// One query per 500 sessions, through the `user_id` index.
    ///
    /// The embed stage reads the turns that precede a new turn in its
    /// session from here when they are not in the batch.
    ///
    /// # Errors
    /// [`Error::Lance`] if the query fails.
    pub async fn session_turns(
        &self,
        sessions: &[(&str, &str)],
    ) -> Result<Vec<(String, String, i64, String, String)>> {
        use futures::TryStreamExt;
        use lancedb::query::{ExecutableQuery, QueryBase, Select};

        let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let mut out = Vec::new();
        for chunk in sessions.chunks(500) {
            let users: std::collections::BTreeSet<&str> = chunk.iter().map(|s| s.0).collect();
            let ids: std::collections::BTreeSet<&str> = chunk.iter().map(|s| s.1).collect();
            let list = |xs: &std::collections::BTreeSet<&str>| {
                xs.iter().map(|x| quote(x)).collect::<Vec<_>>().join(",")
            };
            let filter = format!(
                "user_id IN ({}) AND session_id IN ({}) AND kind = 'dialogue_turn' AND text IS NOT NULL",
                list(&users),
                list(&ids)
            );
            let batches: Vec<RecordBatch> = self
                .table(TableName::Interactions)
                .query()
                .only_if(filter)
                .select(Select::columns(&[
                    "user_id",
                    "session_id",
                    "timestamp",
                    "event_id",
                    "role",
                    "text",
                ]))
                .execute()
                .await
                .map_err(Error::lance("looking up session turns"))?
                .try_collect()
                .await
                .map_err(Error::lance("looking up session turns"))?;
            let wanted: std::collections::HashSet<(&str, &str)> = chunk.iter().copied().collect();
            for b in batches {
                let str_col = |i: usize| b.column(i).as_string::<i32>();
                let (user, session, event, role, text) =
                    (str_col(0), str_col(1), str_col(3), str_col(4), str_col(5));
                let ts = b.column(2).as_primitive::<TimestampMillisecondType>();
                for r in 0..b.num_rows() {
                    if !wanted.contains(&(user.value(r), session.value(r))) {
                        continue;
                    }
                    let role = if arrow_array::Array::is_valid(role, r) {
                        role.value(r)
                    } else {
                        "user"
                    };
                    out.push((
                        user.value(r).to_owned(),
                        session.value(r).to_owned(),
                        ts.value(r),
                        event.value(r).to_owned(),
                        format!("{role}: {}", text.value(r)),
                    ));
                }
            }
        }
        Ok(out)
    }
}
