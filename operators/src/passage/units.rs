//! Evidence units: what an answer hands over, at the granularity of the
//! evidence (issue 45).
//!
//! A whole session is the wrong answer to a question about one of its turns:
//! an agent cannot afford 200 turns per question, and a session-level hit
//! does not say where the evidence is. So the windows themselves are ranked
//! ([`retrieve_units_until`]):
//!
//! - **Candidates**: RF-Mem over the window vectors (the probe, the gate,
//!   familiarity or recollection, as for rows) and the windows BM25 scores
//!   best over the windows' own text ([`Units::lexical`]), so a name or a
//!   date in one turn is found even when its session is about something
//!   else; and, when the windows carry learned sparse vectors (SPLADE, the
//!   term-wise max of their turns' vectors), the windows those score best
//!   ([`Units::with_sparse`]).
//! - **Score**: each candidate window's dense score is `mix · cos(window) +
//!   (1 − mix) · cos(its row)`, its lexical score its BM25 over the query's
//!   ceiling (0–1) and its sparse score its SPLADE dot product over the
//!   query's ceiling (0–1), fused as `dense + lexical_weight · lexical +
//!   sparse_weight · sparse`, with their own weights ([`UnitParams`]).
//! - **Units under a budget**: windows are taken best first, each handing
//!   over only its turns not handed over yet, at its rank (so the best
//!   evidence comes first however long its session); turns that continue
//!   the unit taken just before join it, others make a unit of their own.
//!   Several units may come from one session when they earn it, and no turn
//!   is handed over twice. Taking stops at `k` units or `max_turns` turns,
//!   whichever comes first; a window is cut to the turns left, keeping the
//!   turn it ends at.
//!
//! A row with no turns of its own (a memory, a click, a single turn, a
//! session written before windows existed) is one unit of one turn.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::{HybridParams, PassageIndex};
use crate::embed::{SparseVec, normalize};
use crate::lexical::{Bm25Index, SparseIndex};
use crate::rfmem::{self, Answer, Error, RfMemParams};
use crate::steam::memory::dot;

/// Per window: the turns of its row it covers, and BM25 over its text.
#[derive(Debug)]
pub struct Units {
    /// Window → turns `start..end` of its row (`0..0`: the whole row, one
    /// unit of one turn).
    pub(super) spans: Vec<(u32, u32)>,
    /// BM25 over each window's text, in window order.
    pub(super) lexical: Option<Bm25Index>,
    /// Each window's learned sparse vector, in window order.
    pub(super) sparse: Option<SparseIndex>,
}

impl Units {
    /// `spans[w]` is window `w`'s turns in its row (`(0, 0)` for a row that
    /// is its own window); `lexical`, when given, indexes the windows'
    /// texts in the same order.
    pub fn new(spans: Vec<(u32, u32)>, lexical: Option<Bm25Index>) -> Self {
        Self {
            spans,
            lexical,
            sparse: None,
        }
    }

    /// With the windows' learned sparse vectors, in window order (one per
    /// window, or the index is refused by [`PassageIndex::with_units`]).
    #[must_use]
    pub fn with_sparse(mut self, sparse: SparseIndex) -> Self {
        self.sparse = Some(sparse);
        self
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.spans.capacity() * 8
            + self.lexical.as_ref().map_or(0, Bm25Index::bytes)
            + self.sparse.as_ref().map_or(0, SparseIndex::bytes)
    }
}

/// How evidence units are scored (`[serve.units]`): the fields of
/// [`HybridParams`], applied to windows instead of rows. Windows are short,
/// so their BM25 over its ceiling runs lower than a whole session's, and
/// the lexical side gets a larger weight than rows do (fitted on LoCoMo's
/// development half: docs/results.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UnitParams {
    /// Weight of the window's cosine against its row's (1: the window only).
    pub mix: f32,
    /// Weight of the window's BM25 (over its ceiling) against the dense
    /// score.
    pub lexical_weight: f32,
    /// Weight of the window's SPLADE score (over its ceiling) against the
    /// dense score; 0 turns the sparse side off.
    pub sparse_weight: f32,
    /// Windows fetched from each side per unit asked for.
    pub expand: usize,
    /// Units one row (session) may give an answer at most; 0: no cap. A
    /// window that continues the unit taken just before still joins it.
    pub per_row: usize,
    /// Subtracted from a window's fused score for each unit its row has
    /// already given the answer, when the next unit is chosen: a soft
    /// [`per_row`](Self::per_row) that spreads an answer over more
    /// sessions unless a session's next window still earns its place. 0:
    /// windows are taken in score order.
    pub repeat_penalty: f32,
}

impl Default for UnitParams {
    fn default() -> Self {
        Self {
            mix: 0.75,
            lexical_weight: 1.0,
            sparse_weight: 1.5,
            expand: 4,
            per_row: 0,
            repeat_penalty: 0.05,
        }
    }
}

impl UnitParams {
    /// As [`HybridParams`] (the fields that apply).
    pub fn hybrid(&self) -> HybridParams {
        HybridParams {
            mix: self.mix,
            lexical_weight: self.lexical_weight,
            expand: self.expand,
            lexical_candidates: 0,
        }
    }

    /// Checks the parameters, naming the first bad one as `units.<name>`.
    ///
    /// # Errors
    /// [`Error::Invalid`].
    pub fn validate(&self) -> Result<(), Error> {
        for (field, v) in [
            ("units.sparse_weight", self.sparse_weight),
            ("units.repeat_penalty", self.repeat_penalty),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::Invalid {
                    field,
                    reason: format!("must be a finite number >= 0, got {v}"),
                });
            }
        }
        self.hybrid().validate().map_err(|e| match e {
            Error::Invalid { field, reason } => Error::Invalid {
                field: match field {
                    "hybrid.mix" => "units.mix",
                    "hybrid.lexical_weight" => "units.lexical_weight",
                    "hybrid.expand" => "units.expand",
                    other => other,
                },
                reason,
            },
            other => other,
        })
    }
}

/// How much one answer hands over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnitBudget {
    /// Units at most.
    pub units: usize,
    /// Turns at most, over all units (a row without turns counts one).
    pub turns: usize,
}

/// One evidence unit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UnitHit {
    /// Its row.
    pub row: u32,
    /// Its turns in the row, `start..end` (`0..0`: the whole row).
    pub start: u32,
    /// One past its last turn.
    pub end: u32,
    /// The window that scored best in it.
    pub window: u32,
    /// That window's fused score (the order).
    pub score: f32,
    /// Its dense part.
    pub dense: f32,
    /// Its lexical part (0–1).
    pub lexical: f32,
    /// Its learned sparse part (0–1).
    pub sparse: f32,
    /// The recollection round that found it (0: familiarity or lexical).
    pub round: u32,
}

impl UnitHit {
    /// Turns it hands over (a whole row: one).
    pub fn turns(&self) -> usize {
        if self.end == 0 {
            1
        } else {
            (self.end - self.start) as usize
        }
    }
}

/// What [`retrieve_units_until`] did and found.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitAnswer {
    /// The units, best first.
    pub hits: Vec<UnitHit>,
    /// The dense path's answer (its hits cleared): path, rule, probe,
    /// rounds, candidates, timings, truncation.
    pub dense: Answer,
    /// Windows among the candidates that only the lexical side proposed.
    pub lexical_only: usize,
    /// Windows among the candidates that only the sparse side proposed.
    pub sparse_only: usize,
}

/// Ranks `index`'s windows for `query` and takes units under `budget` (see
/// the module docs). Needs [`PassageIndex::with_units`].
///
/// # Errors
/// [`Error::Invalid`] for a bad query or parameters, or an index without
/// units; kernel errors.
pub fn retrieve_units_until(
    index: &PassageIndex,
    query: &[f32],
    query_text: Option<&str>,
    query_sparse: Option<&SparseVec>,
    p: &RfMemParams,
    u: &UnitParams,
    budget: UnitBudget,
    stop: &dyn Fn() -> bool,
) -> Result<UnitAnswer, Error> {
    u.validate()?;
    let h = &u.hybrid();
    p.validate()?;
    rfmem::check_query(query, index.rows.dim())?;
    let Some(units) = index.units.as_ref().filter(|_| !index.windows.is_empty()) else {
        return Err(Error::Invalid {
            field: "passages",
            reason: "the index has no windows with units".into(),
        });
    };
    let mut q = query.to_vec();
    normalize(&mut q);
    // Candidates for `k` units, where `k` is RF-Mem's: an answer bounded
    // only by its turns (more units than k) takes them from the same pool.
    let wide = RfMemParams {
        k: (budget.units.min(p.k).max(1) * h.expand).min(rfmem::MAX_K),
        ..*p
    };
    let mut dense = rfmem::retrieve_until(&index.windows, &q, &wide, stop)?;
    let mut candidates: Vec<(u32, u32)> = Vec::new(); // (window, round)
    let mut seen: HashSet<u32> = HashSet::new();
    for f in &dense.hits {
        if seen.insert(f.index) {
            candidates.push((f.index, f.round));
        }
    }
    dense.hits.clear();
    // Every window's BM25 over the query's ceiling (a dense vector: cheap
    // to fill and to look up), and its top windows as candidates; the same
    // for the windows' sparse vectors.
    let mut lexical: Vec<f32> = Vec::new();
    let mut lexical_only = 0;
    if h.lexical_weight > 0.0
        && let (Some(ix), Some(text)) = (&units.lexical, query_text)
    {
        lexical = over_ceiling(ix.dense_scores(text), ix.max_score(text));
        lexical_only = add_top(&lexical, wide.k, &mut seen, &mut candidates);
    }
    let mut sparse: Vec<f32> = Vec::new();
    let mut sparse_only = 0;
    if u.sparse_weight > 0.0
        && let (Some(ix), Some(q)) = (&units.sparse, query_sparse)
    {
        sparse = over_ceiling(ix.dense_scores(q), ix.max_score(q));
        sparse_only = add_top(&sparse, wide.k, &mut seen, &mut candidates);
    }
    let mut scored: Vec<UnitHit> = candidates
        .into_iter()
        .map(|(w, round)| {
            let row = index.owner[w as usize];
            let cos = dot(&q, &index.windows.vector(w as usize));
            let whole = dot(&q, &index.rows.vector(row as usize));
            let d = h.mix * cos + (1.0 - h.mix) * whole;
            let lex = lexical.get(w as usize).copied().unwrap_or(0.0);
            let sp = sparse.get(w as usize).copied().unwrap_or(0.0);
            let (start, end) = units.spans.get(w as usize).copied().unwrap_or((0, 0));
            UnitHit {
                row,
                start,
                end,
                window: w,
                score: d + h.lexical_weight * lex + u.sparse_weight * sp,
                dense: d,
                lexical: lex,
                sparse: sp,
                round,
            }
        })
        .filter(|u| u.score >= p.min_score)
        .collect();
    scored.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.window.cmp(&b.window)));
    Ok(UnitAnswer {
        hits: take_units(scored, budget, u.per_row, u.repeat_penalty),
        dense,
        lexical_only,
        sparse_only,
    })
}

/// `scores` over `ceiling` (all 0 when the ceiling is 0: no query term is
/// indexed).
fn over_ceiling(mut scores: Vec<f32>, ceiling: f32) -> Vec<f32> {
    if ceiling > 0.0 {
        scores.iter_mut().for_each(|s| *s /= ceiling);
    } else {
        scores.clear();
    }
    scores
}

/// Adds the `k` best windows of `scores` (those above 0) to the candidates
/// not seen yet; returns how many it added.
fn add_top(
    scores: &[f32],
    k: usize,
    seen: &mut HashSet<u32>,
    candidates: &mut Vec<(u32, u32)>,
) -> usize {
    let order = |a: &u32, b: &u32| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    let mut top: Vec<u32> = (0..scores.len() as u32)
        .filter(|&w| scores[w as usize] > 0.0)
        .collect();
    if top.len() > k && k > 0 {
        top.select_nth_unstable_by(k - 1, order);
        top.truncate(k);
    }
    top.sort_by(order);
    let mut added = 0;
    for w in top {
        if seen.insert(w) {
            candidates.push((w, 0));
            added += 1;
        }
    }
    added
}

/// Takes windows (best first) as units under `budget`: each window hands
/// over only its turns not yet handed over, at its rank, so the best
/// evidence comes first whatever its session's length; those turns join
/// the unit taken just before when they continue it (consecutive ranks in
/// one place of a session read as one passage), else they are a unit of
/// their own. With a `repeat_penalty`, the next window is the one whose
/// score less `repeat_penalty` times the units its row already gave is
/// highest (ties: the order of `windows`).
fn take_units(
    windows: Vec<UnitHit>,
    budget: UnitBudget,
    per_row: usize,
    repeat_penalty: f32,
) -> Vec<UnitHit> {
    let mut out: Vec<UnitHit> = Vec::new();
    let mut per: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
    let given =
        |per: &std::collections::HashMap<u32, usize>, row: u32| per.get(&row).copied().unwrap_or(0);
    let full = |per: &std::collections::HashMap<u32, usize>, row: u32| {
        per_row > 0 && given(per, row) >= per_row
    };
    let mut handed: HashSet<(u32, u32)> = HashSet::new();
    let mut whole: HashSet<u32> = HashSet::new();
    let mut turns = 0usize;
    let mut pending = windows;
    while turns < budget.turns && !pending.is_empty() {
        // The best window after the penalty, the earlier one on ties (so
        // without a penalty, the front): a scan per unit over the few
        // k · expand candidates.
        let effective = |w: &UnitHit| w.score - repeat_penalty * given(&per, w.row) as f32;
        let next = pending
            .iter()
            .enumerate()
            .min_by(|(_, a), (_, b)| effective(b).total_cmp(&effective(a)))
            .map_or(0, |(i, _)| i);
        let w = pending.remove(next);
        let left = budget.turns - turns;
        if w.end == 0 {
            // A row without turns: once, as one turn.
            if out.len() >= budget.units || full(&per, w.row) || !whole.insert(w.row) {
                continue;
            }
            turns += 1;
            *per.entry(w.row).or_default() += 1;
            out.push(w);
            continue;
        }
        // The window's turns not handed over yet: the run that ends
        // nearest its last turn (the turn it was formed for).
        let mut hi = w.end;
        while hi > w.start && handed.contains(&(w.row, hi - 1)) {
            hi -= 1;
        }
        if hi == w.start {
            continue;
        }
        let mut lo = hi - 1;
        while lo > w.start && !handed.contains(&(w.row, lo - 1)) {
            lo -= 1;
        }
        // Cut to the turns left, keeping the last.
        let lo = lo.max(hi - u32::try_from(left).unwrap_or(u32::MAX).min(hi - lo));
        let continues = out
            .last()
            .is_some_and(|u| u.row == w.row && u.end > 0 && (u.end == lo || hi == u.start));
        if !continues && (out.len() >= budget.units || full(&per, w.row)) {
            continue;
        }
        if !continues {
            *per.entry(w.row).or_default() += 1;
        }
        for t in lo..hi {
            handed.insert((w.row, t));
        }
        turns += (hi - lo) as usize;
        match out.last_mut() {
            Some(u) if continues => {
                u.start = u.start.min(lo);
                u.end = u.end.max(hi);
            }
            _ => out.push(UnitHit {
                start: lo,
                end: hi,
                ..w
            }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lexical::Bm25Params;
    use crate::passage::tests::store;
    use crate::rfmem::Mode;

    /// (row, start, end) of each unit.
    fn spans(units: &[UnitHit]) -> Vec<(u32, u32, u32)> {
        units.iter().map(|u| (u.row, u.start, u.end)).collect()
    }

    /// Row 0: a session of 12 turns with windows ending at turns 2, 3, 11
    /// and 7; row 1: a memory, its own window. The query points along windows
    /// 0 and 1 (overlapping: one unit); window 3 holds the rare name the
    /// query text asks for, though its vector points elsewhere.
    fn index() -> PassageIndex {
        let rows = store(&[[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]);
        let windows = store(&[
            [1.0, 0.0, 0.0, 0.0],
            [0.9, 0.1, 0.0, 0.0],
            [0.0, 1.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 1.0],
            [0.0, 0.0, 1.0, 0.0],
        ]);
        let texts = [
            "we talked about the weather",
            "the weather again",
            "football results",
            "Coltrane recorded Blue Train",
            "likes jazz",
        ];
        PassageIndex::new(rows, windows, vec![0, 0, 0, 0, 1], None)
            .unwrap()
            .with_units(Units::new(
                vec![(0, 3), (1, 4), (9, 12), (5, 8), (0, 0)],
                Some(Bm25Index::new(texts, Bm25Params::default())),
            ))
            .unwrap()
    }

    #[test]
    fn windows_are_ranked_merged_and_found_by_their_own_words() {
        let ix = index();
        let p = RfMemParams {
            mode: Mode::Familiarity,
            k: 3,
            ..RfMemParams::default()
        };
        let u = UnitParams {
            mix: 1.0,
            lexical_weight: 1.0,
            sparse_weight: 0.0,
            expand: 4,
            per_row: 0,
            repeat_penalty: 0.0,
        };
        let budget = UnitBudget {
            units: 3,
            turns: 30,
        };
        let q = [1.0, 0.0, 0.0, 0.0];
        let a = retrieve_units_until(&ix, &q, Some("Coltrane"), None, &p, &u, budget, &|| false)
            .unwrap();
        let spans = spans(&a.hits);
        // Windows 0 and 1 (consecutive ranks) are one unit, turns 0..4;
        // window 3 (the name) is a second unit of the same session, 5..8,
        // though its vector is far.
        assert_eq!(spans[0], (0, 0, 4), "{a:?}");
        assert_eq!(spans[1], (0, 5, 8), "{a:?}");
        assert_eq!(a.hits[1].window, 3);
        assert!(
            a.hits
                .iter()
                .all(|h| h.score >= a.hits.last().unwrap().score)
        );
        // Dense only, the name is not found first.
        let dense = UnitParams {
            lexical_weight: 0.0,
            ..u
        };
        let a = retrieve_units_until(&ix, &q, Some("Coltrane"), None, &p, &dense, budget, &|| {
            false
        })
        .unwrap();
        assert_eq!(a.lexical_only, 0);
        // The turn budget holds whatever k is.
        let tight = UnitBudget { units: 3, turns: 2 };
        let a = retrieve_units_until(&ix, &q, Some("Coltrane"), None, &p, &u, tight, &|| false)
            .unwrap();
        assert_eq!(a.hits.iter().map(UnitHit::turns).sum::<usize>(), 2, "{a:?}");
        // An index without units is refused, not answered wrongly.
        let bare =
            PassageIndex::new(store(&[[1.0, 0.0, 0.0, 0.0]]), store(&[]), vec![], None).unwrap();
        assert!(retrieve_units_until(&bare, &q, None, None, &p, &u, budget, &|| false).is_err());
    }

    #[test]
    fn a_window_is_found_by_its_sparse_vector_alone() {
        // Window 2 shares no word with the query and points away from it,
        // but its learned expansion holds term 42 ("dog" for "puppy").
        let sparse: Vec<SparseVec> = (0..5)
            .map(|w| match w {
                2 => SparseVec::from_pairs(vec![(42, 2.0), (7, 0.5)]),
                0 => SparseVec::from_pairs(vec![(7, 0.1)]),
                _ => SparseVec::default(),
            })
            .collect();
        let ix = index();
        let units = ix.units.as_ref().unwrap();
        let ix = PassageIndex {
            units: Some(
                Units::new(units.spans.clone(), None).with_sparse(SparseIndex::new(&sparse)),
            ),
            ..ix
        };
        let p = RfMemParams {
            mode: Mode::Familiarity,
            k: 1,
            ..RfMemParams::default()
        };
        let u = UnitParams {
            mix: 1.0,
            lexical_weight: 0.0,
            sparse_weight: 2.0,
            expand: 1,
            per_row: 0,
            repeat_penalty: 0.0,
        };
        let budget = UnitBudget {
            units: 2,
            turns: 30,
        };
        let q = [1.0, 0.0, 0.0, 0.0];
        let query = SparseVec::from_pairs(vec![(42, 1.0)]);
        let a =
            retrieve_units_until(&ix, &q, None, Some(&query), &p, &u, budget, &|| false).unwrap();
        assert_eq!(a.sparse_only, 1, "{a:?}");
        let hit = a
            .hits
            .iter()
            .find(|h| h.window == 2)
            .expect("found by its sparse vector");
        // Its sparse part is its score over the query's ceiling: 1.
        assert_eq!(hit.sparse, 1.0);
        assert_eq!(a.hits[0].window, 2, "weight 2 puts it first: {a:?}");
        // Off, it is not proposed.
        let off = UnitParams {
            sparse_weight: 0.0,
            ..u
        };
        let a =
            retrieve_units_until(&ix, &q, None, Some(&query), &p, &off, budget, &|| false).unwrap();
        assert!(
            a.hits.iter().all(|h| h.window != 2 && h.sparse == 0.0),
            "{a:?}"
        );
        // A bad weight names its field.
        let bad = UnitParams {
            sparse_weight: f32::NAN,
            ..u
        };
        let e = retrieve_units_until(&ix, &q, None, Some(&query), &p, &bad, budget, &|| false)
            .unwrap_err();
        assert!(e.to_string().contains("units.sparse_weight"), "{e}");
        let bad = UnitParams {
            repeat_penalty: -0.1,
            ..u
        };
        let e = bad.validate().unwrap_err();
        assert!(e.to_string().contains("units.repeat_penalty"), "{e}");
    }

    fn w(row: u32, start: u32, end: u32, score: f32) -> UnitHit {
        UnitHit {
            row,
            start,
            end,
            window: 0,
            score,
            dense: score,
            lexical: 0.0,
            sparse: 0.0,
            round: 0,
        }
    }

    #[test]
    fn each_window_hands_over_its_new_turns_at_its_rank() {
        let got = take_units(
            vec![
                w(0, 4, 7, 0.9),
                w(1, 0, 3, 0.8),
                w(0, 5, 8, 0.7),
                w(0, 20, 23, 0.6),
                w(0, 1, 4, 0.5),
            ],
            ALL,
            0,
            0.0,
        );
        // 5..8 hands over only turn 7, at its rank; 1..4 its own turns.
        assert_eq!(
            spans(&got),
            [(0, 4, 7), (1, 0, 3), (0, 7, 8), (0, 20, 23), (0, 1, 4)]
        );
        assert_eq!(got[0].score, 0.9);
        // Consecutive ranks in one place of a session are one unit, and a
        // later window continuing the last unit joins it.
        let got = take_units(
            vec![w(2, 0, 3, 0.9), w(2, 1, 4, 0.8), w(2, 2, 5, 0.7)],
            ALL,
            0,
            0.0,
        );
        assert_eq!(spans(&got), [(2, 0, 5)]);
        let got = take_units(
            vec![w(2, 0, 3, 0.9), w(2, 5, 8, 0.8), w(2, 3, 6, 0.7)],
            ALL,
            0,
            0.0,
        );
        assert_eq!(
            spans(&got),
            [(2, 0, 3), (2, 3, 8)],
            "no turn is handed over twice"
        );
    }

    const ALL: UnitBudget = UnitBudget {
        units: 10,
        turns: 100,
    };

    /// Row 0 scores best in four places, rows 1 and 2 in one each.
    fn places() -> Vec<UnitHit> {
        vec![
            w(0, 0, 3, 0.9),
            w(0, 10, 13, 0.8),
            w(1, 0, 3, 0.7),
            w(0, 3, 6, 0.6),
            w(0, 20, 23, 0.5),
            w(2, 4, 7, 0.4),
        ]
    }

    #[test]
    fn a_row_gives_at_most_per_row_units() {
        // Capped at one: row 0's later places are skipped (3..6 comes after
        // row 1's unit, so it would be a second unit of row 0, not a
        // continuation).
        assert_eq!(
            spans(&take_units(places(), ALL, 1, 0.0)),
            [(0, 0, 3), (1, 0, 3), (2, 4, 7)]
        );
        assert_eq!(
            spans(&take_units(places(), ALL, 2, 0.0)),
            [(0, 0, 3), (0, 10, 13), (1, 0, 3), (2, 4, 7)]
        );
        assert_eq!(
            spans(&take_units(places(), ALL, 0, 0.0)),
            [
                (0, 0, 3),
                (0, 10, 13),
                (1, 0, 3),
                (0, 3, 6),
                (0, 20, 23),
                (2, 4, 7)
            ]
        );
        // A window continuing the unit just taken joins it under any cap.
        assert_eq!(
            spans(&take_units(
                vec![w(0, 0, 3, 0.9), w(0, 1, 4, 0.8)],
                ALL,
                1,
                0.0
            )),
            [(0, 0, 4)]
        );
    }

    #[test]
    fn a_repeat_penalty_spreads_units_unless_a_window_earns_its_place() {
        // 0.8 - 0.2 < 0.7: row 1 comes second; then row 0's 0.8 - 0.2 beats
        // row 2's 0.4, and its next 0.6 - 0.4 does not.
        assert_eq!(
            spans(&take_units(places(), ALL, 0, 0.2)),
            [
                (0, 0, 3),
                (1, 0, 3),
                (0, 10, 13),
                (2, 4, 7),
                (0, 3, 6),
                (0, 20, 23)
            ]
        );
        // A penalty is never a cap: every window still comes, in the end.
        assert_eq!(
            spans(&take_units(places(), ALL, 0, 10.0)),
            [
                (0, 0, 3),
                (1, 0, 3),
                (2, 4, 7),
                (0, 10, 13),
                (0, 3, 6),
                (0, 20, 23)
            ]
        );
        // Under a budget of units the spread ones are the ones kept.
        let three = UnitBudget { units: 3, ..ALL };
        assert_eq!(
            spans(&take_units(places(), three, 0, 10.0)),
            [(0, 0, 3), (1, 0, 3), (2, 4, 7)]
        );
        assert_eq!(
            spans(&take_units(places(), three, 0, 0.0)),
            [(0, 0, 3), (0, 10, 13), (1, 0, 3)]
        );
    }

    #[test]
    fn the_turn_budget_cuts_the_last_window_keeping_its_end() {
        let got = take_units(
            vec![w(0, 0, 3, 0.9), w(1, 4, 7, 0.8), w(2, 0, 3, 0.7)],
            UnitBudget {
                units: 10,
                turns: 5,
            },
            0,
            0.0,
        );
        assert_eq!(spans(&got), [(0, 0, 3), (1, 5, 7)]);
        assert_eq!(got.iter().map(UnitHit::turns).sum::<usize>(), 5);
        let few = take_units(
            vec![w(0, 0, 3, 0.9), w(1, 4, 7, 0.8), w(5, 0, 0, 0.7)],
            UnitBudget {
                units: 2,
                turns: 30,
            },
            0,
            0.0,
        );
        assert_eq!(few.len(), 2, "at most `units` units");
    }

    #[test]
    fn a_row_without_turns_is_one_unit_once() {
        let got = take_units(
            vec![w(3, 0, 0, 0.9), w(3, 0, 0, 0.8), w(4, 0, 2, 0.7)],
            UnitBudget {
                units: 10,
                turns: 10,
            },
            0,
            0.0,
        );
        assert_eq!(got.len(), 2);
        assert_eq!(got.iter().map(UnitHit::turns).sum::<usize>(), 3);
    }
}
