//! The fresh-key ledger of an insert-if-absent table (`interactions`,
//! `turn_vectors`, `passages`): which keys the table holds, so that a batch
//! of keys it cannot hold is committed without looking them up.
//!
//! Looking a batch's keys up (LanceDB's `merge_insert`) costs about six
//! times what writing the batch does, and nearly every batch holds only new
//! events: a key is present only when a batch is replayed (a restart, a
//! rebalance) or a producer re-sends an event. The ledger answers "can this
//! key be in the table?" from memory:
//!
//! - it holds the hash of every key of the table whose row's `timestamp` is
//!   at least `horizon`, for every commit up to table version `covered`;
//! - a batch whose keys are all absent from it, with timestamps at least
//!   `horizon`, is *fresh*: it is written as new fragments and committed as
//!   an update that names every key it inserts, read at version `covered`.
//!   LanceDB checks that commit against every commit after `covered`, so a
//!   concurrent insert of one of the keys (another instance replaying the
//!   batch) makes it conflict, and the batch then takes the exact path;
//! - any other batch takes the exact path ([`super::insert_absent`]).
//!
//! After each commit the ledger learns the keys of the commits between
//! `covered` and its own from their transactions (every steamrf insert names
//! its keys, as an exact set of hashes); a commit that adds rows without
//! naming them (another tool's append or merge) makes the ledger reload
//! from the table. Memory is bounded by `lancedb.fresh_keys`: beyond it the
//! oldest half (by event time) is forgotten and `horizon` moves past it, so
//! an event older than that takes the exact path.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{Array, RecordBatch};
use futures::TryStreamExt;
use lance::Dataset;
use lance::dataset::transaction::{Operation, Transaction, UpdateMode};
use lance::dataset::write::merge_insert::inserted_rows::{FilterType, KeyExistenceFilter};
use lance::dataset::{CommitBuilder, InsertBuilder, WriteMode, WriteParams};

/// The hash LanceDB compares in a commit's exact key set: its
/// `KeyValue::String(key).hash_value()`, without that one's two copies of
/// the key.
pub(crate) fn key_hash(key: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.as_bytes().hash(&mut h);
    h.finish()
}

/// The ledger's keys are hashes already: a map over them hashes nothing.
#[derive(Default, Clone, Copy)]
pub(crate) struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed (`write_u64`); fold anything else in.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A map keyed by [`key_hash`]es, which it does not hash again.
pub(crate) type HashMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<Prehashed>>;

/// Each row's key hash and event timestamp (ms); `None` if the batch lacks
/// either column.
pub(crate) fn keys_of(batch: &RecordBatch, key: &str) -> Option<Vec<(u64, i64)>> {
    let keys = batch.column_by_name(key)?.as_string_opt::<i32>()?;
    let ts = batch
        .column_by_name("timestamp")?
        .as_primitive_opt::<TimestampMillisecondType>()?;
    Some(
        (0..batch.num_rows())
            .filter(|&i| keys.is_valid(i))
            .map(|i| (key_hash(keys.value(i)), ts.value(i)))
            .collect(),
    )
}

/// The exact key set a commit names.
pub(crate) fn exact_filter(
    dataset: &Dataset,
    key: &str,
    hashes: impl IntoIterator<Item = u64>,
) -> lance::Result<KeyExistenceFilter> {
    let field = dataset
        .schema()
        .field(key)
        .ok_or_else(|| lance::Error::invalid_input(format!("the table has no column {key}")))?;
    Ok(KeyExistenceFilter {
        field_ids: vec![field.id],
        filter: FilterType::ExactSet(hashes.into_iter().collect()),
    })
}

/// What a ledger learned from the commits after `covered`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Learned {
    /// It is up to date with the given version.
    Current,
    /// A commit added rows without naming their keys: reload.
    Unknown,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Ledger {
    /// Key hash → the newest event timestamp (ms) stored under it;
    /// `i64::MAX` for keys learned from another writer's commit, whose
    /// timestamps the commit does not carry (kept until a reload).
    keys: HashMap<u64, i64>,
    horizon: i64,
    covered: u64,
    max_keys: usize,
}

impl Ledger {
    /// An empty ledger of a table at `version` that holds no row at or
    /// after `horizon`.
    pub(crate) fn new(version: u64, max_keys: usize) -> Self {
        Self {
            keys: HashMap::default(),
            horizon: i64::MIN,
            covered: version,
            max_keys: max_keys.max(2),
        }
    }

    /// Reads every key of `dataset` (one scan of the key and timestamp
    /// columns), keeping the newest `max_keys`.
    pub(crate) async fn load(dataset: &Dataset, key: &str, max_keys: usize) -> lance::Result<Self> {
        let mut ledger = Self::new(dataset.version().version, max_keys);
        let mut scan = dataset.scan();
        scan.project(&[key, "timestamp"])?;
        let mut stream = scan.try_into_stream().await?;
        while let Some(batch) = stream.try_next().await? {
            for (h, ts) in keys_of(&batch, key).unwrap_or_default() {
                ledger.insert(h, ts);
            }
        }
        Ok(ledger)
    }

    /// The version the ledger is complete up to.
    pub(crate) fn covered(&self) -> u64 {
        self.covered
    }

    /// Keys remembered.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether none of `rows` can be in the table as of `covered`; and
    /// records them, since every write of a batch leaves all its keys in
    /// the table (inserted, or there already). One probe per key answers
    /// both, where a look-up before the write and an insert after it took
    /// two (each a likely cache miss in a map of millions).
    ///
    /// If the write then fails, the ledger holds keys the table lacks: that
    /// can send a batch down the exact path needlessly, never the reverse.
    /// The ledger may exceed `max_keys` by one batch before it forgets.
    pub(crate) fn admit(&mut self, rows: &[(u64, i64)]) -> bool {
        use std::collections::hash_map::Entry;
        let mut fresh = true;
        for &(h, ts) in rows {
            fresh &= ts >= self.horizon;
            match self.keys.entry(h) {
                Entry::Vacant(v) => {
                    v.insert(ts);
                }
                Entry::Occupied(mut o) => {
                    fresh = false;
                    let t = o.get_mut();
                    *t = (*t).max(ts);
                }
            }
        }
        if self.keys.len() > self.max_keys {
            self.forget_oldest();
        }
        fresh
    }

    /// Records that the table holds `hash` with event time `ts`.
    pub(crate) fn insert(&mut self, hash: u64, ts: i64) {
        let e = self.keys.entry(hash).or_insert(ts);
        *e = (*e).max(ts);
        if self.keys.len() > self.max_keys {
            self.forget_oldest();
        }
    }

    /// Forgets the older half of the keys (by event time) and moves the
    /// horizon past them: a forgotten key's rows are all older than the new
    /// horizon, so a row at or after it still cannot hide behind a
    /// forgotten key.
    fn forget_oldest(&mut self) {
        let mut ts: Vec<i64> = self.keys.values().copied().collect();
        let mid = ts.len() / 2;
        let (_, cut, _) = ts.select_nth_unstable(mid);
        let cut = *cut;
        self.keys.retain(|_, t| *t >= cut);
        self.horizon = self.horizon.max(cut);
        tracing::debug!(
            horizon = self.horizon,
            kept = self.keys.len(),
            "Fresh-key ledger full: forgot the older half."
        );
    }

    /// Learns the keys of the commits after `covered` up to `to`, except
    /// `own` (the caller's commit, whose keys it records itself), from their
    /// transactions; then `covered` is `to` (unless the answer is
    /// [`Learned::Unknown`]).
    pub(crate) async fn learn(&mut self, dataset: &Dataset, to: u64, own: Option<u64>) -> Learned {
        for v in self.covered + 1..=to {
            if Some(v) == own {
                continue;
            }
            let t = match dataset.read_transaction_by_version(v).await {
                Ok(Some(t)) => t,
                // Pruned, or unreadable now: what it added is unknown.
                Ok(None) => return Learned::Unknown,
                Err(e) => {
                    tracing::warn!(version = v, error = %e, "Could not read a commit's transaction.");
                    return Learned::Unknown;
                }
            };
            match keys_added(&t) {
                Added::None => {}
                Added::Named(hashes) => {
                    for h in hashes {
                        self.insert(*h, i64::MAX);
                    }
                }
                Added::Unnamed => return Learned::Unknown,
            }
        }
        self.covered = self.covered.max(to);
        Learned::Current
    }
}

/// The keys a commit added, as far as its transaction says.
enum Added<'a> {
    /// No rows (an index, a compaction, a delete, a configuration change).
    None,
    /// Rows whose keys the commit names exactly.
    Named(&'a std::collections::HashSet<u64>),
    /// Rows whose keys it does not name.
    Unnamed,
}

fn keys_added(t: &Transaction) -> Added<'_> {
    match &t.operation {
        Operation::Update {
            new_fragments,
            inserted_rows_filter,
            ..
        } => match inserted_rows_filter {
            _ if new_fragments.is_empty() => Added::None,
            Some(KeyExistenceFilter {
                filter: FilterType::ExactSet(hashes),
                ..
            }) => Added::Named(hashes),
            _ => Added::Unnamed,
        },
        Operation::Delete { .. }
        | Operation::Rewrite { .. }
        | Operation::CreateIndex { .. }
        | Operation::ReserveFragments { .. }
        | Operation::UpdateConfig { .. } => Added::None,
        _ => Added::Unnamed,
    }
}

/// Writes `batch` (keys `hashes`, none of them in the table as of `read`)
/// as new fragments and commits them as an update read at version `read`
/// that names every key. Fails with a retryable conflict if a commit after
/// `read` named one of the keys or added rows without naming them.
pub(crate) async fn commit_fresh(
    dataset: Arc<Dataset>,
    key: &str,
    batch: RecordBatch,
    hashes: impl IntoIterator<Item = u64>,
    read: u64,
) -> lance::Result<Dataset> {
    let filter = exact_filter(&dataset, key, hashes)?;
    let params = WriteParams {
        mode: WriteMode::Append,
        ..Default::default()
    };
    let staged = InsertBuilder::new(dataset.clone())
        .with_params(&params)
        .execute_uncommitted(vec![batch])
        .await?;
    let Operation::Append { fragments } = staged.operation else {
        return Err(lance::Error::internal(format!(
            "staging an insert gave a {} transaction",
            staged.operation
        )));
    };
    let operation = Operation::Update {
        removed_fragment_ids: Vec::new(),
        updated_fragments: Vec::new(),
        new_fragments: fragments,
        fields_modified: Vec::new(),
        compacted_sstables: Vec::new(),
        // As LanceDB's merge: no index keeps a bitmap bit for these fragments.
        fields_for_preserving_frag_bitmap: dataset
            .schema()
            .fields_pre_order()
            .map(|f| f.id as u32)
            .collect(),
        update_mode: Some(UpdateMode::RewriteRows),
        inserted_rows_filter: Some(filter),
        updated_fragment_offsets: None,
    };
    CommitBuilder::new(dataset)
        .execute(Transaction::new(read, operation, None))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lance::dataset::write::merge_insert::inserted_rows::KeyValue;

    #[test]
    fn key_hashes_are_lances() {
        for k in ["", "e1", "bench-000000000042", "ü'\"x"] {
            assert_eq!(key_hash(k), KeyValue::String(k.to_owned()).hash_value());
        }
    }

    #[test]
    fn a_full_ledger_forgets_the_older_half_and_moves_its_horizon() {
        let mut l = Ledger::new(1, 4);
        for (h, ts) in [(1, 10), (2, 20), (3, 30), (4, 40)] {
            l.insert(h, ts);
        }
        assert!(!l.admit(&[(1, 10)]));
        assert!(l.admit(&[(9, 5)]), "nothing forgotten yet");
        // Admitting key 9 filled the ledger: the older half went.
        assert!(l.len() <= 4);
        assert!(
            !l.admit(&[(1, 15)]),
            "a row older than the horizon may hide behind a forgotten key"
        );
        l.insert(5, 50);
        assert!(!l.admit(&[(5, 60)]), "a remembered key");
        assert!(l.admit(&[(8, 60)]), "a new key after the horizon");
        assert!(!l.admit(&[(8, 61)]), "an admitted key is remembered");
    }

    #[test]
    fn a_batch_with_one_known_key_is_not_fresh_but_is_remembered_whole() {
        let mut l = Ledger::new(1, 100);
        l.insert(2, 10);
        assert!(!l.admit(&[(1, 10), (2, 10), (3, 10)]));
        assert_eq!(l.len(), 3);
        assert!(!l.admit(&[(1, 11)]));
        assert!(!l.admit(&[(3, 11)]));
        assert!(l.admit(&[(4, 11), (5, 11)]));
    }

    #[test]
    fn a_key_keeps_its_newest_timestamp() {
        let mut l = Ledger::new(1, 2);
        l.insert(1, 100);
        l.insert(1, 5);
        l.insert(2, 50);
        l.insert(3, 60);
        // Full: the older half (key 2, ts 50) goes; key 1 stays at 100.
        assert!(!l.admit(&[(1, 200)]));
    }
}
