//! The right to be forgotten: `steamrf forget USER` and the `forget` event.
//!
//! One procedure for both: delete the user's rows from `interactions`,
//! `turn_vectors`, `profiles` and `passages`; through the STEAM stage delete their memories and every link
//! to or from them, re-link the other users' memories that pointed at them,
//! rebuild or withdraw the affected prototypes; then rewrite every fragment
//! of the touched tables that holds a deleted row (compaction with deletions
//! materialised, whatever their share) and prune every older table version,
//! so the deleted bytes leave the disk (or the bucket). The receipt says what
//! went, per table. Running it twice is harmless: the second finds nothing.

use std::time::Instant;

use lancedb::Table;
use lancedb::table::{CompactionOptions, Duration as LanceDuration, OptimizeAction};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::sink::LanceSink;
use crate::sink::admin::{delete_counted, quoted};
use crate::steam::{SteamStage, Tombstone};

/// What a forget removed.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Receipt {
    /// The user.
    pub user_id: String,
    /// The `forget` event's id (none from the command line).
    pub event_id: Option<String>,
    /// Rows deleted from `interactions`.
    pub interactions: u64,
    /// Rows deleted from `profiles`.
    pub profiles: u64,
    /// Rows deleted from `turn_vectors`.
    pub turn_vectors: u64,
    /// Rows deleted from `passages`.
    pub passages: u64,
    /// Rows deleted from `memories`.
    pub memories: u64,
    /// Rows deleted from `memory_links` (to or from the user's memories).
    pub links: u64,
    /// Other users' memories whose links were searched again.
    pub memories_relinked: u64,
    /// Prototypes rebuilt without the user.
    pub prototypes_rebuilt: u64,
    /// Prototypes withdrawn (their community fell apart or below the floor).
    pub prototypes_withdrawn: u64,
    /// Disk clean-up per touched table.
    pub tables: Vec<TableCleanup>,
    /// What this forget could not do, if anything.
    pub note: Option<String>,
    /// Wall time, milliseconds.
    pub took_ms: u64,
    /// When it finished (RFC 3339, UTC).
    pub completed_at: String,
}

/// The clean-up of one table after the deletes.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct TableCleanup {
    /// The table.
    pub table: String,
    /// Fragments rewritten without the deleted rows.
    pub fragments_rewritten: u64,
    /// Old versions pruned.
    pub versions_pruned: u64,
    /// Bytes of old data, deletion and index files removed.
    pub bytes_removed: u64,
}

/// Rewrites every fragment of `table` that has deleted rows and prunes all
/// older versions. Safe beside concurrent writers: only files that some
/// pruned version referenced are removed, never unreferenced (possibly
/// in-flight) ones.
///
/// # Errors
/// LanceDB failures.
pub async fn purge(table: &Table) -> Result<TableCleanup> {
    // A compaction can lose a commit race with another writer of the table;
    // compaction and pruning are idempotent, so they are simply run again.
    crate::error::retry(PURGE_ATTEMPTS, "Clean-up", |_| {}, || purge_once(table)).await
}

/// Attempts of [`purge`] on retryable errors.
const PURGE_ATTEMPTS: u32 = 6;

async fn purge_once(table: &Table) -> Result<TableCleanup> {
    let name = table.name().to_owned();
    // A handle reads the version it opened; clean the newest.
    table
        .checkout_latest()
        .await
        .map_err(Error::lance(format!("refreshing {name}")))?;
    let compacted = table
        .optimize(OptimizeAction::Compact {
            options: CompactionOptions {
                materialize_deletions: true,
                materialize_deletions_threshold: 0.0,
                ..CompactionOptions::default()
            },
            remap_options: None,
        })
        .await
        .map_err(Error::lance(format!("compacting {name}")))?;
    let pruned = table
        .optimize(OptimizeAction::Prune {
            older_than: Some(LanceDuration::zero()),
            delete_unverified: Some(false),
            error_if_tagged_old_versions: Some(false),
        })
        .await
        .map_err(Error::lance(format!("pruning {name}")))?;
    Ok(TableCleanup {
        table: name,
        fragments_rewritten: compacted
            .compaction
            .map_or(0, |c| c.fragments_removed as u64),
        versions_pruned: pruned.prune.as_ref().map_or(0, |p| p.old_versions),
        bytes_removed: pruned.prune.as_ref().map_or(0, |p| p.bytes_removed),
    })
}

/// Counts a finished forget and logs its receipt (`Forget done.`, JSON).
pub(crate) fn record(metrics: &crate::Metrics, receipt: &Receipt) {
    metrics.forgets.inc();
    tracing::info!(
        receipt = %serde_json::to_string(receipt).unwrap_or_default(),
        "Forget done."
    );
}

/// Forgets `user_id` everywhere steamrf stores it (module docs).
///
/// # Errors
/// LanceDB or kernel failures; the forget can simply be run again.
pub async fn forget(
    sink: &LanceSink,
    steam: Option<&mut SteamStage>,
    user_id: &str,
    event_id: Option<&str>,
) -> Result<Receipt> {
    let started = Instant::now();
    let mut r = Receipt {
        user_id: user_id.to_owned(),
        event_id: event_id.map(str::to_owned),
        ..Receipt::default()
    };
    let filter = format!("user_id = {}", quoted(user_id));
    let mut touched: Vec<&Table> = Vec::new();
    for name in [
        steamrf_schemas::TableName::Interactions,
        steamrf_schemas::TableName::TurnVectors,
        steamrf_schemas::TableName::Profiles,
        steamrf_schemas::TableName::Passages,
    ] {
        let table = sink.table(name);
        let n = delete_counted(table, &filter).await?;
        match name {
            steamrf_schemas::TableName::Interactions => r.interactions = n,
            steamrf_schemas::TableName::TurnVectors => r.turn_vectors = n,
            steamrf_schemas::TableName::Passages => r.passages = n,
            _ => r.profiles = n,
        }
        touched.push(table);
    }
    let mut cleanups = Vec::new();
    for t in touched {
        cleanups.push(purge(t).await?);
    }
    if let Some(stage) = steam {
        forget_memories(stage, &[], &mut r, &mut cleanups).await?;
    }
    Ok(finish(r, cleanups, started))
}

/// The STEAM part of a forget, into `r`, and the clean-up of the stage's tables.
async fn forget_memories(
    stage: &mut SteamStage,
    known: &[steamrf_operators::steam::MemoryId],
    r: &mut Receipt,
    cleanups: &mut Vec<TableCleanup>,
) -> Result<()> {
    let s = stage
        .forget(&r.user_id, r.event_id.as_deref(), known)
        .await?;
    r.memories = s.memories;
    r.links = s.links;
    r.memories_relinked = s.relinked;
    r.prototypes_rebuilt = s.prototypes_rebuilt;
    r.prototypes_withdrawn = s.prototypes_withdrawn;
    r.note = s.note;
    for t in stage.tables() {
        cleanups.push(purge(t).await?);
    }
    Ok(())
}

fn finish(mut r: Receipt, cleanups: Vec<TableCleanup>, started: Instant) -> Receipt {
    r.tables = cleanups;
    r.took_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    r.completed_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    r
}

/// The community writer's part of a forget done on an ingest instance of
/// the scaled-out write path: the links to and from the user's memories,
/// the re-linking, the prototypes, and the clean-up of those tables. The
/// receipt's `memories` counts the memory ids the tombstone named.
///
/// # Errors
/// LanceDB or kernel failures; the tombstone is then not committed and is
/// applied again.
pub async fn apply_tombstone(stage: &mut SteamStage, t: &Tombstone) -> Result<Receipt> {
    let started = Instant::now();
    let mut r = Receipt {
        user_id: t.forget_user.clone(),
        event_id: t.event_id.clone(),
        ..Receipt::default()
    };
    let mut cleanups = Vec::new();
    forget_memories(stage, &t.memory_ids, &mut r, &mut cleanups).await?;
    r.memories = t.memory_ids.len() as u64;
    Ok(finish(r, cleanups, started))
}

/// `steamrf forget USER`: opens the tables (and, where memories exist, the
/// STEAM state) and forgets the user. Meant for a stopped pipeline: a running
/// one still holds the user's memories in memory; send it a `forget` event
/// instead.
///
/// # Errors
/// Configuration, LanceDB or kernel failures.
pub async fn run(config: &crate::Config, user_id: &str) -> Result<Receipt> {
    // The same rules as a forget event's user_id.
    steamrf_schemas::api::check_user(user_id).map_err(|e| Error::Config {
        problems: vec![format!("USER: {}", e.message)],
    })?;
    let metrics = crate::Metrics::new(&config.kafka.topics);
    let sink = LanceSink::open(&config.lancedb, metrics.clone()).await?;
    let db = crate::sink::connect(&config.lancedb).await?;
    let names = db
        .table_names()
        .execute()
        .await
        .map_err(Error::lance("listing tables"))?;
    let has_memories = names
        .iter()
        .any(|n| n == steamrf_schemas::memory::MemoryTable::Memories.as_str());
    let mut stage = if config.steam.enabled || has_memories {
        let mut stage = SteamStage::open(
            &db,
            config.steam_params(),
            crate::steam::kernel(config, &metrics)?,
            None,
            crate::steam::llm_client(config)?,
            metrics,
            None,
        )
        .await?;
        stage.restore(&|_| true).await?;
        Some(stage)
    } else {
        None
    };
    forget(&sink, stage.as_mut(), user_id, None).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_ids_are_quoted_as_sql_literals() {
        assert_eq!(quoted("alice"), "'alice'");
        assert_eq!(quoted("o'brien"), "'o''brien'");
        assert_eq!(quoted("x' OR '1'='1"), "'x'' OR ''1''=''1'");
    }
}
