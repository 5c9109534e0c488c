//! Connecting to LanceDB (one session per process, its cache sizes from
//! `[lancedb]`), and opening or creating the tables: the schema checked
//! against this build's (an earlier steamrf's named with the command that
//! upgrades it), the key declared the primary key where merges need it.

use std::sync::Arc;

use lancedb::{Connection, Table};
use steamrf_schemas::TableName;

use super::admin;
use crate::config::LanceDbConfig;
use crate::error::{Error, Result};

/// Opens a LanceDB connection with the configured storage options.
///
/// # Errors
/// [`Error::Lance`] if the URI cannot be opened.
pub async fn connect(cfg: &LanceDbConfig) -> Result<Connection> {
    let mut b = lancedb::connect(&cfg.uri).session(session(cfg));
    for (k, v) in &cfg.storage_options {
        b = b.storage_option(k, v);
    }
    b.execute()
        .await
        .map_err(Error::lance(format!("connecting to {}", cfg.uri)))
}

/// The process's LanceDB session: one index cache and one metadata cache of
/// the configured sizes, shared by every connection (the first connection's
/// configuration sizes them; a process has one configuration). Without it
/// each connection gets LanceDB's defaults, 6 GiB and 1 GiB.
pub(super) fn session(cfg: &LanceDbConfig) -> Arc<lance::session::Session> {
    static SESSION: std::sync::OnceLock<Arc<lance::session::Session>> = std::sync::OnceLock::new();
    SESSION
        .get_or_init(|| {
            Arc::new(lance::session::Session::new(
                cfg.index_cache_size.0,
                cfg.metadata_cache_size.0,
                Arc::new(lance::io::ObjectStoreRegistry::default()),
            ))
        })
        .clone()
}

/// Opens `name`, creating it with `schema` if it does not exist; fails if it
/// exists with another schema.
///
/// # Errors
/// [`Error::Lance`] on storage errors, [`Error::Config`] on a schema mismatch.
pub async fn open_or_create(db: &Connection, name: TableName) -> Result<Table> {
    let table = open_or_create_named(db, name.as_str(), name.schema()).await?;
    // Only the insert-if-absent tables (`interactions`, `turn_vectors`, `passages`) declare their key: Lance 14
    // rejects the conditional upserts of `items` and `profiles` (newest
    // wins) on a table with a declared primary key ("Primary key column and
    // all its ancestors must not be nullable", raised for the merge's outer
    // join). Those two tables stay exposed to the race below: two instances
    // inserting the same new item or profile at once can store it twice.
    if matches!(
        name,
        TableName::Interactions | TableName::TurnVectors | TableName::Passages
    ) {
        ensure_primary_key(&table, name.key()).await?;
    }
    Ok(table)
}

/// Declares `key` the table's (unenforced) primary key, unless it already is;
/// also upgrades tables created before steamrf declared it.
///
/// Without it, LanceDB cannot see that two concurrent `merge_insert`s insert
/// the same new keys: both find them absent, each commit only adds a
/// fragment, and both rows stay (lance issue 4585). That race is a batch
/// replayed by the instance that took over a partition while the one that
/// lost it still writes it, so exactly-once depends on this declaration: with
/// it, the later commit conflicts and its retry finds the keys present.
///
/// # Errors
/// [`Error::Lance`] if the schema cannot be read or updated.
pub async fn ensure_primary_key(table: &Table, key: &str) -> Result<()> {
    // Another instance may declare it first, or create the table over ours
    // (an Overwrite, with which this commit is incompatible): refresh, look
    // again, try again.
    let mut attempt = 0;
    loop {
        if primary_key_declared(table, key).await? {
            return Ok(());
        }
        match table.set_unenforced_primary_key([key]).await {
            Ok(()) => {
                tracing::info!(
                    table = table.name(),
                    key,
                    "Declared the key column the table's primary key."
                );
                return Ok(());
            }
            Err(e) if attempt >= 4 => {
                return Err(Error::lance(format!(
                    "declaring {key} the primary key of {}",
                    table.name()
                ))(e));
            }
            Err(_) => {
                attempt += 1;
                table
                    .checkout_latest()
                    .await
                    .map_err(Error::lance(format!("refreshing {}", table.name())))?;
            }
        }
    }
}

/// Whether `key` is (part of) `table`'s declared primary key, as Lance reads
/// its schema.
pub(super) async fn primary_key_declared(table: &Table, key: &str) -> Result<bool> {
    let context = || format!("reading the schema of {}", table.name());
    let schema = table.schema().await.map_err(Error::lance(context()))?;
    let schema = lance::datatypes::Schema::try_from(schema.as_ref())
        .map_err(|e| Error::lance(context())(e.into()))?;
    Ok(schema
        .unenforced_primary_key()
        .iter()
        .any(|f| f.name == key))
}

/// The columns `expected` has beyond `actual` when `actual` is exactly its
/// first columns and every one of the rest is nullable: a table written
/// before those columns existed, which gains them as all-null columns
/// (a metadata-only commit in Lance) instead of needing `steamrf migrate`.
fn added_columns(
    actual: &arrow_schema::Schema,
    expected: &arrow_schema::Schema,
) -> Option<Vec<arrow_schema::FieldRef>> {
    let (a, e) = (actual.fields(), expected.fields());
    let same = |x: &arrow_schema::Field, y: &arrow_schema::Field| {
        x.name() == y.name() && x.data_type() == y.data_type()
    };
    (a.len() < e.len()
        && a.iter().zip(e.iter()).all(|(x, y)| same(x, y))
        && e[a.len()..].iter().all(|f| f.is_nullable()))
    .then(|| e[a.len()..].to_vec())
}

/// Adds `fields` to `table` as all-null columns. Another instance may add
/// them first: the table is then refreshed and, when it has them, left as it is.
async fn add_null_columns(
    table: &Table,
    name: &str,
    fields: Vec<arrow_schema::FieldRef>,
) -> Result<()> {
    let added: Vec<String> = fields.iter().map(|f| f.name().clone()).collect();
    let schema = Arc::new(arrow_schema::Schema::new(fields));
    match table
        .add_columns()
        .transform(lance::dataset::NewColumnTransform::AllNulls(schema))
        .execute()
        .await
    {
        Ok(_) => {
            tracing::info!(table = name, columns = ?added, "Added the columns this build writes (all null on existing rows).");
            Ok(())
        }
        Err(e) => {
            table
                .checkout_latest()
                .await
                .map_err(Error::lance(format!("refreshing {name}")))?;
            let schema = table
                .schema()
                .await
                .map_err(Error::lance("reading the schema"))?;
            if added.iter().all(|c| schema.field_with_name(c).is_ok()) {
                Ok(())
            } else {
                Err(Error::lance(format!("adding columns {added:?} to {name}"))(
                    e,
                ))
            }
        }
    }
}

/// Opens `name`, creating it empty when it does not exist. Instances that
/// start together on a fresh store race to create the same table: the loser
/// sees either `TableAlreadyExists` or a commit conflict from Lance, both
/// retryable, and the next try opens what the winner created.
async fn open_or_create_racing(
    db: &Connection,
    name: &str,
    expected: &arrow_schema::SchemaRef,
) -> Result<Table> {
    const ATTEMPTS: u32 = 5;
    let what = format!("Opening or creating table {name}");
    crate::error::retry(
        ATTEMPTS,
        &what,
        |_| {},
        || async {
            match db.open_table(name).execute().await {
                Err(lancedb::Error::TableNotFound { .. }) => db
                    .create_empty_table(name, expected.clone())
                    .execute()
                    .await
                    .map_err(Error::lance(format!("creating {name}"))),
                r => r.map_err(Error::lance(format!("opening {name}"))),
            }
        },
    )
    .await
}

/// [`open_or_create`] for any table name and schema.
///
/// # Errors
/// As [`open_or_create`].
pub async fn open_or_create_named(
    db: &Connection,
    name: &str,
    expected: arrow_schema::SchemaRef,
) -> Result<Table> {
    let table = open_or_create_racing(db, name, &expected).await?;
    let mut actual = table
        .schema()
        .await
        .map_err(Error::lance("reading the schema"))?;
    if let Some(missing) = added_columns(&actual, &expected) {
        add_null_columns(&table, name, missing).await?;
        actual = table
            .schema()
            .await
            .map_err(Error::lance("reading the schema"))?;
    }
    let names = |s: &arrow_schema::Schema| {
        s.fields()
            .iter()
            .map(|f| (f.name().clone(), f.data_type().clone()))
            .collect::<Vec<_>>()
    };
    if names(&actual) != names(&expected) {
        if let Some(problem) = admin::pending(name, &actual) {
            return Err(Error::Config {
                problems: vec![problem],
            });
        }
        return Err(Error::Config {
            problems: vec![format!(
                "table {} exists with a different schema than this build writes; migrate or point lancedb.uri elsewhere.\n    found:    {:?}\n    expected: {:?}",
                name,
                names(&actual),
                names(&expected)
            )],
        });
    }
    Ok(table)
}
