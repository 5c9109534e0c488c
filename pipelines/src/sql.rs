//! `steamrf sql`: DataFusion SQL over the LanceDB tables, so users and tests
//! can see what the pipeline wrote.

use std::sync::Arc;

use arrow_array::RecordBatch;
use datafusion::prelude::SessionContext;
use lancedb::Table;
use lancedb::table::datafusion::BaseTableAdapter;

use crate::config::LanceDbConfig;
use crate::error::{Error, Result};

async fn register(ctx: &SessionContext, name: &str, table: &Table) -> Result<()> {
    let adapter = BaseTableAdapter::try_new(table.base_table().clone())
        .await
        .map_err(Error::lance(format!("exposing {name} to SQL")))?;
    ctx.register_table(name, Arc::new(adapter))?;
    Ok(())
}

/// Runs `sql` with every table of the database registered under its name.
///
/// # Errors
/// [`Error::Lance`] if a table cannot be opened, [`Error::Sql`] for planning
/// or execution errors (unknown table or column, syntax...).
pub async fn query(cfg: &LanceDbConfig, sql: &str) -> Result<Vec<RecordBatch>> {
    let db = crate::sink::connect(cfg).await?;
    let ctx = SessionContext::new();
    let names = db
        .table_names()
        .execute()
        .await
        .map_err(Error::lance("listing tables"))?;
    for name in names {
        let table = db
            .open_table(&name)
            .execute()
            .await
            .map_err(Error::lance(format!("opening {name}")))?;
        register(&ctx, &name, &table).await?;
    }
    Ok(ctx.sql(sql).await?.collect().await?)
}

/// Runs `sql` against one table registered as `t`.
///
/// # Errors
/// As [`query`].
pub async fn query_table(table: &Table, sql: &str) -> Result<Vec<RecordBatch>> {
    let ctx = SessionContext::new();
    register(&ctx, "t", table).await?;
    Ok(ctx.sql(sql).await?.collect().await?)
}
