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
//!   else.
//! - **Score**: each candidate window's dense score is `mix · cos(window) +
//!   (1 − mix) · cos(its row)`, its lexical score its BM25 over the query's
//!   ceiling (0–1), fused as rows are: `dense + lexical_weight · lexical`.
//! - **Units under a budget**: windows are taken best first; one that
//!   overlaps or touches a unit already taken from the same row is merged
//!   into it (the unit keeps its best score), else it starts a new unit.
//!   Taking stops at `k` units or `max_turns` turns, whichever comes first;
//!   the last window is cut to the turns left, keeping the turn it ends at.
//!   Several units may come from one session when they earn it.
//!
//! A row with no turns of its own (a memory, a click, a single turn, a
//! session written before windows existed) is one unit of one turn.

use std::collections::{HashMap, HashSet};

use super::{HybridParams, PassageIndex};
use crate::embed::normalize;
use crate::lexical::Bm25Index;
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
}

impl Units {
    /// `spans[w]` is window `w`'s turns in its row (`(0, 0)` for a row that
    /// is its own window); `lexical`, when given, indexes the windows'
    /// texts in the same order.
    pub fn new(spans: Vec<(u32, u32)>, lexical: Option<Bm25Index>) -> Self {
        Self { spans, lexical }
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.spans.capacity() * 8 + self.lexical.as_ref().map_or(0, Bm25Index::bytes)
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
    p: &RfMemParams,
    h: &HybridParams,
    budget: UnitBudget,
    stop: &dyn Fn() -> bool,
) -> Result<UnitAnswer, Error> {
    h.validate()?;
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
    let wide = RfMemParams {
        k: (budget.units.max(1) * h.expand).min(rfmem::MAX_K),
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
    let mut lexical: HashMap<u32, f32> = HashMap::new();
    let mut lexical_only = 0;
    if h.lexical_weight > 0.0
        && let (Some(ix), Some(text)) = (&units.lexical, query_text)
    {
        let mut s = ix.scores(text);
        let max = ix.max_score(text);
        if max > 0.0 {
            s.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let take = if h.lexical_candidates == 0 {
                wide.k
            } else {
                h.lexical_candidates
            };
            for (i, &(w, score)) in s.iter().enumerate() {
                lexical.insert(w, score / max);
                if i < take && seen.insert(w) {
                    candidates.push((w, 0));
                    lexical_only += 1;
                }
            }
        }
    }
    let mut scored: Vec<UnitHit> = candidates
        .into_iter()
        .map(|(w, round)| {
            let row = index.owner[w as usize];
            let cos = dot(&q, index.windows.vector(w as usize));
            let whole = dot(&q, index.rows.vector(row as usize));
            let d = h.mix * cos + (1.0 - h.mix) * whole;
            let lex = lexical.get(&w).copied().unwrap_or(0.0);
            let (start, end) = units.spans.get(w as usize).copied().unwrap_or((0, 0));
            UnitHit {
                row,
                start,
                end,
                window: w,
                score: d + h.lexical_weight * lex,
                dense: d,
                lexical: lex,
                round,
            }
        })
        .filter(|u| u.score >= p.min_score)
        .collect();
    scored.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.window.cmp(&b.window)));
    Ok(UnitAnswer {
        hits: take_units(scored, budget),
        dense,
        lexical_only,
    })
}

/// Merges windows (best first) into units under `budget`.
fn take_units(windows: Vec<UnitHit>, budget: UnitBudget) -> Vec<UnitHit> {
    let mut out: Vec<UnitHit> = Vec::new();
    let mut turns = 0usize;
    for w in windows {
        if turns >= budget.turns {
            break;
        }
        let left = budget.turns - turns;
        if w.end == 0 {
            // A row without turns: once, as one turn.
            if out.iter().any(|u| u.row == w.row) || out.len() >= budget.units {
                continue;
            }
            turns += 1;
            out.push(w);
            continue;
        }
        let touching = out
            .iter_mut()
            .find(|u| u.row == w.row && u.end > 0 && w.start <= u.end && u.start <= w.end);
        match touching {
            Some(u) => {
                // Turns this window adds on either side of the unit.
                let before = u.start.saturating_sub(w.start) as usize;
                let after = w.end.saturating_sub(u.end) as usize;
                if before + after == 0 {
                    continue;
                }
                // Past the budget, the side nearer the window's end (the turn
                // it was formed for) is kept first.
                let after_kept = after.min(left);
                let before_kept = before.min(left - after_kept);
                u.end += after_kept as u32;
                u.start -= before_kept as u32;
                turns += after_kept + before_kept;
            }
            None => {
                if out.len() >= budget.units {
                    continue;
                }
                let n = (w.end - w.start) as usize;
                let kept = n.min(left) as u32;
                turns += kept as usize;
                out.push(UnitHit {
                    start: w.end - kept,
                    ..w
                });
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(row: u32, start: u32, end: u32, score: f32) -> UnitHit {
        UnitHit {
            row,
            start,
            end,
            window: 0,
            score,
            dense: score,
            lexical: 0.0,
            round: 0,
        }
    }

    #[test]
    fn overlapping_windows_of_a_row_merge_and_others_stay_apart() {
        let got = take_units(
            vec![
                w(0, 4, 7, 0.9),
                w(1, 0, 3, 0.8),
                w(0, 5, 8, 0.7),
                w(0, 20, 23, 0.6),
                w(0, 1, 4, 0.5),
            ],
            UnitBudget {
                units: 10,
                turns: 100,
            },
        );
        let spans: Vec<(u32, u32, u32)> = got.iter().map(|u| (u.row, u.start, u.end)).collect();
        // 5..8 merges into 4..7 (overlap), 1..4 touches it (adjacent).
        assert_eq!(spans, [(0, 1, 8), (1, 0, 3), (0, 20, 23)]);
        assert_eq!(got[0].score, 0.9, "a unit keeps its best score");
    }

    #[test]
    fn the_turn_budget_cuts_the_last_window_keeping_its_end() {
        let got = take_units(
            vec![w(0, 0, 3, 0.9), w(1, 4, 7, 0.8), w(2, 0, 3, 0.7)],
            UnitBudget {
                units: 10,
                turns: 5,
            },
        );
        let spans: Vec<(u32, u32, u32)> = got.iter().map(|u| (u.row, u.start, u.end)).collect();
        assert_eq!(spans, [(0, 0, 3), (1, 5, 7)]);
        assert_eq!(got.iter().map(UnitHit::turns).sum::<usize>(), 5);
        let few = take_units(
            vec![w(0, 0, 3, 0.9), w(1, 4, 7, 0.8), w(5, 0, 0, 0.7)],
            UnitBudget {
                units: 2,
                turns: 30,
            },
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
        );
        assert_eq!(got.len(), 2);
        assert_eq!(got.iter().map(UnitHit::turns).sum::<usize>(), 3);
    }
}
