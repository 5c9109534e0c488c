//! The scalar reference: every backend must agree with it.

use crate::{Backend, Corpus, Hit, Result, SearchParams, SimilarityKernel, prepare_queries};

/// Plain loops: a dot product per pair, a full sort per query.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScalarKernel;

impl SimilarityKernel for ScalarKernel {
    fn backend(&self) -> Backend {
        Backend::Scalar
    }

    fn top_k(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>> {
        let q = prepare_queries(queries, corpus, params)?;
        let dim = corpus.dim();
        Ok(q.chunks_exact(dim)
            .enumerate()
            .map(|(qi, query)| {
                let mut hits: Vec<Hit> = (0..corpus.len())
                    .filter_map(|ci| {
                        let score = query
                            .iter()
                            .zip(corpus.row(ci).iter())
                            .map(|(a, b)| a * b)
                            .sum::<f32>();
                        let excluded = params.exclude.is_some_and(|f| f(qi, ci));
                        (score >= params.min_score && !excluded).then_some(Hit {
                            index: ci as u32,
                            score,
                        })
                    })
                    .collect();
                hits.sort_by(Hit::cmp_rank);
                hits.truncate(params.k);
                hits
            })
            .collect())
    }
}
