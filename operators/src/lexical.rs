//! Lexical scoring: Okapi BM25 over one user's rows, as an inverted index.
//!
//! Terms are maximal runs of alphanumeric characters, lower-cased (Unicode
//! aware; no stemming, no stop list: BM25's idf already gives a word every
//! row holds a weight near zero). Scoring walks only the postings of the
//! query's terms, so its cost is the number of rows that share a term with
//! the query, not the corpus size.

use std::collections::HashMap;

/// BM25's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bm25Params {
    /// Term-frequency saturation.
    pub k1: f32,
    /// Length normalisation (0: none, 1: full).
    pub b: f32,
}

impl Default for Bm25Params {
    fn default() -> Self {
        Self { k1: 1.2, b: 0.75 }
    }
}

/// The terms of `text`, in order: maximal alphanumeric runs, lower-cased.
pub fn terms(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
}

/// Inverse document frequency of a term held by `df` of `docs` documents
/// (Lucene's form, never negative).
pub fn idf(docs: usize, df: usize) -> f64 {
    let (n, df) = (docs as f64, df as f64);
    ((n - df + 0.5) / (df + 0.5) + 1.0).ln()
}

/// A BM25 index over documents numbered `0..len()`.
#[derive(Debug, Clone, Default)]
pub struct Bm25Index {
    /// Term → (document, term frequency), documents ascending.
    postings: HashMap<Box<str>, Vec<(u32, u32)>>,
    /// Document lengths in terms.
    lens: Vec<u32>,
    avg_len: f32,
    params: Bm25Params,
}

impl Bm25Index {
    /// Indexes `docs` in order.
    pub fn new<S: AsRef<str>>(docs: impl IntoIterator<Item = S>, params: Bm25Params) -> Self {
        let mut postings: HashMap<Box<str>, Vec<(u32, u32)>> = HashMap::new();
        let mut lens = Vec::new();
        for (d, doc) in docs.into_iter().enumerate() {
            let d = u32::try_from(d).unwrap_or(u32::MAX);
            let mut len = 0u32;
            for t in terms(doc.as_ref()) {
                len += 1;
                let list = postings.entry(t.into_boxed_str()).or_default();
                match list.last_mut() {
                    Some((last, tf)) if *last == d => *tf += 1,
                    _ => list.push((d, 1)),
                }
            }
            lens.push(len);
        }
        let avg_len = if lens.is_empty() {
            0.0
        } else {
            lens.iter().map(|&l| l as f32).sum::<f32>() / lens.len() as f32
        };
        Self {
            postings,
            lens,
            avg_len,
            params,
        }
    }

    /// Documents indexed.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Whether no document is indexed.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }

    fn idf(&self, df: usize) -> f32 {
        idf(self.lens.len(), df) as f32
    }

    /// Calls `add(document, part)` for each query term's part of each
    /// document's BM25 score for `query` (a query term counts once per
    /// occurrence in the query); a document's score is the sum of its parts.
    fn each_part(&self, query: &str, mut add: impl FnMut(u32, f32)) {
        let mut q: HashMap<String, f32> = HashMap::new();
        for t in terms(query) {
            *q.entry(t).or_insert(0.0) += 1.0;
        }
        let Bm25Params { k1, b } = self.params;
        let avg = self.avg_len.max(1.0);
        for (t, times) in &q {
            let Some(list) = self.postings.get(t.as_str()) else {
                continue;
            };
            let idf = self.idf(list.len());
            for &(d, tf) in list {
                let tf = tf as f32;
                let norm = k1 * (1.0 - b + b * self.lens[d as usize] as f32 / avg);
                add(d, times * idf * tf * (k1 + 1.0) / (tf + norm));
            }
        }
    }

    /// The BM25 score of every document that shares a term with `query`
    /// (the others score 0), unordered. A query term counts once per
    /// occurrence in the query.
    pub fn scores(&self, query: &str) -> Vec<(u32, f32)> {
        let mut acc: HashMap<u32, f32> = HashMap::new();
        self.each_part(query, |d, part| *acc.entry(d).or_insert(0.0) += part);
        acc.into_iter().collect()
    }

    /// The BM25 score of every document for `query`, by document (0 for
    /// those sharing no term): the same sums as [`Self::scores`], added into
    /// a dense vector instead of a map, which is several times cheaper when
    /// a query term is common (its posting list long).
    pub fn dense_scores(&self, query: &str) -> Vec<f32> {
        let mut acc = vec![0.0f32; self.lens.len()];
        self.each_part(query, |d, part| acc[d as usize] += part);
        acc
    }

    /// The most any document could score for `query`: each query term the
    /// index holds at its saturated weight, `idf · (k1 + 1)` per occurrence
    /// in the query. A score divided by it is in [0, 1] and absolute: a row
    /// that shares only common words with the query stays near 0 even when
    /// it is the best match (0 when no query term is indexed).
    pub fn max_score(&self, query: &str) -> f32 {
        let k1 = self.params.k1;
        terms(query)
            .filter_map(|t| self.postings.get(t.as_str()))
            .map(|list| self.idf(list.len()) * (k1 + 1.0))
            .sum()
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.postings
            .iter()
            .map(|(k, v)| k.len() + v.capacity() * 8 + 48)
            .sum::<usize>()
            + self.lens.capacity() * 4
    }
}

/// Learned sparse vectors (SPLADE, [`crate::embed::Splade`]) of one user's
/// units, as an inverted index: term → (document, weight), in term order.
/// A query's score against a document is the dot product of their vectors.
#[derive(Debug, Default)]
pub struct SparseIndex {
    /// Distinct terms, ascending.
    terms: Vec<u32>,
    /// `offsets[i]..offsets[i + 1]`: the postings of `terms[i]`.
    offsets: Vec<u32>,
    /// Postings: document and weight.
    postings: Vec<(u32, f32)>,
    /// Per term, its largest weight in any document.
    max_weight: Vec<f32>,
    /// Documents.
    docs: usize,
}

impl SparseIndex {
    /// Indexes `docs` in order (document `i` is the `i`-th vector; an empty
    /// vector is a document that scores 0).
    pub fn new<'a>(docs: impl IntoIterator<Item = &'a crate::embed::SparseVec>) -> Self {
        let mut all: Vec<(u32, u32, f32)> = Vec::new();
        let mut n = 0u32;
        for (d, v) in docs.into_iter().enumerate() {
            n = d as u32 + 1;
            all.extend(
                v.terms
                    .iter()
                    .zip(&v.weights)
                    .map(|(&t, &w)| (t, d as u32, w)),
            );
        }
        all.sort_unstable_by_key(|p| (p.0, p.1));
        let mut index = Self {
            docs: n as usize,
            postings: Vec::with_capacity(all.len()),
            ..Self::default()
        };
        for (t, d, w) in all {
            if index.terms.last() != Some(&t) {
                index.terms.push(t);
                index.offsets.push(index.postings.len() as u32);
                index.max_weight.push(0.0);
            }
            if let Some(m) = index.max_weight.last_mut() {
                *m = m.max(w);
            }
            index.postings.push((d, w));
        }
        index.offsets.push(index.postings.len() as u32);
        index
    }

    /// Documents indexed.
    pub fn len(&self) -> usize {
        self.docs
    }

    /// Whether no document is indexed.
    pub fn is_empty(&self) -> bool {
        self.docs == 0
    }

    fn postings_of(&self, term: u32) -> Option<(usize, &[(u32, f32)])> {
        let i = self.terms.binary_search(&term).ok()?;
        let (lo, hi) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        Some((i, &self.postings[lo..hi]))
    }

    /// Every document's score for `query`, by document (0 for those
    /// sharing no term).
    pub fn dense_scores(&self, query: &crate::embed::SparseVec) -> Vec<f32> {
        let mut acc = vec![0.0f32; self.docs];
        for (&t, &qw) in query.terms.iter().zip(&query.weights) {
            if let Some((_, list)) = self.postings_of(t) {
                for &(d, w) in list {
                    acc[d as usize] += qw * w;
                }
            }
        }
        acc
    }

    /// The most any document could score for `query`: each query term
    /// times its largest weight in the index. A score divided by it is in
    /// [0, 1] and absolute, as BM25's [`Bm25Index::max_score`] (0 when no
    /// query term is indexed).
    pub fn max_score(&self, query: &crate::embed::SparseVec) -> f32 {
        query
            .terms
            .iter()
            .zip(&query.weights)
            .filter_map(|(&t, &qw)| self.postings_of(t).map(|(i, _)| qw * self.max_weight[i]))
            .sum()
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.terms.capacity() * 4
            + self.offsets.capacity() * 4
            + self.postings.capacity() * 8
            + self.max_weight.capacity() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(ix: &Bm25Index, q: &str) -> Vec<f32> {
        let mut out = vec![0.0; ix.len()];
        for (d, s) in ix.scores(q) {
            out[d as usize] = s;
        }
        out
    }

    #[test]
    fn dense_scores_are_the_same_sums_by_document() {
        let ix = Bm25Index::new(
            ["the cat sat", "the dog", "a cat and a cat", "nothing here"],
            Bm25Params::default(),
        );
        for q in ["cat", "the cat the", "zebra", ""] {
            let dense = ix.dense_scores(q);
            assert_eq!(dense.len(), 4);
            let mut want = vec![0.0f32; 4];
            for (d, s) in ix.scores(q) {
                want[d as usize] = s;
            }
            for (a, b) in dense.iter().zip(&want) {
                assert!((a - b).abs() < 1e-6, "{q:?}: {dense:?} vs {want:?}");
            }
        }
    }

    #[test]
    fn terms_are_lowercased_alphanumeric_runs() {
        let t: Vec<String> = terms("Café au-lait, 2 × Blue_Train!").collect();
        assert_eq!(t, ["café", "au", "lait", "2", "blue", "train"]);
    }

    #[test]
    fn bm25_matches_a_hand_computed_score() {
        let ix = Bm25Index::new(
            ["blue train", "blue blue note", "giant steps"],
            Bm25Params::default(),
        );
        let s = score(&ix, "blue");
        // df = 2 of n = 3: idf = ln((3 − 2 + 0.5) / 2.5 + 1) = ln 1.6.
        let idf = 1.6f32.ln();
        let avg = 7.0 / 3.0;
        let one = |tf: f32, len: f32| idf * tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len / avg));
        assert!((s[0] - one(1.0, 2.0)).abs() < 1e-6, "{s:?}");
        assert!((s[1] - one(2.0, 3.0)).abs() < 1e-6, "{s:?}");
        assert_eq!(s[2], 0.0);
        // A rarer term weighs more than a common one.
        let s = score(&ix, "giant blue");
        assert!(s[2] > s[0]);
        // The ceiling: idf · (k1 + 1) per indexed query term.
        let ceiling = ix.max_score("blue giant nothing");
        assert!(
            (ceiling - (idf + (8.0f32 / 3.0).ln()) * 2.2).abs() < 1e-5,
            "{ceiling}"
        );
        assert!(s.iter().all(|&x| x < ceiling));
        assert_eq!(ix.max_score("nothing"), 0.0);
        // No shared term: nothing scored.
        assert!(ix.scores("nothing here").is_empty());
        assert!(
            Bm25Index::new(Vec::<String>::new(), Bm25Params::default())
                .scores("x")
                .is_empty()
        );
    }

    #[test]
    fn repeating_a_query_term_weighs_it_more() {
        let ix = Bm25Index::new(["cat", "dog"], Bm25Params::default());
        let once = score(&ix, "cat dog");
        let twice = score(&ix, "cat cat dog");
        assert!((twice[0] - 2.0 * once[0]).abs() < 1e-6);
        assert!((twice[1] - once[1]).abs() < 1e-6);
    }

    #[test]
    fn sparse_index_scores_dot_products_under_an_absolute_ceiling() {
        use crate::embed::SparseVec;
        let docs = [
            SparseVec::from_pairs(vec![(1, 1.0), (2, 2.0)]),
            SparseVec::default(),
            SparseVec::from_pairs(vec![(2, 0.5), (9, 3.0)]),
        ];
        let ix = SparseIndex::new(&docs);
        assert_eq!(ix.len(), 3);
        let q = SparseVec::from_pairs(vec![(2, 1.0), (9, 1.0), (4, 5.0)]);
        let scores = ix.dense_scores(&q);
        for (d, s) in docs.iter().zip(&scores) {
            assert_eq!(*s, d.dot(&q));
        }
        assert_eq!(scores, vec![2.0, 0.0, 3.5]);
        // Term 2 at its best (2.0) plus term 9 at its best (3.0); term 4 is
        // not indexed.
        assert_eq!(ix.max_score(&q), 5.0);
        assert_eq!(ix.max_score(&SparseVec::default()), 0.0);
        assert!(SparseIndex::new(&[]).is_empty());
    }
}
