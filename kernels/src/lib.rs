//! Batch cosine similarity + top-k for steamrf.
//!
//! One interface, [`SimilarityKernel`]: a batch of queries × a [`Corpus`] of
//! vectors → the top-k `(index, score)` per query, with a minimum score and an
//! optional exclusion filter (e.g. "not the same user"). Backends:
//! - [`reference::ScalarKernel`]: the obviously-correct scalar loop that every
//!   other backend is tested against;
//! - [`cpu::CpuKernel`]: blocked, multi-threaded, SIMD (gemm's AVX2/AVX-512
//!   micro-kernels) with the top-k fused per block, so the full score matrix
//!   never exists.
//!
//! Vectors are L2-normalised on the way in ([`Corpus::from_rows`] and every
//! query), so scores are cosine similarities. A zero vector stays zero and
//! scores 0 against everything. NaN or infinite inputs are rejected.
//!
//! Architecture invariant: no tokio, Kafka or LanceDB here.

#![deny(missing_docs)]

/// Calls `$variant` compiled for the widest SIMD the CPU has (AVX-512F, or
/// AVX2 with FMA), picked at run time, or else the x86-64 baseline `$body`.
/// The bodies are plain loops; the target features only let the compiler use
/// wider vectors for them.
macro_rules! dispatch {
    ($variant:ident, $body:ident($($arg:expr),*)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked on the line above.
                return unsafe { avx512::$variant($($arg),*) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe { avx2::$variant($($arg),*) };
            }
        }
        $body($($arg),*)
    }};
}

mod aligned;
pub mod amx;
pub mod bf16;
pub mod cpu;
pub mod cuda;
pub mod ivf;
pub mod nn;
pub mod quant;
pub mod reference;
#[cfg(test)]
mod testdata;
mod topk;

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

pub use cpu::dot;
pub use topk::TopK;

/// Errors of the kernels.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The inputs are unusable (wrong length, NaN, dimension mismatch).
    #[error("invalid input: {message}")]
    InvalidInput {
        /// What is wrong.
        message: String,
    },
    /// The backend cannot run here (no device, no driver).
    #[error("{backend} backend unavailable: {message}")]
    Unavailable {
        /// Which backend.
        backend: Backend,
        /// Why.
        message: String,
    },
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidInput {
        message: message.into(),
    }
}

/// Which implementation ran (a metric label and a log field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// [`reference::ScalarKernel`].
    Scalar,
    /// [`cpu::CpuKernel`].
    Cpu,
    /// The CUDA kernels.
    Cuda,
}

impl Backend {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One result: a corpus row and its cosine similarity to the query.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    /// Row in the corpus.
    pub index: u32,
    /// Cosine similarity.
    pub score: f32,
}

impl Hit {
    /// The result order: higher score first, then lower index (so ties are
    /// deterministic across backends and thread counts).
    pub fn better_than(&self, other: &Hit) -> bool {
        self.cmp_rank(other) == Ordering::Less
    }

    /// `Less` when `self` ranks before `other`.
    pub fn cmp_rank(&self, other: &Hit) -> Ordering {
        other
            .score
            .total_cmp(&self.score)
            .then(self.index.cmp(&other.index))
    }
}

/// How a [`Corpus`] keeps its rows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum RowPrecision {
    /// 4 bytes a value: scores are exact f32 cosines.
    #[default]
    F32,
    /// 2 bytes a value (bf16, rounded to nearest even): scores are f32 dot
    /// products of the rounded rows.
    Bf16,
}

impl RowPrecision {
    /// The configuration and label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }

    /// Bytes a value takes.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
}

impl std::str::FromStr for RowPrecision {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            _ => Err(invalid(format!(
                "row precision {s:?}: expected \"f32\" or \"bf16\""
            ))),
        }
    }
}

/// A corpus's values, row-major.
#[derive(Debug, Clone)]
enum Rows {
    F32(Vec<f32>),
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
}

impl Default for Rows {
    fn default() -> Self {
        Self::F32(Vec::new())
    }
}

impl Rows {
    fn values(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
        }
    }

    /// Values `range` as f32.
    fn get(&self, range: std::ops::Range<usize>) -> Cow<'_, [f32]> {
        match self {
            Self::F32(v) => Cow::Borrowed(&v[range]),
            Self::Bf16(_) => {
                let mut out = vec![0.0; range.len()];
                self.copy(range, &mut out);
                Cow::Owned(out)
            }
        }
    }

    /// Writes values `range` as f32 into `dst` (as long).
    fn copy(&self, range: std::ops::Range<usize>, dst: &mut [f32]) {
        match self {
            Self::F32(v) => dst.copy_from_slice(&v[range]),
            Self::Bf16(v) => {
                for (d, &b) in dst.iter_mut().zip(&v[range]) {
                    *d = widen(b);
                }
            }
        }
    }

    /// Appends `values` (already normalised).
    fn extend(&mut self, values: &[f32]) {
        match self {
            Self::F32(v) => v.extend_from_slice(values),
            Self::Bf16(v) => v.extend(values.iter().map(|&x| narrow(x))),
        }
    }

    /// Overwrites the values from `start` on with `values`.
    fn write(&mut self, start: usize, values: &[f32]) {
        match self {
            Self::F32(v) => v[start..start + values.len()].copy_from_slice(values),
            Self::Bf16(v) => {
                for (d, &x) in v[start..start + values.len()].iter_mut().zip(values) {
                    *d = narrow(x);
                }
            }
        }
    }
}

/// `x` rounded to bf16 (to nearest, ties to even).
fn narrow(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// The f32 value of bf16 bits `b` (exact).
#[inline(always)]
fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// A row-major matrix of L2-normalised vectors.
///
/// It keeps a short log of which rows changed, so a device-resident copy (the
/// CUDA backend's) can be brought up to date by uploading only those rows.
///
/// Its rows are kept in f32, or in bf16 ([`Corpus::with_precision`]): half
/// the bytes, each value rounded to nearest even after the row is
/// normalised, so a bf16 row's length is 1 within ~2⁻⁸ and a score against
/// it within ~2⁻⁸ of the f32 row's. A bf16 corpus hands out its rows
/// converted to f32 ([`Corpus::row`], [`Corpus::rows`]); kernels that scan
/// it convert a block at a time.
#[derive(Debug, Default)]
pub struct Corpus {
    data: Rows,
    dim: usize,
    uid: u64,
    version: u64,
    /// (version after the change, first row, end row), oldest first.
    changes: std::collections::VecDeque<(u64, usize, usize)>,
    /// Dropped with the corpus: what kernels derived from it (an index, an
    /// int8 or device copy) goes then too ([`PerCorpus`]).
    alive: std::sync::Arc<()>,
}

/// What a kernel derives from each corpus it searches (an index, an int8 or
/// device copy), by corpus, kept while the corpus lives: a corpus per tenant
/// gets its own, and a dropped corpus's is freed at a later call (the
/// next one while there are few).
pub(crate) struct PerCorpus<T> {
    entries: std::collections::HashMap<u64, (std::sync::Weak<()>, T)>,
    /// From this many entries on, the next call looks for dropped corpora
    /// (a few are checked on every call; many, once their number doubled,
    /// so a writer of thousands of tenants does not scan them all per
    /// tenant).
    purge_at: usize,
}

impl<T> Default for PerCorpus<T> {
    fn default() -> Self {
        Self {
            entries: Default::default(),
            purge_at: 0,
        }
    }
}

/// Entries a [`PerCorpus`] checks for dropped corpora on every call.
const PURGE_ALWAYS: usize = 64;

impl<T> PerCorpus<T> {
    /// Takes `corpus`'s state out (to bring it up to date and use it; put
    /// it back with [`PerCorpus::put`]), first dropping the states of the
    /// corpora that are gone (see `purge_at`).
    pub(crate) fn take(&mut self, corpus: &Corpus) -> Option<T> {
        if self.entries.len() <= PURGE_ALWAYS || self.entries.len() >= self.purge_at {
            self.entries
                .retain(|_, (alive, _)| alive.strong_count() > 0);
            self.purge_at = 2 * self.entries.len();
        }
        self.entries.remove(&corpus.uid).map(|(_, t)| t)
    }

    /// Keeps `state` for `corpus`.
    pub(crate) fn put(&mut self, corpus: &Corpus, state: T) {
        self.entries.insert(
            corpus.uid,
            (std::sync::Arc::downgrade(&corpus.alive), state),
        );
    }

    /// Every corpus's state.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.entries.values().map(|(_, t)| t)
    }
}

/// Changes remembered per corpus; a device copy older than that is re-uploaded whole.
const CHANGE_LOG: usize = 4096;

fn next_uid() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Clone for Corpus {
    /// A copy is a different corpus (its own identity and change log).
    fn clone(&self) -> Self {
        Self {
            data: self.data.clone(),
            dim: self.dim,
            uid: next_uid(),
            version: 0,
            changes: Default::default(),
            alive: Default::default(),
        }
    }
}

fn check_shape(len: usize, dim: usize) -> Result<()> {
    if dim == 0 {
        return Err(invalid("dimension must be > 0"));
    }
    if !len.is_multiple_of(dim) {
        return Err(invalid(format!(
            "{len} values is not a whole number of {dim}-d rows"
        )));
    }
    Ok(())
}

/// Checks every value is finite and scales each row to unit length, in place.
fn normalize_in_place(rows: &mut [f32], dim: usize) -> Result<()> {
    check_shape(rows.len(), dim)?;
    for (i, row) in rows.chunks_exact_mut(dim).enumerate() {
        if let Some(j) = row.iter().position(|v| !v.is_finite()) {
            return Err(invalid(format!(
                "row {i}, component {j} is {} (NaN and infinities are rejected)",
                row[j]
            )));
        }
        let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt();
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        row.iter_mut().for_each(|v| *v *= inv);
    }
    Ok(())
}

fn normalized_copy(rows: &[f32], dim: usize) -> Result<Vec<f32>> {
    let mut v = rows.to_vec();
    normalize_in_place(&mut v, dim)?;
    Ok(v)
}

impl Corpus {
    /// An empty corpus of `dim`-dimensional vectors.
    pub fn new(dim: usize) -> Self {
        Self::with_precision(dim, RowPrecision::F32)
    }

    /// An empty corpus of `dim`-dimensional vectors kept in `precision`.
    pub fn with_precision(dim: usize, precision: RowPrecision) -> Self {
        Self {
            data: match precision {
                RowPrecision::F32 => Rows::F32(Vec::new()),
                RowPrecision::Bf16 => Rows::Bf16(Vec::new()),
            },
            dim,
            uid: next_uid(),
            version: 0,
            changes: Default::default(),
            alive: Default::default(),
        }
    }

    fn record(&mut self, start: usize, end: usize) {
        self.version += 1;
        if self.changes.len() == CHANGE_LOG {
            self.changes.pop_front();
        }
        self.changes.push_back((self.version, start, end));
    }

    /// This corpus's identity (a clone gets a new one).
    pub fn uid(&self) -> u64 {
        self.uid
    }

    /// Incremented by every change.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The row ranges changed since `version`, or `None` if the log no longer
    /// reaches back that far (then everything must be re-read).
    pub fn changed_since(&self, version: u64) -> Option<Vec<std::ops::Range<usize>>> {
        if version == self.version {
            return Some(Vec::new());
        }
        let oldest = self.changes.front().map_or(self.version + 1, |c| c.0);
        if version + 1 < oldest || version > self.version {
            return None;
        }
        Some(
            self.changes
                .iter()
                .filter(|c| c.0 > version)
                .map(|c| c.1..c.2)
                .collect(),
        )
    }

    /// Normalises and copies `rows` (row-major, `dim` values each).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for a ragged length or a NaN/infinite value.
    pub fn from_rows(rows: &[f32], dim: usize) -> Result<Self> {
        let mut c = Self::new(dim);
        c.push_rows(rows)?;
        Ok(c)
    }

    /// Takes ownership of `rows` and normalises them in place (no copy).
    ///
    /// # Errors
    /// As [`Corpus::from_rows`].
    pub fn from_vec(mut rows: Vec<f32>, dim: usize) -> Result<Self> {
        normalize_in_place(&mut rows, dim)?;
        Ok(Self {
            data: Rows::F32(rows),
            ..Self::new(dim)
        })
    }

    /// Appends rows (normalised); their indices continue from [`Corpus::len`].
    ///
    /// # Errors
    /// As [`Corpus::from_rows`]; on error nothing is appended.
    pub fn push_rows(&mut self, rows: &[f32]) -> Result<()> {
        let tmp = normalized_copy(rows, self.dim)?;
        if (self.data.values() + tmp.len()) / self.dim > u32::MAX as usize {
            return Err(invalid("a corpus holds at most 2^32 rows"));
        }
        let start = self.len();
        self.data.extend(&tmp);
        let end = self.len();
        self.record(start, end);
        Ok(())
    }

    /// Replaces row `index` (normalised).
    ///
    /// # Errors
    /// As [`Corpus::from_rows`], or an index out of range.
    pub fn set_row(&mut self, index: usize, row: &[f32]) -> Result<()> {
        if index >= self.len() || row.len() != self.dim {
            return Err(invalid(format!(
                "row {index} of {} with {} values",
                self.len(),
                row.len()
            )));
        }
        let tmp = normalized_copy(row, self.dim)?;
        self.data.write(index * self.dim, &tmp);
        self.record(index, index + 1);
        Ok(())
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.data.values().checked_div(self.dim).unwrap_or(0)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.data.values() == 0
    }

    /// How the rows are kept.
    pub fn precision(&self) -> RowPrecision {
        match self.data {
            Rows::F32(_) => RowPrecision::F32,
            Rows::Bf16(_) => RowPrecision::Bf16,
        }
    }

    /// Bytes the rows take.
    pub fn bytes(&self) -> usize {
        self.data.values() * self.precision().bytes()
    }

    /// Dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The normalised values, row-major, as f32 (borrowed from an f32
    /// corpus, converted from a bf16 one).
    pub fn values(&self) -> Cow<'_, [f32]> {
        self.data.get(0..self.data.values())
    }

    /// Rows `rows`, as [`Corpus::values`].
    pub fn rows(&self, rows: std::ops::Range<usize>) -> Cow<'_, [f32]> {
        self.data.get(rows.start * self.dim..rows.end * self.dim)
    }

    /// Row `i`, as [`Corpus::values`].
    pub fn row(&self, i: usize) -> Cow<'_, [f32]> {
        self.rows(i..i + 1)
    }

    /// Writes row `i` into `dst` (`dim` values) without allocating.
    pub fn copy_row(&self, i: usize, dst: &mut [f32]) {
        self.data.copy(i * self.dim..(i + 1) * self.dim, dst);
    }

    /// `dot(q, &self.row(i))` (the same value), without allocating up to
    /// 1,024 dimensions.
    pub fn dot_row(&self, i: usize, q: &[f32]) -> f32 {
        let range = i * self.dim..(i + 1) * self.dim;
        match &self.data {
            Rows::F32(v) => dot(q, &v[range]),
            Rows::Bf16(_) if self.dim > 1024 => dot(q, &self.row(i)),
            Rows::Bf16(_) => {
                let mut row = [0.0f32; 1024];
                self.copy_row(i, &mut row[..self.dim]);
                dot(q, &row[..self.dim])
            }
        }
    }
}

/// An exclusion filter: `exclude(query, corpus_row)` is true for pairs that
/// must not be returned.
pub type Exclude<'a> = &'a (dyn Fn(usize, usize) -> bool + Sync);

/// What to return per query.
#[derive(Clone, Copy)]
pub struct SearchParams<'a> {
    /// At most this many hits per query.
    pub k: usize,
    /// Only hits with `score >= min_score` (use `f32::NEG_INFINITY` for all).
    pub min_score: f32,
    /// Pairs to skip.
    pub exclude: Option<Exclude<'a>>,
}

impl fmt::Debug for SearchParams<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SearchParams")
            .field("k", &self.k)
            .field("min_score", &self.min_score)
            .field("exclude", &self.exclude.is_some())
            .finish()
    }
}

impl SearchParams<'_> {
    /// Top-`k`, no floor, no filter.
    pub fn top(k: usize) -> Self {
        Self {
            k,
            min_score: f32::NEG_INFINITY,
            exclude: None,
        }
    }
}

/// Batch cosine similarity + top-k.
pub trait SimilarityKernel: Send + Sync {
    /// Which backend this is.
    fn backend(&self) -> Backend;

    /// For each of the `queries.len() / corpus.dim()` queries (row-major, not
    /// necessarily normalised), the hits in rank order ([`Hit::cmp_rank`]).
    ///
    /// # Errors
    /// [`Error::InvalidInput`] for ragged queries, a NaN/infinite value, or a
    /// `min_score` that is NaN. Backends may add [`Error::Unavailable`].
    fn top_k(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>>;
}

/// What a backend searches with, after [`prepare_search`].
pub(crate) enum Prepared {
    /// The normalised queries (at least one), over a non-empty corpus, k > 0.
    Search(Vec<f32>),
    /// The whole answer: no queries, or an empty hit list per query (empty
    /// corpus, or k = 0).
    Answered(Vec<Vec<Hit>>),
}

/// The shared start of every backend's `top_k`: validates and normalises
/// the queries, and answers the calls that have nothing to search.
pub(crate) fn prepare_search(
    queries: &[f32],
    corpus: &Corpus,
    params: &SearchParams<'_>,
) -> Result<Prepared> {
    let q = prepare_queries(queries, corpus, params)?;
    let m = q.len() / corpus.dim().max(1);
    if m == 0 || corpus.is_empty() || params.k == 0 {
        return Ok(Prepared::Answered(vec![Vec::new(); m]));
    }
    Ok(Prepared::Search(q))
}

/// Validates and normalises the queries of one call.
pub(crate) fn prepare_queries(
    queries: &[f32],
    corpus: &Corpus,
    params: &SearchParams<'_>,
) -> Result<Vec<f32>> {
    if params.min_score.is_nan() {
        return Err(invalid("min_score is NaN"));
    }
    normalized_copy(queries, corpus.dim()).map_err(|e| match e {
        Error::InvalidInput { message } => invalid(format!("queries: {message}")),
        other => other,
    })
}

#[cfg(test)]
mod per_corpus_tests {
    use super::*;

    /// Corpora replaced wholesale (a writer reloading its tenants): the
    /// dropped ones' states go once the entries have doubled, so at most
    /// about as many dead states as live ones are ever held.
    #[test]
    fn dropped_corpora_are_purged_as_the_map_doubles() {
        let mut p: PerCorpus<usize> = PerCorpus::default();
        let mut most = 0;
        let mut cycle = |p: &mut PerCorpus<usize>| {
            let corpora: Vec<Corpus> = (0..100).map(|_| Corpus::new(2)).collect();
            for (i, c) in corpora.iter().enumerate() {
                assert!(p.take(c).is_none());
                p.put(c, i);
                most = most.max(p.entries.len());
            }
            for c in &corpora {
                let v = p.take(c).expect("a live corpus keeps its state");
                p.put(c, v);
            }
        };
        for _ in 0..5 {
            cycle(&mut p);
        }
        assert!(
            most <= 2 * 100 + 1,
            "held {most} states for 100 live corpora"
        );
        // With few corpora, a dropped one's state goes at the next call.
        let mut q: PerCorpus<()> = PerCorpus::default();
        let (a, b) = (Corpus::new(2), Corpus::new(2));
        q.put(&a, ());
        q.put(&b, ());
        drop(b);
        let _ = q.take(&a);
        assert!(q.entries.is_empty());
    }
}
