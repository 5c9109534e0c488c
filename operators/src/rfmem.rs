//! RF-Mem retrieval (Recollection–Familiarity, arXiv 2603.09250) over one
//! user's memory corpus.
//!
//! 1. **Probe**: the top-`probe_k` rows by cosine. Their mean score and the
//!    entropy of `p = softmax(λ · scores)` (scores sorted, best first) measure
//!    familiarity.
//! 2. **Gate** (the official code's order): familiarity if mean ≥ θ_high;
//!    recollection if mean ≤ θ_low; otherwise familiarity if entropy < τ,
//!    else recollection. The official code's entropy is `−mean(p·ln p)` over
//!    the K probe scores ([`EntropyMode::Mean`], the default); the paper writes
//!    `H(p) = −Σ p·ln p` ([`EntropyMode::Sum`]). With K = 10 the mean form is
//!    at most ln(10)/10 ≈ 0.23, so τ must be chosen per form.
//! 3. **Familiarity**: the top-k with `score ≥ min_score`.
//! 4. **Recollection**: a beam search in embedding space. Each round, every
//!    branch searches its top `(B + round) · F` rows not yet emitted, scores
//!    them by MMR (`λ_mmr · score − (1 − λ_mmr) · max cosine to the other
//!    candidates`), clusters them with k-means into `min(B, n)` groups
//!    (deterministic seeding, [`steamrf_kernels::ivf::kmeans`]), and spawns one
//!    child per group whose query is
//!    `normalize(α · q_branch + (1 − α) · centroid + q0)` (the `+ q0` anchor
//!    is the official code's, [`RfMemParams::anchor`]). The `B` children with
//!    the highest accumulated MMR score form the next beam, and their groups'
//!    rows are emitted in that order. It stops after `depth` rounds, once `k`
//!    rows are emitted, or when the candidate budget is spent. Results keep
//!    the discovery order (official) or are re-sorted by score
//!    ([`Order`]). Every reported score is the cosine with the original query.
//!
//! The store is exact (a flat scan on the CPU kernel) or approximate (an
//! in-memory IVF, for users with very many rows); see [`VectorStore`].

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::{Ivf, IvfParams, kmeans};
use steamrf_kernels::quant::QuantKernel;
use steamrf_kernels::{Corpus, Hit, SearchParams, SimilarityKernel};

use crate::embed::normalize;
use crate::steam::memory::dot;

/// Errors of a retrieval.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The query or a parameter is unusable; the message names it.
    #[error("{field}: {reason}")]
    Invalid {
        /// The offending field (`query_vector`, `options.alpha`, …).
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The kernel failed.
    #[error(transparent)]
    Kernel(#[from] steamrf_kernels::Error),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::Invalid {
        field,
        reason: reason.into(),
    }
}

/// Which path answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The gate decides (RF-Mem).
    #[default]
    Adaptive,
    /// Always top-k.
    Familiarity,
    /// Always recollection.
    Recollection,
}

/// How the probe's entropy is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EntropyMode {
    /// `−mean(p·ln p)`, as the official code computes it.
    #[default]
    Mean,
    /// `−Σ p·ln p`, as the paper writes it.
    Sum,
}

/// The order of recollection results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Order {
    /// As discovered, round by round (the official code).
    #[default]
    Discovery,
    /// By cosine with the query, best first.
    Score,
}

/// RF-Mem parameters. The defaults are the official code's PersonaBench
/// settings (λ = 30, θ_high = 0.5, θ_low = 0.2, τ = 0.25, K = 10, B = 4,
/// F = 1, depth 10, λ_mmr = 0.9) with α = 0.5.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RfMemParams {
    /// Which path answers.
    pub mode: Mode,
    /// Rows in the familiarity probe (K).
    pub probe_k: usize,
    /// λ: softmax temperature of the probe's entropy.
    pub lambda: f32,
    /// θ_high: familiarity when the probe's mean score reaches it.
    pub theta_high: f32,
    /// θ_low: recollection when the probe's mean score is at most this.
    pub theta_low: f32,
    /// τ: between the thresholds, familiarity when the entropy is below it.
    pub tau: f32,
    /// The entropy's form.
    pub entropy: EntropyMode,
    /// Rows returned.
    pub k: usize,
    /// Least score of a returned row.
    pub min_score: f32,
    /// B: beam width (and clusters per branch).
    pub beam: usize,
    /// F: fanout (rows searched per branch: (B + round) · F).
    pub fanout: usize,
    /// Recollection rounds at most.
    pub depth: usize,
    /// α: weight of the branch query against the cluster centroid.
    pub alpha: f32,
    /// Adds the original query to every mixed query (the official code does).
    pub anchor: bool,
    /// λ_mmr: relevance against novelty in the MMR score.
    pub mmr_lambda: f32,
    /// Rows searched in total by one recollection at most.
    pub max_candidates: usize,
    /// Lloyd iterations per clustering.
    pub kmeans_iters: usize,
    /// Order of recollection results.
    pub order: Order,
    /// When recollection finds fewer than `k` rows, tops them up with the
    /// best unseen rows by plain top-k. The official code does not (it
    /// returns the short list); steamrf does by default.
    pub fill: bool,
}

impl Default for RfMemParams {
    fn default() -> Self {
        Self {
            mode: Mode::Adaptive,
            probe_k: 10,
            lambda: 30.0,
            theta_high: 0.5,
            theta_low: 0.2,
            tau: 0.25,
            entropy: EntropyMode::Mean,
            k: 10,
            min_score: 0.0,
            beam: 4,
            fanout: 1,
            depth: 10,
            alpha: 0.5,
            anchor: true,
            mmr_lambda: 0.9,
            max_candidates: 4096,
            kmeans_iters: 50,
            order: Order::Discovery,
            fill: true,
        }
    }
}

/// Largest `k`, `probe_k` or candidate budget accepted.
pub const MAX_K: usize = 10_000;

impl RfMemParams {
    /// Checks every parameter; the error names the first bad one as
    /// `options.<name>`.
    ///
    /// # Errors
    /// [`Error::Invalid`].
    pub fn validate(&self) -> Result<(), Error> {
        let finite = |field: &'static str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(invalid(field, "must be a finite number"))
            }
        };
        let unit = |field: &'static str, v: f32| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(invalid(field, format!("must be in [0, 1], got {v}")))
            }
        };
        let count = |field: &'static str, v: usize, min: usize| {
            if (min..=MAX_K).contains(&v) {
                Ok(())
            } else {
                Err(invalid(
                    field,
                    format!("must be in [{min}, {MAX_K}], got {v}"),
                ))
            }
        };
        count("options.k", self.k, 1)?;
        count("options.probe_k", self.probe_k, 1)?;
        count("options.beam", self.beam, 1)?;
        count("options.fanout", self.fanout, 1)?;
        count("options.depth", self.depth, 1)?;
        count("options.max_candidates", self.max_candidates, 1)?;
        if self.kmeans_iters > 1000 {
            return Err(invalid("options.kmeans_iters", "must be at most 1000"));
        }
        finite("options.lambda", self.lambda)?;
        finite("options.theta_high", self.theta_high)?;
        finite("options.theta_low", self.theta_low)?;
        finite("options.tau", self.tau)?;
        finite("options.min_score", self.min_score)?;
        unit("options.alpha", self.alpha)?;
        unit("options.mmr_lambda", self.mmr_lambda)?;
        if self.theta_low > self.theta_high {
            return Err(invalid(
                "options.theta_low",
                format!(
                    "must not exceed theta_high ({} > {})",
                    self.theta_low, self.theta_high
                ),
            ));
        }
        Ok(())
    }
}

/// Which path answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Direct top-k.
    Familiarity,
    /// Iterative recollection.
    Recollection,
}

impl Path {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Familiarity => "familiarity",
            Self::Recollection => "recollection",
        }
    }
}

/// Why the gate chose its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// mean ≥ θ_high.
    MeanHigh,
    /// mean ≤ θ_low.
    MeanLow,
    /// entropy < τ.
    LowEntropy,
    /// entropy ≥ τ.
    HighEntropy,
    /// The probe found nothing.
    NoHits,
    /// The mode fixed the path.
    Forced,
}

impl Rule {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MeanHigh => "mean_high",
            Self::MeanLow => "mean_low",
            Self::LowEntropy => "low_entropy",
            Self::HighEntropy => "high_entropy",
            Self::NoHits => "no_hits",
            Self::Forced => "forced",
        }
    }
}

/// The probe's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Probe {
    /// Rows probed.
    pub k: usize,
    /// Their mean score.
    pub mean: f32,
    /// The entropy of softmax(λ · scores), in the configured form.
    pub entropy: f32,
}

/// The gate: the path for a probe's `scores` (any order).
pub fn gate(scores: &[f32], p: &RfMemParams) -> (Path, Rule, Probe) {
    if scores.is_empty() {
        let probe = Probe {
            k: 0,
            mean: 0.0,
            entropy: 0.0,
        };
        return (Path::Recollection, Rule::NoHits, probe);
    }
    let mut s: Vec<f32> = scores.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    let mean = s.iter().sum::<f32>() / s.len() as f32;
    let max = s[0] * p.lambda;
    let exps: Vec<f32> = s.iter().map(|x| (x * p.lambda - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    let plogp: f32 = exps
        .iter()
        .map(|e| {
            let q = e / total;
            if q > 0.0 { q * q.ln() } else { 0.0 }
        })
        .sum();
    let entropy = match p.entropy {
        EntropyMode::Mean => -plogp / s.len() as f32,
        EntropyMode::Sum => -plogp,
    };
    let probe = Probe {
        k: s.len(),
        mean,
        entropy,
    };
    let (path, rule) = if mean >= p.theta_high {
        (Path::Familiarity, Rule::MeanHigh)
    } else if mean <= p.theta_low {
        (Path::Recollection, Rule::MeanLow)
    } else if entropy < p.tau {
        (Path::Familiarity, Rule::LowEntropy)
    } else {
        (Path::Recollection, Rule::HighEntropy)
    };
    (path, rule, probe)
}

/// One user's searchable rows: exact (flat, scored in f32 or in int8 with
/// exact f32 rescoring) or approximate (IVF).
pub struct VectorStore {
    corpus: Corpus,
    ivf: Option<Ivf>,
    scan: Scan,
}

/// How an exact store scores its rows.
enum Scan {
    F32(CpuKernel),
    /// int8 codes (a quarter of the f32 bytes, kept beside them), the best
    /// `k · rescore` candidates rescored exactly in f32.
    Int8(QuantKernel),
}

impl Scan {
    fn kernel(&self) -> &dyn SimilarityKernel {
        match self {
            Self::F32(k) => k,
            Self::Int8(k) => k,
        }
    }
}

impl fmt::Debug for VectorStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VectorStore")
            .field("rows", &self.corpus.len())
            .field("ivf_lists", &self.ivf.as_ref().map(Ivf::lists))
            .field("int8", &self.is_int8())
            .finish()
    }
}

impl VectorStore {
    /// An exact store, scanned with `kernel`.
    pub fn flat(corpus: Corpus, kernel: CpuKernel) -> Self {
        Self {
            corpus,
            ivf: None,
            scan: Scan::F32(kernel),
        }
    }

    /// An exact store scored in int8 by `kernel`, whose best candidates are
    /// rescored exactly in f32 (so scores are exact, and a row is missed
    /// only when the int8 error pushes it out of the candidates). The int8
    /// copy is built here, so [`Self::extra_bytes`] counts it from the
    /// start.
    pub fn flat_int8(corpus: Corpus, kernel: QuantKernel) -> Self {
        kernel.prepare(&corpus);
        Self {
            corpus,
            ivf: None,
            scan: Scan::Int8(kernel),
        }
    }

    /// Bytes held beside the f32 rows (the int8 copy of an int8 store).
    pub fn extra_bytes(&self) -> usize {
        match &self.scan {
            Scan::Int8(k) => k.shadow_bytes(),
            Scan::F32(_) => 0,
        }
    }

    /// Whether an exact scan scores in int8 first.
    pub fn is_int8(&self) -> bool {
        matches!(self.scan, Scan::Int8(_))
    }

    /// An approximate store: an IVF index is built over `corpus` (on
    /// `kernel`'s threads) and searched instead of the flat scan.
    ///
    /// # Errors
    /// Kernel errors.
    pub fn ivf(corpus: Corpus, p: &IvfParams, kernel: CpuKernel) -> Result<Self, Error> {
        let ivf = Ivf::build(&corpus, p, &kernel)?;
        Ok(Self {
            corpus,
            ivf: Some(ivf),
            scan: Scan::F32(kernel),
        })
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.corpus.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.corpus.is_empty()
    }

    /// Dimension.
    pub fn dim(&self) -> usize {
        self.corpus.dim()
    }

    /// Whether searches are approximate.
    pub fn is_approximate(&self) -> bool {
        self.ivf.is_some()
    }

    /// Row `i` (unit length).
    pub fn vector(&self, i: usize) -> std::borrow::Cow<'_, [f32]> {
        self.corpus.row(i)
    }

    /// The top-`k` rows with score ≥ `min_score` of each query (row-major).
    ///
    /// # Errors
    /// Kernel errors (ragged or non-finite queries).
    pub fn search(
        &self,
        queries: &[f32],
        k: usize,
        min_score: f32,
    ) -> Result<Vec<Vec<Hit>>, Error> {
        Ok(match &self.ivf {
            Some(ivf) => ivf.search(queries, k, min_score)?,
            None => {
                let p = SearchParams {
                    k,
                    min_score,
                    exclude: None,
                };
                self.scan.kernel().top_k(queries, &self.corpus, &p)?
            }
        })
    }
}

/// One returned row.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Found {
    /// Row in the store.
    pub index: u32,
    /// Cosine with the query.
    pub score: f32,
    /// The recollection round that found it (0 for familiarity).
    pub round: u32,
}

/// What a retrieval did and found.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// The rows, in the path's order.
    pub hits: Vec<Found>,
    /// The path that answered.
    pub path: Path,
    /// Why.
    pub rule: Rule,
    /// The probe's statistics.
    pub probe: Probe,
    /// Recollection rounds run (0 for familiarity).
    pub rounds: u32,
    /// Rows searched in total (probe included).
    pub candidates: usize,
    /// How many of the last hits are the top-up of a short recollection
    /// ([`RfMemParams::fill`]).
    pub filled: usize,
    /// Time in the probe and the gate.
    pub probe_time: Duration,
    /// Time in the chosen path.
    pub path_time: Duration,
    /// Recollection stopped early because the caller's stop check said so
    /// (a deadline or a client gone): the rows are those found so far,
    /// topped up from the probe.
    pub truncated: bool,
}

/// Checks a query vector: the store's dimension, finite, not all zero.
///
/// # Errors
/// [`Error::Invalid`] naming `query_vector`.
pub fn check_query(query: &[f32], dim: usize) -> Result<(), Error> {
    steamrf_schemas::api::check_query_vector(query, dim).map_err(|e| Error::Invalid {
        field: "query_vector",
        reason: e.message,
    })
}

/// RF-Mem retrieval of `query` (any length > 0; normalised here) over `store`.
///
/// # Errors
/// [`Error::Invalid`] for a bad query or parameters; kernel errors.
pub fn retrieve(store: &VectorStore, query: &[f32], p: &RfMemParams) -> Result<Answer, Error> {
    retrieve_until(store, query, p, &|| false)
}

/// [`retrieve`], asking `stop` before each recollection round after the
/// first and before each branch's clustering. Once it says yes, recollection
/// ends with the rows found so far, topped up from the probe's rows only (no
/// further search), and [`Answer::truncated`] is set. The probe,
/// familiarity's one search and recollection's first round always run:
/// each is one bounded top-k.
///
/// # Errors
/// As [`retrieve`].
pub fn retrieve_until(
    store: &VectorStore,
    query: &[f32],
    p: &RfMemParams,
    stop: &dyn Fn() -> bool,
) -> Result<Answer, Error> {
    p.validate()?;
    check_query(query, store.dim())?;
    let mut q0 = query.to_vec();
    normalize(&mut q0);
    let started = Instant::now();
    let probe_k = match p.mode {
        Mode::Adaptive => p.probe_k,
        _ => 0,
    };
    let probe_hits = if probe_k > 0 {
        store.search(&q0, probe_k, f32::NEG_INFINITY)?.remove(0)
    } else {
        Vec::new()
    };
    let (path, rule, probe) = match p.mode {
        Mode::Adaptive => {
            let scores: Vec<f32> = probe_hits.iter().map(|h| h.score).collect();
            gate(&scores, p)
        }
        Mode::Familiarity => (Path::Familiarity, Rule::Forced, gate(&[], p).2),
        Mode::Recollection => (Path::Recollection, Rule::Forced, gate(&[], p).2),
    };
    let probe_time = started.elapsed();
    let started = Instant::now();
    let mut candidates = probe_hits.len();
    let (hits, rounds, truncated) = match path {
        Path::Familiarity => {
            let hits = if probe_k >= p.k {
                probe_hits
                    .iter()
                    .copied()
                    .filter(|h| h.score >= p.min_score)
                    .take(p.k)
                    .collect()
            } else {
                candidates += p.k;
                store.search(&q0, p.k, p.min_score)?.remove(0)
            };
            let hits = hits
                .into_iter()
                .map(|h| Found {
                    index: h.index,
                    score: h.score,
                    round: 0,
                })
                .collect();
            (hits, 0, false)
        }
        Path::Recollection => recollect(store, &q0, &probe_hits, p, &mut candidates, stop)?,
    };

    let mut hits = hits;
    let mut filled = 0;
    if path == Path::Recollection && p.fill && hits.len() < p.k && hits.len() < store.len() {
        // The best unseen rows by plain top-k. The probe's rows are that
        // ranking's prefix; search further only when they run out.
        let mut seen: HashSet<u32> = hits.iter().map(|h| h.index).collect();
        let mut top_up = |pool: &[Hit], hits: &mut Vec<Found>| {
            for h in pool {
                if hits.len() == p.k {
                    break;
                }
                if h.score >= p.min_score && seen.insert(h.index) {
                    hits.push(Found {
                        index: h.index,
                        score: h.score,
                        round: rounds,
                    });
                    filled += 1;
                }
            }
        };
        top_up(&probe_hits, &mut hits);
        if !truncated && hits.len() < p.k && probe_hits.len() == probe_k {
            let want = p.k + probe_k;
            candidates += want;
            top_up(&store.search(&q0, want, p.min_score)?.remove(0), &mut hits);
        }
    }
    if path == Path::Recollection && p.order == Order::Score {
        hits.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
    }
    Ok(Answer {
        hits,
        path,
        rule,
        probe,
        rounds,
        candidates,
        filled,
        probe_time,
        path_time: started.elapsed(),
        truncated,
    })
}

struct Branch {
    q: Vec<f32>,
    hits: Vec<(u32, f32)>,
    score_sum: f32,
}

fn recollect(
    store: &VectorStore,
    q0: &[f32],
    probe: &[Hit],
    p: &RfMemParams,
    candidates: &mut usize,
    stop: &dyn Fn() -> bool,
) -> Result<(Vec<Found>, u32, bool), Error> {
    let dim = store.dim();
    let mut seen: HashSet<u32> = HashSet::new();
    let mut out: Vec<Found> = Vec::new();
    let mut beam = vec![Branch {
        q: q0.to_vec(),
        hits: Vec::new(),
        score_sum: 0.0,
    }];
    let mut rounds = 0;
    let mut truncated = false;
    for level in 0..p.depth {
        let k = (p.beam + level) * p.fanout;
        if *candidates + k * beam.len() > p.max_candidates.max(k) {
            break;
        }
        // The first round always runs (one bounded top-k, often the probe's
        // prefix), so a cut answer is never empty.
        if level > 0 && stop() {
            truncated = true;
            break;
        }
        rounds += 1;
        let results = if level == 0 && k <= probe.len() {
            // The first round searches q0 alone: the probe's prefix.
            vec![
                probe
                    .iter()
                    .copied()
                    .filter(|h| h.score >= p.min_score)
                    .take(k)
                    .collect(),
            ]
        } else {
            *candidates += k * beam.len();
            let queries: Vec<f32> = beam.iter().flat_map(|b| b.q.iter().copied()).collect();
            store.search(&queries, k, p.min_score)?
        };
        let mut next: Vec<Branch> = Vec::new();
        for (branch, hits) in beam.iter().zip(results) {
            if !next.is_empty() && stop() {
                // The branches clustered so far still make this round.
                truncated = true;
                break;
            }
            let cands: Vec<Hit> = hits
                .into_iter()
                .filter(|h| !seen.contains(&h.index))
                .collect();
            if cands.is_empty() {
                continue;
            }
            let vecs: Vec<std::borrow::Cow<'_, [f32]>> = cands
                .iter()
                .map(|h| store.vector(h.index as usize))
                .collect();
            let mmr: Vec<f32> = (0..cands.len())
                .map(|i| {
                    let max_sim = (0..cands.len())
                        .filter(|&j| j != i)
                        .map(|j| dot(&vecs[i], &vecs[j]))
                        .fold(None, |m: Option<f32>, s| Some(m.map_or(s, |m| m.max(s))))
                        .unwrap_or(0.0);
                    p.mmr_lambda * cands[i].score - (1.0 - p.mmr_lambda) * max_sim
                })
                .collect();
            let flat: Vec<f32> = vecs.iter().flat_map(|v| v.iter().copied()).collect();
            let clusters = p.beam.min(cands.len());
            let labels = kmeans(&flat, dim, clusters, p.kmeans_iters)?;
            for c in 0..clusters as u32 {
                let members: Vec<usize> = (0..cands.len()).filter(|&i| labels[i] == c).collect();
                if members.is_empty() {
                    continue;
                }
                let mut centroid = vec![0.0f32; dim];
                for &i in &members {
                    for (a, v) in centroid.iter_mut().zip(vecs[i].iter()) {
                        *a += v;
                    }
                }
                normalize(&mut centroid);
                let mut q: Vec<f32> = branch
                    .q
                    .iter()
                    .zip(&centroid)
                    .map(|(b, c)| p.alpha * b + (1.0 - p.alpha) * c)
                    .collect();
                if p.anchor {
                    q.iter_mut().zip(q0).for_each(|(a, b)| *a += b);
                }
                normalize(&mut q);
                let hits: Vec<(u32, f32)> =
                    members.iter().map(|&i| (cands[i].index, mmr[i])).collect();
                let gain: f32 = hits.iter().map(|h| h.1).sum();
                next.push(Branch {
                    q,
                    hits,
                    score_sum: branch.score_sum + gain,
                });
            }
        }
        if next.is_empty() {
            break;
        }
        // Stable: equal sums keep discovery order.
        next.sort_by(|a, b| b.score_sum.total_cmp(&a.score_sum));
        next.truncate(p.beam);
        for b in &next {
            for &(index, _) in &b.hits {
                if seen.insert(index) {
                    out.push(Found {
                        index,
                        score: dot(q0, &store.vector(index as usize)),
                        round: level as u32,
                    });
                }
            }
        }
        beam = next;
        if out.len() >= p.k || truncated {
            break;
        }
    }
    out.truncate(p.k);
    Ok((out, rounds, truncated))
}

#[cfg(test)]
mod tests;
