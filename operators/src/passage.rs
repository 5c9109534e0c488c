//! Passages and hybrid retrieval over long rows (a dialogue session, a
//! conversation record).
//!
//! A sentence embedder reads at most 256 word-pieces; a session is usually
//! longer, and what a question asks about is often in its second half. So a
//! row is also indexed as **windows** of consecutive turns ([`windows`]),
//! each rendered with a short **header** naming who and when ([`render`]),
//! and embedded once. A row's dense score is
//! `mix · max(window cosines) + (1 − mix) · whole-row cosine`.
//!
//! Next to it, BM25 over the rows' texts ([`crate::lexical`]) catches the
//! names, titles and numbers an embedding blurs. The fused score is
//! `dense + lexical_weight · bm25 / ceiling`, where the ceiling is the most
//! any row could score for this query ([`Bm25Index::max_score`]): both terms
//! are on a 0–1 scale whatever the query's length, and a row that shares only
//! common words with the query gets almost nothing.
//!
//! RF-Mem runs on the window index ([`retrieve_until`]): the probe and the
//! gate read window cosines, familiarity takes the top windows and
//! recollection its beam search over windows; the windows found are pooled
//! to their rows (each row once, [`RowHit::passage`] the window that scored
//! best), the lexical top rows join them, and the rows are ranked by the
//! fused score. The path decides which rows are candidates; the fused score
//! decides their order.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::embed::normalize;
use crate::lexical::Bm25Index;
use crate::rfmem::{self, Answer, Error, Path, Probe, RfMemParams, Rule, VectorStore};
use crate::steam::memory::dot;

/// How rows are cut into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WindowParams {
    /// Turns per window (0: no windows, the row is searched whole).
    pub turns: usize,
}

impl Default for WindowParams {
    fn default() -> Self {
        Self { turns: 3 }
    }
}

/// The windows of a row of `n` turns, as a stream forms them: one window
/// ending at each turn, holding it and up to `turns − 1` turns before it
/// (so the first turns' windows are shorter). Every turn is the last turn of
/// exactly one window, which is how the ingest pipeline keys them.
pub fn windows(n: usize, w: &WindowParams) -> Vec<Range<usize>> {
    if w.turns == 0 {
        return Vec::new();
    }
    (0..n)
        .map(|t| (t + 1).saturating_sub(w.turns)..t + 1)
        .collect()
}

/// A window's header: `"{what} with {who} on {date}"`, parts left out when
/// empty (`date` as the caller writes it, e.g. [`utc_day`]).
pub fn header(what: &str, who: &str, date: &str) -> String {
    let mut h = what.to_owned();
    if !who.is_empty() {
        h.push_str(" with ");
        h.push_str(who);
    }
    if !date.is_empty() {
        h.push_str(" on ");
        h.push_str(date);
    }
    h
}

/// `YYYY-MM-DD` of a Unix time in milliseconds (proleptic Gregorian, UTC).
pub fn utc_day(ms: i64) -> String {
    // Howard Hinnant's days-to-civil.
    let z = ms.div_euclid(86_400_000) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// A window's text: the header, then one turn per line.
pub fn render<S: AsRef<str>>(header: &str, turns: &[S]) -> String {
    let mut s = String::with_capacity(
        header.len() + 2 + turns.iter().map(|t| t.as_ref().len() + 1).sum::<usize>(),
    );
    s.push_str(header);
    s.push_str(":\n");
    for (i, t) in turns.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push_str(t.as_ref());
    }
    s
}

/// How the scores are combined.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HybridParams {
    /// Weight of the best window against the whole row in the dense score
    /// (1: windows only, 0: the row only).
    pub mix: f32,
    /// Weight of the BM25 score (over its ceiling for the query) against
    /// the dense score (0: dense only).
    pub lexical_weight: f32,
    /// Windows fetched per row asked for (`k · expand` windows, pooled to
    /// rows), so that windows of the same row do not crowd others out.
    pub expand: usize,
    /// Rows the lexical side adds as candidates, at most (0: as many as
    /// `k`).
    pub lexical_candidates: usize,
}

impl Default for HybridParams {
    fn default() -> Self {
        Self {
            mix: 0.5,
            lexical_weight: 0.3,
            expand: 4,
            lexical_candidates: 0,
        }
    }
}

impl HybridParams {
    /// Checks the parameters, naming the first bad one as `hybrid.<name>`.
    ///
    /// # Errors
    /// [`Error::Invalid`].
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field, reason: String| Err(Error::Invalid { field, reason });
        if !(0.0..=1.0).contains(&self.mix) {
            return bad("hybrid.mix", format!("must be in [0, 1], got {}", self.mix));
        }
        if !(self.lexical_weight.is_finite() && self.lexical_weight >= 0.0) {
            return bad(
                "hybrid.lexical_weight",
                format!("must be a finite number ≥ 0, got {}", self.lexical_weight),
            );
        }
        if !(1..=64).contains(&self.expand) {
            return bad(
                "hybrid.expand",
                format!("must be in [1, 64], got {}", self.expand),
            );
        }
        if self.lexical_candidates > rfmem::MAX_K {
            return bad(
                "hybrid.lexical_candidates",
                format!("must be at most {}", rfmem::MAX_K),
            );
        }
        Ok(())
    }
}

/// One user's rows as whole-row vectors, windows and a lexical index.
///
/// Windows are grouped by row: row `r`'s windows are
/// `starts[r]..starts[r + 1]` of the window store. A row without windows is
/// scored by its whole-row vector alone.
#[derive(Debug)]
pub struct PassageIndex {
    rows: VectorStore,
    windows: VectorStore,
    /// Window → row.
    owner: Vec<u32>,
    /// Row → first window (len rows + 1).
    starts: Vec<u32>,
    lexical: Option<Bm25Index>,
    /// The windows as evidence units ([`units`]), when given.
    units: Option<Units>,
}

impl PassageIndex {
    /// Bytes its stores hold beside their f32 rows (int8 copies).
    pub fn extra_bytes(&self) -> usize {
        self.rows.extra_bytes() + self.windows.extra_bytes()
    }

    /// Builds the index. `owner` gives each window's row, ascending
    /// (windows grouped by row); `lexical`, when given, indexes the rows in
    /// the same order. When there are windows, every row needs at least one:
    /// dense candidates come from the window index only, so a row with no
    /// windows of its own (a click, a memory, a session written before
    /// passages existed) is given its own vector as its one window.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the parts disagree.
    pub fn new(
        rows: VectorStore,
        windows: VectorStore,
        owner: Vec<u32>,
        lexical: Option<Bm25Index>,
    ) -> Result<Self, Error> {
        let bad = |reason: String| Error::Invalid {
            field: "passages",
            reason,
        };
        if owner.len() != windows.len() {
            return Err(bad(format!(
                "{} windows but {} owners",
                windows.len(),
                owner.len()
            )));
        }
        if !windows.is_empty() && windows.dim() != rows.dim() {
            return Err(bad("windows and rows differ in dimension".into()));
        }
        if owner.windows(2).any(|w| w[0] > w[1]) {
            return Err(bad("windows must be grouped by row, ascending".into()));
        }
        if owner.last().is_some_and(|&r| r as usize >= rows.len()) {
            return Err(bad("a window names a row that does not exist".into()));
        }
        if let Some(l) = &lexical
            && l.len() != rows.len()
        {
            return Err(bad(format!(
                "{} rows but {} lexical documents",
                rows.len(),
                l.len()
            )));
        }
        let mut starts = vec![0u32; rows.len() + 1];
        for &r in &owner {
            starts[r as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        if !windows.is_empty()
            && let Some(r) = starts.windows(2).position(|s| s[0] == s[1])
        {
            return Err(bad(format!(
                "row {r} has no window (give it its own vector as one)"
            )));
        }
        Ok(Self {
            rows,
            windows,
            owner,
            starts,
            lexical,
            units: None,
        })
    }

    /// The index with its windows as evidence units: `units` gives each
    /// window's turns and (optionally) BM25 over the windows' texts.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `units` has another number of windows.
    pub fn with_units(mut self, units: Units) -> Result<Self, Error> {
        let lexical = units
            .lexical
            .as_ref()
            .map_or(units.spans.len(), Bm25Index::len);
        let sparse = units
            .sparse
            .as_ref()
            .map_or(units.spans.len(), crate::lexical::SparseIndex::len);
        if units.spans.len() != self.windows.len()
            || lexical != self.windows.len()
            || sparse != self.windows.len()
        {
            return Err(Error::Invalid {
                field: "passages",
                reason: format!(
                    "{} windows but {} unit spans, {lexical} unit texts and {sparse} sparse vectors",
                    self.windows.len(),
                    units.spans.len()
                ),
            });
        }
        self.units = Some(units);
        Ok(self)
    }

    /// Whether the windows are indexed as evidence units.
    pub fn has_units(&self) -> bool {
        self.units.is_some() && !self.windows.is_empty()
    }

    /// Whether the evidence units carry learned sparse vectors.
    pub fn has_sparse_units(&self) -> bool {
        self.has_units() && self.units.as_ref().is_some_and(|u| u.sparse.is_some())
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Windows.
    pub fn windows(&self) -> usize {
        self.windows.len()
    }

    /// The whole-row store.
    pub fn rows(&self) -> &VectorStore {
        &self.rows
    }

    /// The row of window `w`.
    pub fn owner(&self, w: u32) -> u32 {
        self.owner[w as usize]
    }

    /// The first window of row `r` (its windows are consecutive), if it
    /// has any.
    pub fn first_window(&self, r: u32) -> Option<u32> {
        let (a, b) = (
            *self.starts.get(r as usize)?,
            *self.starts.get(r as usize + 1)?,
        );
        (a < b).then_some(a)
    }

    /// Whether the lexical side is indexed.
    pub fn has_lexical(&self) -> bool {
        self.lexical.is_some()
    }

    /// Whether either store is searched approximately (an IVF).
    pub fn is_approximate(&self) -> bool {
        self.rows.is_approximate() || self.windows.is_approximate()
    }

    /// Approximate heap bytes of the owner map and the lexical index (the
    /// stores are counted by their owner).
    pub fn bytes(&self) -> usize {
        self.owner.capacity() * 4
            + self.starts.capacity() * 4
            + self.lexical.as_ref().map_or(0, Bm25Index::bytes)
            + self.units.as_ref().map_or(0, Units::bytes)
    }

    /// Row `r`'s dense score for the unit query `q`, and its best window.
    fn dense(&self, q: &[f32], r: u32, mix: f32) -> (f32, Option<u32>) {
        let whole = dot(q, &self.rows.vector(r as usize));
        let span = self.starts[r as usize]..self.starts[r as usize + 1];
        let best = span
            .map(|w| (w, dot(q, &self.windows.vector(w as usize))))
            .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)));
        match best {
            Some((w, s)) => (mix * s + (1.0 - mix) * whole, Some(w)),
            None => (whole, None),
        }
    }
}

/// One returned row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RowHit {
    /// The row.
    pub row: u32,
    /// The fused score (the order).
    pub score: f32,
    /// The dense part: window and whole-row cosines mixed.
    pub dense: f32,
    /// The lexical part: BM25 over the query's ceiling (0–1).
    pub lexical: f32,
    /// The window that scored best, if the row has windows.
    pub passage: Option<u32>,
    /// The recollection round that found it (0 for familiarity or a
    /// lexical candidate).
    pub round: u32,
}

/// What a hybrid retrieval did and found.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridAnswer {
    /// The rows, best first.
    pub hits: Vec<RowHit>,
    /// The path that chose the dense candidates.
    pub path: Path,
    /// Why.
    pub rule: Rule,
    /// The probe's statistics (window cosines).
    pub probe: Probe,
    /// Recollection rounds run.
    pub rounds: u32,
    /// Windows searched in total.
    pub candidates: usize,
    /// Rows that only the lexical side proposed.
    pub lexical_only: usize,
    /// Windows (or rows) the dense path's short recollection was topped up
    /// with ([`RfMemParams::fill`]).
    pub filled: usize,
    /// Time in the probe and the gate.
    pub probe_time: Duration,
    /// Time in the path, the pooling and the fusion.
    pub path_time: Duration,
    /// Recollection was cut short by `stop`.
    pub truncated: bool,
}

/// Hybrid RF-Mem retrieval (see the module docs). `query_text` feeds the
/// lexical side (`None` or an index without one: dense only). The RF-Mem
/// parameters' `k` is in rows.
///
/// # Errors
/// [`Error::Invalid`] for a bad query or parameters; kernel errors.
pub fn retrieve_until(
    index: &PassageIndex,
    query: &[f32],
    query_text: Option<&str>,
    p: &RfMemParams,
    h: &HybridParams,
    stop: &dyn Fn() -> bool,
) -> Result<HybridAnswer, Error> {
    h.validate()?;
    p.validate()?;
    rfmem::check_query(query, index.rows.dim())?;
    let mut q = query.to_vec();
    normalize(&mut q);
    // Dense candidates: RF-Mem over the windows, or over the rows when
    // there are none.
    let searched = if index.windows.is_empty() {
        &index.rows
    } else {
        &index.windows
    };
    let wide = RfMemParams {
        k: (p.k * h.expand).min(rfmem::MAX_K),
        ..*p
    };
    let a: Answer = rfmem::retrieve_until(searched, &q, &wide, stop)?;
    let probe_time = a.probe_time;
    let path_started = Instant::now();
    let mut order: Vec<(u32, u32)> = Vec::new(); // (row, round)
    let mut seen: HashMap<u32, ()> = HashMap::new();
    for f in &a.hits {
        let row = if index.windows.is_empty() {
            f.index
        } else {
            index.owner[f.index as usize]
        };
        if seen.insert(row, ()).is_none() {
            order.push((row, f.round));
        }
    }
    // Lexical candidates and scale.
    let mut lexical: HashMap<u32, f32> = HashMap::new();
    let mut lexical_only = 0;
    if h.lexical_weight > 0.0
        && let (Some(ix), Some(text)) = (&index.lexical, query_text)
    {
        let mut s = ix.scores(text);
        let max = ix.max_score(text);
        if max > 0.0 {
            s.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let take = if h.lexical_candidates == 0 {
                p.k
            } else {
                h.lexical_candidates
            };
            for (i, &(row, score)) in s.iter().enumerate() {
                lexical.insert(row, score / max);
                if i < take && seen.insert(row, ()).is_none() {
                    order.push((row, 0));
                    lexical_only += 1;
                }
            }
        }
    }
    let mut hits: Vec<RowHit> = order
        .into_iter()
        .map(|(row, round)| {
            let (dense, passage) = index.dense(&q, row, h.mix);
            let lex = lexical.get(&row).copied().unwrap_or(0.0);
            RowHit {
                row,
                score: dense + h.lexical_weight * lex,
                dense,
                lexical: lex,
                passage,
                round,
            }
        })
        .filter(|r| r.score >= p.min_score)
        .collect();
    hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.row.cmp(&b.row)));
    hits.truncate(p.k);
    Ok(HybridAnswer {
        hits,
        path: a.path,
        rule: a.rule,
        probe: a.probe,
        rounds: a.rounds,
        candidates: a.candidates,
        lexical_only,
        filled: a.filled,
        probe_time,
        path_time: path_started.elapsed() + a.path_time,
        truncated: a.truncated,
    })
}

#[cfg(test)]
mod tests;
pub mod units;

pub use units::{UnitAnswer, UnitBudget, UnitHit, UnitParams, Units, retrieve_units_until};
