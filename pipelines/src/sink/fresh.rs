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
//! an event older than that takes the exact path. A forgotten key goes into
//! a Bloom filter (`lancedb.fresh_filter_bytes`): a producer may re-send an
//! event with any timestamp, so the horizon alone cannot tell a re-send of
//! a forgotten key from a new one (before 2026-12-05 such a re-send was
//! stored twice). A key in the filter takes the exact path; a false
//! positive costs a look-up, never a duplicate.

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::TimestampMillisecondType;
use arrow_array::{Array, RecordBatch};
use futures::TryStreamExt;
use lance::Dataset;
use lance::dataset::transaction::{Operation, Transaction, UpdateMode};
use lance::dataset::write::merge_insert::inserted_rows::{FilterType, KeyExistenceFilter};
use lance::dataset::{CommitBuilder, InsertBuilder, WriteMode, WriteParams};

use crate::error::Chain;

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
    /// Key hash → the newest event timestamp (ms) stored under it; for
    /// keys learned from another writer's commit, whose timestamps the
    /// commit does not carry, this writer's stream time when they were
    /// learned (`stream_time`; before 2026-12-05
    /// they got `i64::MAX`, and with two or three writers the horizon
    /// followed them there once the ledger filled: every batch took the
    /// exact path until a restart).
    keys: HashMap<u64, i64>,
    /// The oldest event time of the last batch admitted: where this
    /// writer's stream is (one event stamped ahead does not move it).
    stream_time: i64,
    horizon: i64,
    covered: u64,
    max_keys: usize,
    /// Every key forgotten (see the module docs).
    forgotten: Bloom,
}

impl Ledger {
    /// An empty ledger of an empty table at `version`, whose filter of
    /// forgotten keys will take `filter_bytes`.
    pub(crate) fn new(version: u64, max_keys: usize, filter_bytes: usize) -> Self {
        Self {
            keys: HashMap::default(),
            stream_time: i64::MIN,
            horizon: i64::MIN,
            covered: version,
            max_keys: max_keys.max(2),
            forgotten: Bloom::new(filter_bytes),
        }
    }

    /// Reads every key of `dataset` (one scan of the key and timestamp
    /// columns), keeping the newest `max_keys` and the rest in the filter.
    pub(crate) async fn load(
        dataset: &Dataset,
        key: &str,
        max_keys: usize,
        filter_bytes: usize,
    ) -> lance::Result<Self> {
        let mut ledger = Self::new(dataset.version().version, max_keys, filter_bytes);
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

    /// [`Self::admit_rows`] as a yes or no: the batch is [`Admitted::Fresh`].
    #[cfg(test)]
    pub(crate) fn admit(&mut self, rows: &[(u64, i64)]) -> bool {
        self.admit_rows(rows) == Admitted::Fresh
    }

    /// Whether none of `rows` can be in the table as of `covered`, or only
    /// a few keys the filter of forgotten keys may hold (each a re-send of
    /// a forgotten key or a false positive: the caller looks just those up
    /// instead of the whole batch); and records them, since every write of
    /// a batch leaves all its keys in the table (inserted, or there
    /// already). One probe per key answers both, where a look-up before the
    /// write and an insert after it took two (each a likely cache miss in a
    /// map of millions).
    ///
    /// If the write then fails, the ledger holds keys the table lacks: that
    /// can send a batch down the exact path needlessly, never the reverse.
    /// The ledger may exceed `max_keys` by one batch before it forgets.
    pub(crate) fn admit_rows(&mut self, rows: &[(u64, i64)]) -> Admitted {
        use std::collections::hash_map::Entry;
        let mut known = false;
        let mut suspects = Vec::new();
        if let Some(oldest) = rows.iter().map(|r| r.1).min() {
            self.stream_time = oldest;
        }
        for (i, &(h, ts)) in rows.iter().enumerate() {
            known |= ts < self.horizon;
            match self.keys.entry(h) {
                Entry::Vacant(v) => {
                    // Absent, unless it was forgotten (a re-send, possibly
                    // with a newer timestamp than the stored row's).
                    if !known && self.forgotten.may_contain(h) {
                        suspects.push(i);
                    }
                    v.insert(ts);
                }
                Entry::Occupied(mut o) => {
                    known = true;
                    let t = o.get_mut();
                    *t = (*t).max(ts);
                }
            }
        }
        if self.keys.len() > self.max_keys {
            self.forget_oldest();
        }
        if known || suspects.len() > MAX_SUSPECTS.max(rows.len() / 16) {
            Admitted::Known
        } else if suspects.is_empty() {
            Admitted::Fresh
        } else {
            Admitted::Suspect(suspects)
        }
    }

    /// Records that the table holds `hash` with event time `ts`.
    pub(crate) fn insert(&mut self, hash: u64, ts: i64) {
        let e = self.keys.entry(hash).or_insert(ts);
        *e = (*e).max(ts);
        if self.keys.len() > self.max_keys {
            self.forget_oldest();
        }
    }

    /// Keys another writer committed, whose event times are unknown:
    /// stamped with this writer's stream time (never past the wall clock,
    /// never behind the horizon), so they age with its own keys.
    fn learn_keys(&mut self, hashes: impl IntoIterator<Item = u64>) {
        let stamp = self.stream_time.min(wall_ms()).max(self.horizon);
        for h in hashes {
            self.insert(h, stamp);
        }
    }

    /// Forgets the older half of the keys (by event time) into the filter
    /// and moves the horizon up to them, never past the wall clock: events
    /// stamped in the future (accepted within `kafka.max_future_skew`)
    /// cannot drag the horizon past the present, where every new event
    /// would fall behind it.
    fn forget_oldest(&mut self) {
        let mut ts: Vec<i64> = self.keys.values().copied().collect();
        let mid = ts.len() / 2;
        let (_, cut, _) = ts.select_nth_unstable(mid);
        let cut = *cut;
        let horizon = cut.min(wall_ms());
        let forgotten = &mut self.forgotten;
        self.keys.retain(|&h, t| {
            let keep = *t >= cut;
            if !keep {
                forgotten.insert(h);
            }
            keep
        });
        self.horizon = self.horizon.max(horizon);
        tracing::debug!(
            horizon = self.horizon,
            kept = self.keys.len(),
            forgotten = self.forgotten.inserted,
            false_positive_rate = self.forgotten.false_positive_rate(),
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
                    tracing::warn!(version = v, error = %Chain(&e), "Could not read a commit's transaction.");
                    return Learned::Unknown;
                }
            };
            match keys_added(&t) {
                Added::None => {}
                Added::Named(hashes) => self.learn_keys(hashes.iter().copied()),
                Added::Unnamed => return Learned::Unknown,
            }
        }
        self.covered = self.covered.max(to);
        Learned::Current
    }
}

/// A Bloom filter of key hashes, allocated at its first insert. It never
/// forgets: past its design load it answers "maybe" more often, which only
/// sends more batches down the exact path.
#[derive(Debug)]
struct Bloom {
    bits: Vec<u64>,
    bytes: usize,
    inserted: u64,
}

/// Probes per key: optimal (ln 2 × bits per key) near 10 bits per key,
/// about 1% false positives.
const BLOOM_PROBES: u64 = 7;

/// The smallest filter, whatever is configured: a filter of zero bits would
/// have to answer "maybe" to every key.
const BLOOM_MIN_BYTES: usize = 4096;

impl Bloom {
    fn new(bytes: usize) -> Self {
        Self {
            bits: Vec::new(),
            bytes: bytes.max(BLOOM_MIN_BYTES),
            inserted: 0,
        }
    }

    /// The bit positions of `h`, all in one 512-bit block (one cache line:
    /// a probe costs one memory access, not seven): the block from one mix
    /// of it, the bits by double hashing over another (the ledger's hashes
    /// are SipHash outputs already, mixed again so the parts are
    /// independent).
    fn probes(&self, h: u64) -> [usize; BLOOM_PROBES as usize] {
        let blocks = (self.bits.len() / 8) as u64;
        let block = (splitmix64(h) % blocks) as usize * 512;
        let a = splitmix64(h ^ 0x9e37_79b9_7f4a_7c15);
        let b = splitmix64(a) | 1;
        std::array::from_fn(|i| block + (a.wrapping_add((i as u64).wrapping_mul(b)) % 512) as usize)
    }

    fn insert(&mut self, h: u64) {
        if self.bits.is_empty() {
            // Whole 64-byte blocks.
            self.bits = vec![0; self.bytes.div_ceil(64) * 8];
        }
        for p in self.probes(h) {
            self.bits[p / 64] |= 1 << (p % 64);
        }
        self.inserted += 1;
    }

    fn may_contain(&self, h: u64) -> bool {
        !self.bits.is_empty()
            && self
                .probes(h)
                .into_iter()
                .all(|p| self.bits[p / 64] & (1 << (p % 64)) != 0)
    }

    /// The expected false-positive rate at the current load.
    fn false_positive_rate(&self) -> f64 {
        let m = (self.bytes.div_ceil(64) * 512) as f64;
        let k = BLOOM_PROBES as f64;
        (1.0 - (-k * self.inserted as f64 / m).exp()).powf(k)
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// What [`Ledger::admit_rows`] knows of a batch.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// No key can be in the table: write it without a look-up.
    Fresh,
    /// Fresh but for these rows, whose keys the filter of forgotten keys
    /// may hold: look them up.
    Suspect(Vec<usize>),
    /// A key is in the table or may be (remembered, older than the horizon,
    /// or more suspects than a look-up of a few keys pays for).
    Known,
}

/// Suspect rows a batch may have and still be looked up row by row (or a
/// sixteenth of the batch, if more).
const MAX_SUSPECTS: usize = 64;

/// Milliseconds since the Unix epoch, now.
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
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
        let mut l = Ledger::new(1, 4, 0);
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

    /// Issue 44, item 5: three writers, each storing its partitions' new
    /// events and learning the others' keys from their commits. Under
    /// 6e978f1 the learned keys got `i64::MAX`, the horizon followed them
    /// once the ledger filled, and every batch took the exact path. Here a
    /// backlog ten days old is replayed, with some events stamped an hour
    /// ahead: nearly every batch stays fresh.
    #[test]
    fn learned_keys_and_future_events_do_not_push_the_horizon_past_fresh_traffic() {
        let writers = 3;
        // A filter large enough that its false positives do not count here.
        let mut ledgers: Vec<Ledger> = (0..writers).map(|_| Ledger::new(1, 64, 1 << 20)).collect();
        let start = wall_ms() - 10 * 86_400_000;
        let (mut next, mut fresh, mut batches) = (0u64, 0, 0);
        for round in 0..600i64 {
            let w = (round % writers as i64) as usize;
            let ts = start + round * 1000;
            let mut rows: Vec<(u64, i64)> = (0..8)
                .map(|_| {
                    next += 1;
                    (key_hash(&format!("e{next}")), ts)
                })
                .collect();
            if round % 50 == 0 {
                next += 1;
                rows.push((key_hash(&format!("e{next}")), wall_ms() + 3_600_000));
            }
            batches += 1;
            fresh += usize::from(ledgers[w].admit(&rows));
            for (o, l) in ledgers.iter_mut().enumerate() {
                if o != w {
                    l.learn_keys(rows.iter().map(|r| r.0));
                }
            }
        }
        assert!(
            fresh * 10 > batches * 9,
            "{fresh} of {batches} batches fresh; horizons {:?}",
            ledgers.iter().map(|l| l.horizon).collect::<Vec<_>>()
        );
        for l in &ledgers {
            assert!(l.horizon <= wall_ms(), "the horizon passed the wall clock");
        }
        // The keys each writer forgot are still never fresh.
        let first = key_hash("e1");
        assert!(ledgers.iter_mut().all(|l| !l.admit(&[(first, wall_ms())])));
    }

    /// Issue 44's repro: with four keys remembered, e1…e5 (timestamps
    /// 1000…5000) push e1 out; e1 re-sent with timestamp 9000 is past the
    /// horizon, but it was forgotten, not absent: not fresh.
    #[test]
    fn a_re_send_of_a_forgotten_key_with_a_newer_timestamp_is_not_fresh() {
        let mut l = Ledger::new(1, 4, 0);
        for (h, ts) in [(1, 1000), (2, 2000), (3, 3000), (4, 4000), (5, 5000)] {
            assert!(l.admit(&[(h, ts)]));
        }
        assert!(l.len() < 5, "e1 was forgotten");
        assert!(!l.admit(&[(1, 9000)]), "the re-send would be stored twice");
        assert!(l.admit(&[(6, 9000)]), "a new key is still fresh");
    }

    /// The model: the set of keys the table holds and how often each is
    /// stored. Any sequence of batches of new keys, re-sends (any
    /// timestamp, any age), restarts (the ledger reloaded from the table)
    /// and ledger sizes stores each key once: a batch the ledger calls
    /// fresh holds no stored key, and every other batch is written as the
    /// exact path writes it (absent keys only).
    #[test]
    fn no_sequence_of_sends_re_sends_and_restarts_stores_a_key_twice() {
        use proptest::prelude::*;
        #[derive(Debug, Clone)]
        enum Step {
            /// A batch of `n` keys: new ones, or re-sends of stored ones
            /// (picked by `pick`), each at `ts`.
            Batch {
                keys: Vec<(bool, u16)>,
                ts: i64,
            },
            Restart,
        }
        let step = prop_oneof![
            8 => (prop::collection::vec((any::<bool>(), any::<u16>()), 1..6), -50i64..5000)
                .prop_map(|(keys, ts)| Step::Batch { keys, ts }),
            1 => Just(Step::Restart),
        ];
        let cfg = ProptestConfig {
            cases: 256,
            ..ProptestConfig::default()
        };
        proptest!(cfg, |(max_keys in 2usize..12, steps in prop::collection::vec(step, 1..120))| {
            // Stored key → (copies, newest timestamp).
            let mut table: std::collections::BTreeMap<u64, (u32, i64)> = Default::default();
            let mut l = Ledger::new(1, max_keys, 0);
            let mut next = 0u64;
            for s in steps {
                match s {
                    Step::Restart => {
                        l = Ledger::new(1, max_keys, 0);
                        for (&h, &(_, ts)) in &table {
                            l.insert(h, ts);
                        }
                    }
                    Step::Batch { keys, ts } => {
                        let stored: Vec<u64> = table.keys().copied().collect();
                        let mut rows: Vec<(u64, i64)> = keys
                            .iter()
                            .map(|&(resend, pick)| {
                                let h = if resend && !stored.is_empty() {
                                    stored[pick as usize % stored.len()]
                                } else {
                                    next += 1;
                                    next
                                };
                                (h, ts)
                            })
                            .collect();
                        rows.sort_unstable();
                        rows.dedup_by_key(|r| r.0);
                        let fresh = l.admit(&rows);
                        for &(h, ts) in &rows {
                            let e = table.entry(h).or_insert((0, ts));
                            if fresh || e.0 == 0 {
                                e.0 += 1;
                            }
                            e.1 = e.1.max(ts);
                        }
                    }
                }
                let twice: Vec<_> = table.iter().filter(|(_, c)| c.0 > 1).collect();
                prop_assert!(twice.is_empty(), "stored twice: {:?}", twice);
            }
        });
    }

    #[test]
    fn the_forgotten_keys_filter_never_misses_and_rarely_lies() {
        let mut b = Bloom::new(1 << 16);
        let hashes: Vec<u64> = (0..40_000u64).map(|i| key_hash(&format!("e{i}"))).collect();
        for &h in &hashes[..20_000] {
            b.insert(h);
        }
        assert!(hashes[..20_000].iter().all(|&h| b.may_contain(h)));
        let false_positives = hashes[20_000..]
            .iter()
            .filter(|&&h| b.may_contain(h))
            .count();
        // 512 Ki bits for 20k keys (26 bits per key): well under 1%.
        assert!(false_positives < 200, "{false_positives}");
        assert!(b.false_positive_rate() < 0.01);
    }

    #[test]
    fn a_batch_with_one_known_key_is_not_fresh_but_is_remembered_whole() {
        let mut l = Ledger::new(1, 100, 0);
        l.insert(2, 10);
        assert!(!l.admit(&[(1, 10), (2, 10), (3, 10)]));
        assert_eq!(l.len(), 3);
        assert!(!l.admit(&[(1, 11)]));
        assert!(!l.admit(&[(3, 11)]));
        assert!(l.admit(&[(4, 11), (5, 11)]));
    }

    #[test]
    fn a_key_keeps_its_newest_timestamp() {
        let mut l = Ledger::new(1, 2, 0);
        l.insert(1, 100);
        l.insert(1, 5);
        l.insert(2, 50);
        l.insert(3, 60);
        // Full: the older half (key 2, ts 50) goes; key 1 stays at 100.
        assert!(!l.admit(&[(1, 200)]));
    }
}
