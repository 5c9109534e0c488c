//! Micro-batching: when to cut a batch.
//!
//! The tracker only counts; the caller owns the buffered data (Arrow
//! builders). That keeps the policy testable without Kafka or Arrow.

use std::time::{Duration, Instant};

/// Limits of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Flush when this many records are buffered.
    pub max_rows: usize,
    /// Flush when the buffered payloads reach this many bytes.
    pub max_bytes: usize,
    /// Flush when the oldest buffered record has waited this long.
    pub linger: Duration,
    /// Flush when this many buffered records carry text to embed (dialogue
    /// turns, items): a batch commits only once all of it is embedded, so
    /// this bounds the time from a turn's arrival to its commit. 0: no limit.
    pub max_texts: usize,
}

impl Default for BatchPolicy {
    fn default() -> Self {
        Self {
            max_rows: 100_000,
            max_bytes: 32 << 20,
            linger: Duration::from_millis(200),
            max_texts: 256,
        }
    }
}

/// Why a batch was cut. A closed set, used as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FlushReason {
    /// `max_rows` reached.
    Rows,
    /// `max_bytes` reached.
    Bytes,
    /// `linger` elapsed.
    Linger,
    /// Shutdown or rebalance: flush whatever is buffered.
    Drain,
    /// A `forget` event: what came before it is written first.
    Forget,
    /// `max_texts` reached.
    Texts,
}

impl FlushReason {
    /// Every reason, for pre-registering metric label values.
    pub const ALL: [Self; 6] = [
        Self::Rows,
        Self::Bytes,
        Self::Linger,
        Self::Drain,
        Self::Forget,
        Self::Texts,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rows => "rows",
            Self::Bytes => "bytes",
            Self::Linger => "linger",
            Self::Drain => "drain",
            Self::Forget => "forget",
            Self::Texts => "texts",
        }
    }
}

/// Counts what the current batch holds and says when to flush it.
#[derive(Debug, Clone)]
pub struct BatchTracker {
    policy: BatchPolicy,
    rows: usize,
    bytes: usize,
    texts: usize,
    opened_at: Option<Instant>,
}

impl BatchTracker {
    /// A tracker with an empty batch.
    pub fn new(policy: BatchPolicy) -> Self {
        Self {
            policy,
            rows: 0,
            bytes: 0,
            texts: 0,
            opened_at: None,
        }
    }

    /// The policy.
    pub fn policy(&self) -> BatchPolicy {
        self.policy
    }

    /// Records one more buffered record of `bytes` bytes at `now`; returns the
    /// reason to flush if a size limit is now reached.
    pub fn record(&mut self, bytes: usize, now: Instant) -> Option<FlushReason> {
        self.record_with(bytes, false, now)
    }

    /// [`BatchTracker::record`] for a record that does (`text`) or does not
    /// carry text to embed.
    pub fn record_with(&mut self, bytes: usize, text: bool, now: Instant) -> Option<FlushReason> {
        self.opened_at.get_or_insert(now);
        self.rows += 1;
        self.bytes = self.bytes.saturating_add(bytes);
        self.texts += usize::from(text);
        if self.rows >= self.policy.max_rows {
            Some(FlushReason::Rows)
        } else if self.bytes >= self.policy.max_bytes {
            Some(FlushReason::Bytes)
        } else if self.policy.max_texts > 0 && self.texts >= self.policy.max_texts {
            Some(FlushReason::Texts)
        } else {
            None
        }
    }

    /// When the open batch must be flushed for lingering; `None` when empty.
    pub fn deadline(&self) -> Option<Instant> {
        self.opened_at.map(|t| t + self.policy.linger)
    }

    /// Whether the open batch has lingered long enough at `now`.
    pub fn linger_elapsed(&self, now: Instant) -> bool {
        self.deadline().is_some_and(|d| now >= d)
    }

    /// Records buffered.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes buffered.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Closes the batch: returns (rows, bytes) and starts an empty one.
    pub fn take(&mut self) -> (usize, usize) {
        let out = (self.rows, self.bytes);
        self.rows = 0;
        self.bytes = 0;
        self.texts = 0;
        self.opened_at = None;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(rows: usize, bytes: usize, linger_ms: u64) -> BatchPolicy {
        BatchPolicy {
            max_rows: rows,
            max_bytes: bytes,
            linger: Duration::from_millis(linger_ms),
            max_texts: 0,
        }
    }

    #[test]
    fn flushes_on_texts_to_embed_and_counts_them_per_batch() {
        let mut t = BatchTracker::new(BatchPolicy {
            max_texts: 2,
            ..policy(1000, 1 << 20, 1000)
        });
        let now = Instant::now();
        assert_eq!(t.record(10, now), None, "a click carries no text");
        assert_eq!(t.record_with(10, true, now), None);
        assert_eq!(t.record(10, now), None);
        assert_eq!(t.record_with(10, true, now), Some(FlushReason::Texts));
        t.take();
        assert_eq!(t.record_with(10, true, now), None, "the count restarts");
        // 0: no limit.
        let mut t = BatchTracker::new(policy(1000, 1 << 20, 1000));
        for _ in 0..100 {
            assert_eq!(t.record_with(1, true, now), None);
        }
    }

    #[test]
    fn flushes_on_rows() {
        let mut t = BatchTracker::new(policy(3, 1 << 20, 1000));
        let now = Instant::now();
        assert_eq!(t.record(10, now), None);
        assert_eq!(t.record(10, now), None);
        assert_eq!(t.record(10, now), Some(FlushReason::Rows));
        assert_eq!(t.take(), (3, 30));
        assert!(t.is_empty());
        assert_eq!(t.deadline(), None);
    }

    #[test]
    fn flushes_on_bytes() {
        let mut t = BatchTracker::new(policy(1000, 100, 1000));
        let now = Instant::now();
        assert_eq!(t.record(60, now), None);
        assert_eq!(t.record(39, now), None);
        assert_eq!(t.record(1, now), Some(FlushReason::Bytes));
        // One record larger than the limit is still a batch of its own.
        t.take();
        assert_eq!(t.record(500, now), Some(FlushReason::Bytes));
    }

    #[test]
    fn linger_counts_from_the_first_record() {
        let mut t = BatchTracker::new(policy(1000, 1 << 20, 100));
        let t0 = Instant::now();
        assert!(
            !t.linger_elapsed(t0 + Duration::from_secs(10)),
            "an empty batch never lingers"
        );
        t.record(1, t0);
        t.record(1, t0 + Duration::from_millis(90));
        assert_eq!(t.deadline(), Some(t0 + Duration::from_millis(100)));
        assert!(!t.linger_elapsed(t0 + Duration::from_millis(99)));
        assert!(t.linger_elapsed(t0 + Duration::from_millis(100)));
        t.take();
        let t1 = t0 + Duration::from_millis(150);
        t.record(1, t1);
        assert_eq!(
            t.deadline(),
            Some(t1 + Duration::from_millis(100)),
            "a new batch restarts the clock"
        );
    }
}
