//! What the processes share about the tables beyond writing them: SQL
//! literals for filters, deletes that count what they removed, and the
//! check for tables an earlier steamrf wrote (which `steamrf migrate`
//! upgrades). Store-level, so that the stages and the processes above them
//! reach it without naming each other.

use arrow_schema::Schema;
use lancedb::Table;
use steamrf_schemas::TableName;
use steamrf_schemas::memory::MemoryTable;

use crate::error::{Error, Result};

/// A SQL string literal.
pub fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Counts then deletes the rows matching `filter`.
///
/// # Errors
/// LanceDB failures.
pub async fn delete_counted(table: &Table, filter: &str) -> Result<u64> {
    table
        .checkout_latest()
        .await
        .map_err(Error::lance(format!("refreshing {}", table.name())))?;
    let n = table
        .count_rows(Some(filter.to_owned()))
        .await
        .map_err(Error::lance(format!("counting in {}", table.name())))? as u64;
    if n > 0 {
        table
            .delete(filter)
            .await
            .map_err(Error::lance(format!("deleting from {}", table.name())))?;
    }
    Ok(n)
}

/// The problem to report when table `name` exists with `actual`, a schema
/// an earlier steamrf wrote that `steamrf migrate` upgrades; `None` for any other
/// mismatch.
pub fn pending(name: &str, actual: &Schema) -> Option<String> {
    if name == TableName::Interactions.as_str() && actual.field_with_name("embedding").is_ok() {
        return Some(
            "table interactions was written by an earlier steamrf: it still holds the \
             turn vectors in its `embedding` column, which now live in `turn_vectors`. \
             Stop every ingest instance and run `steamrf migrate` (same config) once; \
             it copies the vectors and drops the column."
                .to_owned(),
        );
    }
    has_legacy_ids(name, actual).then(|| super::ids::legacy_message(&format!("table {name}")))
}

/// Whether `actual` is a memory table as an earlier steamrf wrote it, with
/// 63-bit `Int64` memory ids.
pub fn has_legacy_ids(name: &str, actual: &Schema) -> bool {
    let id = match MemoryTable::ALL.into_iter().find(|t| t.as_str() == name) {
        Some(MemoryTable::Memories) => "memory_id",
        Some(MemoryTable::MemoryLinks) => "from_id",
        Some(MemoryTable::Prototypes) => "prototype_id",
        None => return false,
    };
    actual
        .field_with_name(id)
        .is_ok_and(|f| f.data_type() == &arrow_schema::DataType::Int64)
}

/// Logs a warning when `db` holds tables an earlier steamrf wrote: `serve`
/// keeps answering from them (it reads columns by name), but without the
/// turn vectors until `steamrf migrate` has run, and without memories or
/// prototypes while their ids are 63-bit.
pub async fn warn_if_pending(db: &lancedb::Connection) {
    let memory_tables = MemoryTable::ALL.map(MemoryTable::as_str);
    for name in std::iter::once(TableName::Interactions.as_str()).chain(memory_tables) {
        let Ok(table) = db.open_table(name).execute().await else {
            continue;
        };
        if let Ok(schema) = table.schema().await
            && let Some(problem) = pending(name, &schema)
        {
            tracing::warn!("{problem} Until then the service answers without what it holds.");
        }
    }
}
