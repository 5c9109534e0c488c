//! Memory ids in the tables and on the changes topic: `Utf8` columns of 32
//! lowercase hex digits ([`steamrf_operators::steam::ids`]). Reading one
//! written by an earlier steamrf (63-bit `Int64` ids) is refused with the
//! command that upgrades it.

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, ListArray, StringArray};
use arrow_schema::DataType;
use steamrf_operators::steam::MemoryId;

use crate::error::{Error, Result};

/// What to do about memory ids in an earlier steamrf's format in `what`.
pub fn legacy_message(what: &str) -> String {
    format!(
        "{what} holds 63-bit memory ids written by an earlier steamrf; stop every \
         ingest instance and the community writer (after it has caught up on the \
         changes topic) and run `steamrf migrate` (same config) once: it rewrites \
         them as keyed 128-bit ids"
    )
}

/// The refusal for memory ids in an earlier steamrf's format.
pub fn legacy_ids(what: &str) -> Error {
    Error::Config {
        problems: vec![legacy_message(what)],
    }
}

/// Whether `col` holds memory ids in an earlier steamrf's format (`Int64`,
/// or lists of them): the service skips such rows until `steamrf migrate`
/// has run.
pub fn is_legacy(col: &ArrayRef) -> bool {
    match col.data_type() {
        DataType::Int64 => true,
        DataType::List(f) => f.data_type() == &DataType::Int64,
        _ => false,
    }
}

/// The memory ids of a non-nullable `Utf8` column (see [`read_opt_ids`]).
///
/// # Errors
/// A column of another type (an earlier steamrf's), a null, or a value
/// that is not 32 hex digits.
pub fn read_ids(col: &ArrayRef, what: &str) -> Result<Vec<MemoryId>> {
    read_opt_ids(col, what)?
        .into_iter()
        .map(|id| {
            id.ok_or_else(|| Error::Internal {
                message: format!("{what}: a null memory id"),
            })
        })
        .collect()
}

/// The memory ids of a nullable `Utf8` column.
///
/// # Errors
/// As [`read_ids`].
pub fn read_opt_ids(col: &ArrayRef, what: &str) -> Result<Vec<Option<MemoryId>>> {
    let strings = strings(col, what)?;
    strings
        .iter()
        .map(|v| v.map(|s| parse(s, what)).transpose())
        .collect()
}

/// The memory ids in each row of a `List<Utf8>` column.
///
/// # Errors
/// As [`read_ids`].
pub fn read_id_lists(col: &ArrayRef, what: &str) -> Result<Vec<Vec<MemoryId>>> {
    let Some(lists) = col.as_list_opt::<i32>() else {
        return Err(wrong_type(col.data_type(), what));
    };
    (0..lists.len())
        .map(|r| read_ids(&lists.value(r), what))
        .collect()
}

/// `ids` as a `Utf8` column.
pub fn ids_array(ids: impl IntoIterator<Item = MemoryId>) -> StringArray {
    ids.into_iter().map(|id| Some(id.to_string())).collect()
}

/// `ids` as a `List<Utf8>` column, one row per list.
pub fn id_lists_array<'a>(rows: impl IntoIterator<Item = &'a [MemoryId]>) -> ListArray {
    let mut b = arrow_array::builder::ListBuilder::new(arrow_array::builder::StringBuilder::new());
    for row in rows {
        for id in row {
            b.values().append_value(id.to_string());
        }
        b.append(true);
    }
    b.finish()
}

/// `ids` as the body of a SQL `IN (…)` list: `'…','…'` (hex digits need no
/// escaping).
pub fn sql_list(ids: &[MemoryId]) -> String {
    ids.iter()
        .map(|id| format!("'{id}'"))
        .collect::<Vec<_>>()
        .join(",")
}

fn strings<'a>(col: &'a ArrayRef, what: &str) -> Result<&'a StringArray> {
    col.as_string_opt::<i32>()
        .ok_or_else(|| wrong_type(col.data_type(), what))
}

fn wrong_type(t: &DataType, what: &str) -> Error {
    match t {
        DataType::Int64 => legacy_ids(what),
        DataType::List(f) if f.data_type() == &DataType::Int64 => legacy_ids(what),
        other => Error::Internal {
            message: format!("{what}: memory ids as {other}, not Utf8"),
        },
    }
}

fn parse(s: &str, what: &str) -> Result<MemoryId> {
    s.parse().map_err(|e| Error::Internal {
        message: format!("{what}: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn ids_round_trip_and_old_columns_name_the_migration() {
        let ids = vec![MemoryId(1), MemoryId(u128::MAX)];
        let col: ArrayRef = Arc::new(ids_array(ids.clone()));
        assert_eq!(read_ids(&col, "t.c").unwrap(), ids);
        let lists: ArrayRef = Arc::new(id_lists_array([&ids[..], &[]]));
        assert_eq!(
            read_id_lists(&lists, "t.l").unwrap(),
            vec![ids.clone(), vec![]]
        );
        assert_eq!(
            sql_list(&ids),
            format!("'{}','{}'", "0".repeat(31) + "1", "f".repeat(32))
        );
        let old: ArrayRef = Arc::new(arrow_array::Int64Array::from(vec![7]));
        assert!(is_legacy(&old) && !is_legacy(&col) && !is_legacy(&lists));
        let err = read_ids(&old, "memories.memory_id")
            .unwrap_err()
            .to_string();
        assert!(err.contains("steamrf migrate"), "{err}");
        let bad: ArrayRef = Arc::new(StringArray::from(vec!["7"]));
        assert!(read_ids(&bad, "memories.memory_id").is_err());
    }
}
