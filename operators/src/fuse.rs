//! Fusing several rankers into one: a weighted sum of their scores, each
//! standardised over one query's candidates, with the weights fitted on a
//! validation split.
//!
//! Scores of different rankers live on different scales (a cosine, a sum
//! of co-occurrence cosines, BM25, a count), so each ranker's scores for the
//! candidates of one query are turned into z-scores first; a ranker that
//! scores every candidate alike contributes nothing to that query.
//!
//! The weights are found by exhaustive search over a grid on the simplex
//! (non-negative, summing to 1, in steps of `1 / steps`), maximising the mean
//! NDCG@10 of each query's one relevant candidate. No optimiser: with a
//! handful of rankers the grid is small (4 rankers, steps 10: 286 points), the
//! objective is a step function that gradients cannot follow, and the search
//! is deterministic. Ties in the objective keep the first point in grid order,
//! which puts the weight on the earlier rankers.
//!
//! The same search fits a yes/no decision ([`fit_decision`]): the weights
//! and a threshold on the fused score that give the best micro F1 over
//! labelled slates (the user simulation, where an agent answers yes or no
//! to each of the items it is shown). [`fit_pooled_decision`] fits the same
//! decision on scores standardised once over every calibration item instead
//! of over each slate, so that an item's answer does not depend on the
//! items shown beside it.

/// One query of a validation split: per candidate the score of every
/// ranker (`scores[candidate][ranker]`), and which candidate is relevant.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    /// `scores[candidate][ranker]`.
    pub scores: Vec<Vec<f64>>,
    /// The relevant candidate.
    pub target: usize,
}

/// `xs` as z-scores (mean 0, standard deviation 1); all zeros when every
/// value is the same.
pub fn standardise(xs: &[f64]) -> Vec<f64> {
    let (mean, sd) = mean_sd(xs);
    xs.iter().map(|&x| z(x, mean, sd)).collect()
}

/// The mean and (population) standard deviation of `xs`.
fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let sd = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    (mean, sd)
}

/// `x` as a z-score under `mean` and `sd`; 0 when there is no spread.
fn z(x: f64, mean: f64, sd: f64) -> f64 {
    if sd < 1e-12 { 0.0 } else { (x - mean) / sd }
}

/// The fused score of each candidate: `Σ_r weights[r] · z_r(candidate)`,
/// with `z_r` ranker `r`'s standardised scores over the candidates.
///
/// # Panics
/// If a candidate has fewer scores than there are weights.
pub fn fuse(weights: &[f64], scores: &[Vec<f64>]) -> Vec<f64> {
    let mut out = vec![0.0; scores.len()];
    for (r, &w) in weights.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let column: Vec<f64> = scores.iter().map(|s| s[r]).collect();
        for (o, z) in out.iter_mut().zip(standardise(&column)) {
            *o += w * z;
        }
    }
    out
}

/// NDCG@10 of the relevant candidate under `scores`: its rank counts the
/// candidates scored higher, and half of those scored the same (ties are
/// neither won nor lost).
pub fn ndcg10(scores: &[f64], target: usize) -> f64 {
    let t = scores[target];
    let above = scores.iter().filter(|&&s| s > t).count() as f64;
    let tied = scores.iter().filter(|&&s| s == t).count() as f64 - 1.0;
    let rank = above + tied / 2.0;
    if rank >= 10.0 {
        0.0
    } else {
        1.0 / (rank + 2.0).log2()
    }
}

/// The fitted weights and their mean NDCG@10 on `queries`.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// One weight per ranker, non-negative, summing to 1.
    pub weights: Vec<f64>,
    /// Mean NDCG@10 over the queries with them.
    pub ndcg10: f64,
    /// Grid points tried.
    pub tried: usize,
}

/// Searches the simplex grid of `rankers` weights in steps of `1 / steps`
/// (module docs).
///
/// # Panics
/// If `rankers` is 0.
pub fn fit(queries: &[Query], rankers: usize, steps: usize) -> Fit {
    let groups: Vec<&[Vec<f64>]> = queries.iter().map(|q| q.scores.as_slice()).collect();
    let best = search(&groups, rankers, steps, |fused| {
        let mean = queries
            .iter()
            .zip(fused)
            .map(|(q, f)| ndcg10(f, q.target))
            .sum::<f64>()
            / queries.len().max(1) as f64;
        (mean, ())
    });
    Fit {
        weights: best.weights,
        ndcg10: best.score,
        tried: best.tried,
    }
}

/// The best point of [`search`]: its weights, its objective, what the
/// objective returned beside it, and the points tried.
struct Best<T> {
    weights: Vec<f64>,
    score: f64,
    extra: Option<T>,
    tried: usize,
}

/// The grid search both fits run: every point of the simplex grid of
/// `rankers` weights in steps of `1 / steps`, each group's [`fuse`]d scores
/// under it handed to `objective`; the first point (in grid order) with the
/// highest objective wins.
///
/// # Panics
/// If `rankers` is 0.
fn search<T>(
    groups: &[&[Vec<f64>]],
    rankers: usize,
    steps: usize,
    mut objective: impl FnMut(&[Vec<f64>]) -> (f64, T),
) -> Best<T> {
    assert!(rankers > 0, "nothing to fuse");
    let steps = steps.max(1);
    // The standardised columns once per group.
    let z: Vec<Vec<Vec<f64>>> = groups
        .iter()
        .map(|g| {
            (0..rankers)
                .map(|r| standardise(&g.iter().map(|s| s[r]).collect::<Vec<_>>()))
                .collect()
        })
        .collect();
    let mut best = Best {
        weights: Vec::new(),
        score: f64::NEG_INFINITY,
        extra: None,
        tried: 0,
    };
    let mut point = vec![0usize; rankers];
    compositions(steps, 0, &mut point, &mut |p| {
        let w: Vec<f64> = p.iter().map(|&k| k as f64 / steps as f64).collect();
        let fused: Vec<Vec<f64>> = groups
            .iter()
            .zip(&z)
            .map(|(g, zg)| {
                (0..g.len())
                    .map(|c| w.iter().zip(zg).map(|(wr, zr)| wr * zr[c]).sum())
                    .collect()
            })
            .collect();
        let (score, extra) = objective(&fused);
        best.tried += 1;
        if score > best.score {
            best.score = score;
            best.extra = Some(extra);
            best.weights = w;
        }
    });
    best
}

/// One slate of a yes/no task (the STEAM paper's user simulation): per
/// item the score of every ranker, and whether the item is the user's.
#[derive(Debug, Clone, PartialEq)]
pub struct Slate {
    /// `scores[item][ranker]`.
    pub scores: Vec<Vec<f64>>,
    /// Per item: one of the user's (a yes is right).
    pub positive: Vec<bool>,
}

/// The fitted weights and threshold of a yes/no decision: say yes to an
/// item when its [`fuse`]d score over its slate reaches `threshold`.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// One weight per ranker, non-negative, summing to 1.
    pub weights: Vec<f64>,
    /// The fused score from which the answer is yes.
    pub threshold: f64,
    /// Micro F1 over every item of the slates with them.
    pub f1: f64,
    /// Grid points tried.
    pub tried: usize,
}

/// The threshold (yes when score ≥ it) with the best micro F1 over the
/// labelled scores, and that F1. Cuts only between different scores, so
/// equal scores get one answer; ties in F1 go to the higher threshold.
/// With no positives every threshold scores 0 and the answer is "never".
pub fn best_threshold(mut scored: Vec<(f64, bool)>) -> (f64, f64) {
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let positives = scored.iter().filter(|s| s.1).count();
    let (mut best, mut threshold, mut tp) = (0.0, f64::INFINITY, 0usize);
    for (i, &(score, positive)) in scored.iter().enumerate() {
        tp += usize::from(positive);
        if scored.get(i + 1).is_some_and(|next| next.0 == score) {
            continue;
        }
        // Saying yes to the first i + 1: F1 = 2 TP / (yes + positives).
        let f1 = 2.0 * tp as f64 / (i + 1 + positives) as f64;
        if f1 > best {
            (best, threshold) = (f1, score);
        }
    }
    (threshold, best)
}

/// Searches the simplex grid of `rankers` weights in steps of `1 / steps`
/// for the weights whose [`fuse`]d scores, with their [`best_threshold`],
/// give the best micro F1 over every item of `slates`. Ties keep the first
/// point in grid order, as [`fit`] does.
///
/// # Panics
/// If `rankers` is 0.
pub fn fit_decision(slates: &[Slate], rankers: usize, steps: usize) -> Decision {
    let groups: Vec<&[Vec<f64>]> = slates.iter().map(|s| s.scores.as_slice()).collect();
    let best = search(&groups, rankers, steps, |fused| {
        let scored: Vec<(f64, bool)> = fused
            .iter()
            .zip(slates)
            .flat_map(|(f, s)| f.iter().copied().zip(s.positive.iter().copied()))
            .collect();
        let (threshold, f1) = best_threshold(scored);
        (f1, threshold)
    });
    Decision {
        weights: best.weights,
        threshold: best.extra.unwrap_or(f64::INFINITY),
        f1: best.score,
        tried: best.tried,
    }
}

/// A yes/no decision on scores standardised over a fixed population, the
/// calibration items, instead of over each slate.
///
/// Standardising over a slate makes the answers depend on the slate: a
/// threshold on slate z-scores says yes to about the same share of every
/// slate, whatever share of it is the user's. An agent that is not told the
/// ratio of positives (the user simulation) should answer each item on its
/// own; here each ranker's scores are put on one scale by the mean and
/// standard deviation of its scores over every calibration item, and the
/// weights and threshold are fitted on that scale.
#[derive(Debug, Clone, PartialEq)]
pub struct PooledDecision {
    /// The weights and the threshold on the pooled scale.
    pub decision: Decision,
    /// Per ranker: the mean of its scores over the calibration items.
    pub mean: Vec<f64>,
    /// Per ranker: their (population) standard deviation.
    pub sd: Vec<f64>,
}

impl PooledDecision {
    /// The fused score of one item (`scores[ranker]`) on the pooled scale.
    ///
    /// # Panics
    /// If the item has fewer scores than there are weights.
    pub fn score(&self, scores: &[f64]) -> f64 {
        let mut out = 0.0;
        for (r, &w) in self.decision.weights.iter().enumerate() {
            out += w * z(scores[r], self.mean[r], self.sd[r]);
        }
        out
    }

    /// Whether the agent says yes to one item (`scores[ranker]`).
    pub fn says_yes(&self, scores: &[f64]) -> bool {
        self.score(scores) >= self.decision.threshold
    }
}

/// [`fit_decision`] on every item of `slates` taken as one population: each
/// ranker standardised by its mean and spread over all of them, then the
/// weights and threshold with the best micro F1 (see [`PooledDecision`]).
///
/// # Panics
/// If `rankers` is 0.
pub fn fit_pooled_decision(slates: &[Slate], rankers: usize, steps: usize) -> PooledDecision {
    let pool = Slate {
        scores: slates.iter().flat_map(|s| s.scores.clone()).collect(),
        positive: slates.iter().flat_map(|s| s.positive.clone()).collect(),
    };
    let (mean, sd) = (0..rankers)
        .map(|r| mean_sd(&pool.scores.iter().map(|x| x[r]).collect::<Vec<_>>()))
        .unzip();
    PooledDecision {
        decision: fit_decision(std::slice::from_ref(&pool), rankers, steps),
        mean,
        sd,
    }
}

/// Calls `f` with every way of writing `left` as `point.len() - at`
/// non-negative parts (in lexicographic order, the first part largest first).
fn compositions(left: usize, at: usize, point: &mut Vec<usize>, f: &mut impl FnMut(&[usize])) {
    if at + 1 == point.len() {
        point[at] = left;
        f(point);
        return;
    }
    for k in (0..=left).rev() {
        point[at] = k;
        compositions(left - k, at + 1, point, f);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standardised_scores_have_mean_zero_and_unit_spread() {
        let z = standardise(&[1.0, 2.0, 3.0, 6.0]);
        assert!(z.iter().sum::<f64>().abs() < 1e-12);
        let var = z.iter().map(|x| x * x).sum::<f64>() / 4.0;
        assert!((var - 1.0).abs() < 1e-12);
        assert_eq!(standardise(&[5.0, 5.0]), [0.0, 0.0]);
    }

    #[test]
    fn ties_are_half_won() {
        assert_eq!(ndcg10(&[3.0, 1.0, 2.0], 0), 1.0);
        // Second of three.
        assert!((ndcg10(&[1.0, 3.0, 2.0], 2) - 1.0 / 3f64.log2()).abs() < 1e-12);
        // Tied with one other: rank 0.5.
        assert!((ndcg10(&[2.0, 2.0, 1.0], 0) - 1.0 / 2.5f64.log2()).abs() < 1e-12);
        let eleven: Vec<f64> = (0..11).map(f64::from).collect();
        assert_eq!(ndcg10(&eleven, 0), 0.0, "below the cutoff");
    }

    #[test]
    fn the_grid_covers_the_simplex_once() {
        let mut seen = Vec::new();
        compositions(3, 0, &mut vec![0; 3], &mut |p| seen.push(p.to_vec()));
        // C(3 + 2, 2) = 10 points, each summing to 3, none twice.
        assert_eq!(seen.len(), 10);
        assert!(seen.iter().all(|p| p.iter().sum::<usize>() == 3));
        let mut dedup = seen.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), 10);
        assert_eq!(seen[0], [3, 0, 0], "the first ranker's corner first");
    }

    #[test]
    fn the_fit_finds_the_ranker_that_knows_and_ignores_the_noise() {
        // Ranker 0 puts the target first; ranker 1 puts it last; ranker 2 is
        // constant. The fit must put its weight on ranker 0.
        let queries: Vec<Query> = (0..20)
            .map(|i| {
                let target = i % 5;
                let scores = (0..5)
                    .map(|c| {
                        let hit = if c == target { 1.0 } else { 0.0 };
                        vec![hit + 0.01 * c as f64, -hit, 7.0]
                    })
                    .collect();
                Query { scores, target }
            })
            .collect();
        let f = fit(&queries, 3, 10);
        assert_eq!(f.tried, 66);
        assert_eq!(f.ndcg10, 1.0);
        assert_eq!(f.weights[0], 1.0, "{:?}", f.weights);
        let fused = fuse(&f.weights, &queries[3].scores);
        assert_eq!(ndcg10(&fused, queries[3].target), 1.0);
    }

    #[test]
    fn the_threshold_maximises_f1_and_never_splits_ties() {
        // Scores 0.9 (yes), 0.8 (yes), 0.7 (no), 0.6 (yes), 0.1 (no):
        // cut at 0.8 → F1 = 4/5 = 0.8; at 0.6 → 6/7 ≈ 0.857 (best).
        let s = vec![
            (0.9, true),
            (0.7, false),
            (0.1, false),
            (0.8, true),
            (0.6, true),
        ];
        let (t, f1) = best_threshold(s);
        assert_eq!(t, 0.6);
        assert!((f1 - 6.0 / 7.0).abs() < 1e-12);
        // Two equal scores, one of each: both get the same answer.
        assert_eq!(
            best_threshold(vec![(0.5, true), (0.5, false), (0.2, false)]).0,
            0.5
        );
        // No positives: never say yes.
        assert_eq!(best_threshold(vec![(0.5, false)]), (f64::INFINITY, 0.0));
    }

    #[test]
    fn the_decision_fit_weights_the_ranker_that_separates_the_users_items() {
        // Ranker 0 scores the user's items 1 above the rest, ranker 1 is
        // noise that disagrees, ranker 2 is constant: all weight on ranker 0,
        // and its threshold says yes to exactly the user's items.
        let slates: Vec<Slate> = (0..10)
            .map(|i| {
                let positive: Vec<bool> = (0..20).map(|k| (k + i) % 4 == 0).collect();
                let scores = positive
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| {
                        let hit = f64::from(u8::from(p));
                        vec![hit + 0.001 * k as f64, ((k * 7 + i) % 5) as f64 - hit, 3.0]
                    })
                    .collect();
                Slate { scores, positive }
            })
            .collect();
        let d = fit_decision(&slates, 3, 10);
        assert_eq!(d.tried, 66);
        assert_eq!(d.f1, 1.0);
        assert_eq!(d.weights[0], 1.0, "{d:?}");
        for s in &slates {
            let fused = fuse(&d.weights, &s.scores);
            let yes: Vec<bool> = fused.iter().map(|&x| x >= d.threshold).collect();
            assert_eq!(yes, s.positive);
        }
    }

    #[test]
    fn a_pooled_decision_answers_each_item_whatever_is_shown_beside_it() {
        // Calibration at 1:1: ranker 0 scores the user's items about 1 above
        // the rest, ranker 1 is noise.
        let item =
            |p: bool, k: usize| vec![f64::from(u8::from(p)) + 0.01 * k as f64, (k % 3) as f64];
        let calibration: Vec<Slate> = (0..10)
            .map(|i| {
                let positive: Vec<bool> = (0..20).map(|k| (k + i) % 2 == 0).collect();
                let scores = positive
                    .iter()
                    .enumerate()
                    .map(|(k, &p)| item(p, k))
                    .collect();
                Slate { scores, positive }
            })
            .collect();
        let d = fit_pooled_decision(&calibration, 2, 10);
        assert_eq!(d.decision.f1, 1.0, "{d:?}");
        // The fitted F1 is the F1 of `says_yes` on the calibration items.
        let right = calibration
            .iter()
            .flat_map(|s| s.scores.iter().zip(&s.positive))
            .all(|(x, &p)| d.says_yes(x) == p);
        assert!(right);
        // At 1:9 every item still gets the same answer: two of the user's
        // items among eighteen others.
        let positive: Vec<bool> = (0..20).map(|k| k < 2).collect();
        let scores: Vec<Vec<f64>> = positive
            .iter()
            .enumerate()
            .map(|(k, &p)| item(p, k))
            .collect();
        let yes: Vec<bool> = scores.iter().map(|x| d.says_yes(x)).collect();
        assert_eq!(yes, positive);
        // Slate z-scores of the same 1:9 slate move every item's score: the
        // user's items end far above the calibration threshold, the others
        // below 0 although their raw scores did not change.
        let slate = fuse(&[1.0, 0.0], &scores);
        assert!(slate[0] > 2.5 && slate[5] < 0.0, "{slate:?}");
    }

    #[test]
    fn two_rankers_that_each_know_half_are_combined() {
        // Ranker 0 finds the target in even queries, ranker 1 in odd ones,
        // each otherwise scoring it a little below the best: only a mix of
        // both ranks every target first or second.
        let queries: Vec<Query> = (0..10)
            .map(|i| {
                let target = 0;
                let strong = |yes: bool| if yes { 3.0 } else { 1.9 };
                let scores = vec![
                    vec![strong(i % 2 == 0), strong(i % 2 == 1)],
                    vec![2.0, 2.0],
                    vec![0.0, 0.0],
                    vec![1.0, 1.0],
                ];
                Query { scores, target }
            })
            .collect();
        let alone = fit(&queries, 1, 10).ndcg10;
        let both = fit(&queries, 2, 10);
        assert!(both.ndcg10 > alone, "{both:?} vs {alone}");
        assert!(both.weights.iter().all(|&w| w > 0.0), "{both:?}");
    }
}
