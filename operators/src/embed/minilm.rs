//! all-MiniLM-L6-v2 in process: candle's `BertModel`, the `tokenizers`
//! crate, mean pooling over the attention mask, L2 normalisation.
//!
//! Parity with sentence-transformers (checked by a test against reference
//! vectors): the model directory's `tokenizer.json` truncates at 128 tokens
//! and pads every input to 128; sentence-transformers instead truncates at
//! 256 (`max_seq_length`) and pads to the longest input of a batch. Both are
//! overridden here: truncation at [`MiniLmOptions::max_tokens`], no padding
//! by the tokenizer, and padding to the longest input of each sub-batch.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config as BertConfig};
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use super::native::NativeBert;
use super::{EmbedError, Embeddings, clip_bytes, normalize};

/// Which forward pass runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// steamrf's own forward pass on the kernels crate (no padding, fused
    /// QKV, fast exact-erf GELU): about 2x candle's throughput per core.
    #[default]
    Native,
    /// candle-transformers' `BertModel`, padded per sub-batch.
    Candle,
}

/// The number format of the native forward pass's Linear layers (about 90%
/// of its arithmetic). Measured on the 20 reference sentences (the lowest
/// cosine to the f32 vectors, checked by a test) and on real dialogue turns
/// (`steamrf bench embed`, docs/results.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// [`Precision::Bf16`] where the CPU has AMX (and Linux grants it),
    /// else [`Precision::Int16`] where it has AVX-512 VNNI, else
    /// [`Precision::F32`].
    #[default]
    Auto,
    /// f32 everywhere: the reference (sentence-transformers to 1e-5).
    F32,
    /// 16-bit integer weights (per output channel) and activations (per
    /// token), summed exactly in i32 by AVX-512 VNNI (`vpdpwssd`); lowest
    /// cosine to f32 ≥ 0.9999.
    Int16,
    /// 8-bit integers (`vpdpbusd`): twice int16's arithmetic rate, but the
    /// lowest cosine to f32 falls to ~0.997 — below the 0.999 the defaults
    /// keep, so only on request.
    Int8,
    /// bf16 weights and activations multiplied on AMX tiles (`tdpbf16ps`),
    /// summed in f32: PyTorch's bf16 autocast arithmetic; needs AMX.
    Bf16,
}

impl Precision {
    /// The label in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F32 => "f32",
            Self::Int16 => "int16",
            Self::Int8 => "int8",
            Self::Bf16 => "bf16",
        }
    }

    /// `self` when this CPU runs it natively (f32 always; integers need
    /// AVX-512 VNNI; bf16 needs AMX), else an error naming what is missing.
    ///
    /// # Errors
    /// [`EmbedError::Unsupported`].
    pub fn supported(self) -> Result<Self, EmbedError> {
        let missing = match self {
            Self::Int16 | Self::Int8 if !steamrf_kernels::quant::vnni_available() => "AVX-512 VNNI",
            Self::Bf16 if !steamrf_kernels::bf16::amx_available() => {
                "AMX (amx_tile, amx_bf16, and Linux's permission for the tile state)"
            }
            p => return Ok(p),
        };
        Err(EmbedError::Unsupported(format!(
            "precision \"{}\" needs {missing}, which this CPU lacks; use \"auto\" or \"f32\"",
            self.as_str()
        )))
    }

    /// `Auto` decided from this CPU's features; an explicit choice kept.
    pub fn resolve(self) -> Self {
        match self {
            Self::Auto if steamrf_kernels::bf16::amx_available() => Self::Bf16,
            Self::Auto if steamrf_kernels::quant::vnni_available() => Self::Int16,
            Self::Auto => Self::F32,
            p => p,
        }
    }
}

/// How the in-process model tokenizes and batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MiniLmOptions {
    /// The forward pass.
    pub backend: Backend,
    /// The native forward pass's number format (candle runs f32 only).
    pub precision: Precision,
    /// Longest input in tokens, special tokens included; longer texts are cut
    /// (and counted). sentence-transformers uses 256 for this model.
    pub max_tokens: usize,
    /// Texts per forward pass. Texts are sorted by length first, so each
    /// sub-batch pads little.
    pub batch_size: usize,
    /// Cap on padded tokens per forward pass (bounds memory on long texts).
    pub max_batch_tokens: usize,
}

impl Default for MiniLmOptions {
    fn default() -> Self {
        Self {
            backend: Backend::default(),
            precision: Precision::default(),
            max_tokens: 256,
            batch_size: 16,
            max_batch_tokens: 8192,
        }
    }
}

enum Engine {
    Native(NativeBert),
    Candle(BertModel),
}

/// all-MiniLM-L6-v2 (or any BERT sentence encoder in the same layout).
pub struct MiniLm {
    model: Engine,
    tokenizer: Tokenizer,
    dim: usize,
    model_id: String,
    opts: MiniLmOptions,
}

impl std::fmt::Debug for MiniLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniLm")
            .field("model_id", &self.model_id)
            .field("dim", &self.dim)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

pub(super) fn load_err(path: &Path, reason: impl std::fmt::Display) -> EmbedError {
    EmbedError::Load {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn model_err(e: impl std::fmt::Display) -> EmbedError {
    EmbedError::Model(e.to_string())
}

/// `config.json` of a Hugging Face-style BERT directory.
pub(super) fn read_config(dir: &Path) -> Result<BertConfig, EmbedError> {
    let path = dir.join("config.json");
    serde_json::from_slice(&std::fs::read(&path).map_err(|e| load_err(&path, e))?)
        .map_err(|e| load_err(&path, e))
}

/// `tokenizer.json` of the same, cutting inputs at `max_tokens` and padding
/// nothing.
pub(super) fn read_tokenizer(dir: &Path, max_tokens: usize) -> Result<Tokenizer, EmbedError> {
    let path = dir.join("tokenizer.json");
    let mut tokenizer = Tokenizer::from_file(&path).map_err(|e| load_err(&path, e))?;
    tokenizer
        .with_truncation(Some(TruncationParams {
            max_length: max_tokens,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        }))
        .map_err(|e| load_err(&path, e))?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

impl MiniLm {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir`.
    ///
    /// # Errors
    /// A missing or malformed file, named in the error.
    pub fn load(dir: &Path, opts: MiniLmOptions) -> Result<Self, EmbedError> {
        let config = read_config(dir)?;
        let tokenizer = read_tokenizer(dir, opts.max_tokens)?;
        let weights_path = dir.join("model.safetensors");
        let mut opts = opts;
        // `auto` on candle means f32; an explicit integer format is refused there.
        let wanted = match (opts.backend, opts.precision) {
            (Backend::Candle, Precision::Auto) => Precision::F32,
            (_, p) => p.resolve(),
        };
        opts.precision = match (opts.backend, wanted) {
            (_, Precision::F32 | Precision::Auto) => Precision::F32,
            (Backend::Candle, p) => {
                return Err(EmbedError::Unsupported(format!(
                    "precision \"{}\" needs the native backend; candle runs f32",
                    p.as_str()
                )));
            }
            (Backend::Native, p) => p.supported()?,
        };
        let weights = std::fs::read(&weights_path).map_err(|e| load_err(&weights_path, e))?;
        let model = match opts.backend {
            Backend::Native => Engine::Native(
                NativeBert::load(&weights, &config, opts.precision)
                    .map_err(|e| load_err(&weights_path, e))?,
            ),
            Backend::Candle => {
                let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, &Device::Cpu)
                    .map_err(|e| load_err(&weights_path, e))?;
                Engine::Candle(
                    BertModel::load(vb, &config).map_err(|e| load_err(&weights_path, e))?,
                )
            }
        };
        let model_id = dir
            .file_name()
            .map_or_else(|| "bert".to_owned(), |n| n.to_string_lossy().into_owned());
        Ok(Self {
            model,
            tokenizer,
            dim: config.hidden_size,
            model_id,
            opts,
        })
    }

    /// Vector length (the model's hidden size).
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Texts per forward pass at most ([`MiniLmOptions::batch_size`]).
    pub fn batch_size(&self) -> usize {
        self.opts.batch_size.max(1)
    }

    /// The number format the forward pass runs at (never `Auto`).
    pub fn precision(&self) -> Precision {
        self.opts.precision
    }

    /// The model directory's name.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The token ids the model sees for `text` (special tokens included,
    /// truncated to `max_tokens`).
    ///
    /// # Errors
    /// If the tokenizer fails.
    pub fn token_ids(&self, text: &str) -> Result<Vec<u32>, EmbedError> {
        Ok(self.encode(text)?.0)
    }

    /// Tokenizes one text: (ids, whether it was cut).
    fn encode(&self, text: &str) -> Result<(Vec<u32>, bool), EmbedError> {
        // A token never spans more than ~100 characters (WordPiece's limit), so
        // the first max_tokens tokens lie within this many bytes; clipping
        // first keeps a megabyte of text from costing a megabyte of tokenizing.
        let budget = self.opts.max_tokens.saturating_mul(512);
        let clipped = clip_bytes(text, budget);
        let enc = self
            .tokenizer
            .encode_fast(clipped, true)
            .map_err(model_err)?;
        let cut = clipped.len() < text.len() || !enc.get_overflowing().is_empty();
        Ok((enc.get_ids().to_vec(), cut))
    }

    /// Embeds `texts` on the calling thread (blocking). Prefer
    /// [`super::LocalEmbedder`] from async code.
    ///
    /// # Errors
    /// If tokenizing or the forward pass fails.
    pub fn embed_sync(&self, texts: &[&str]) -> Result<Embeddings, EmbedError> {
        let mut encoded = Vec::with_capacity(texts.len());
        let mut out = Embeddings {
            dim: self.dim,
            vectors: vec![0.0; texts.len() * self.dim],
            tokens: 0,
            truncated: 0,
        };
        for t in texts {
            let (ids, cut) = self.encode(t)?;
            out.tokens += ids.len() as u64;
            out.truncated += u64::from(cut);
            encoded.push(ids);
        }
        // Shortest first: each sub-batch pads to its own longest input.
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| encoded[i].len());
        let mut start = 0;
        while start < order.len() {
            let mut end = start;
            while end < order.len() && end - start < self.opts.batch_size.max(1) {
                let longest = encoded[order[end]].len();
                if end > start && (end - start + 1) * longest > self.opts.max_batch_tokens {
                    break;
                }
                end += 1;
            }
            let chunk = &order[start..end];
            let pooled = self.forward(chunk.iter().map(|&i| encoded[i].as_slice()))?;
            for (row, &i) in chunk.iter().enumerate() {
                let dst = &mut out.vectors[i * self.dim..(i + 1) * self.dim];
                dst.copy_from_slice(&pooled[row * self.dim..(row + 1) * self.dim]);
                normalize(dst);
            }
            start = end;
        }
        Ok(out)
    }

    /// One forward pass over a sub-batch; returns mean-pooled rows.
    fn forward<'a>(&self, seqs: impl Iterator<Item = &'a [u32]>) -> Result<Vec<f32>, EmbedError> {
        let seqs: Vec<&[u32]> = seqs.collect();
        let model = match &self.model {
            Engine::Native(m) => return m.forward(&seqs).map_err(EmbedError::Model),
            Engine::Candle(m) => m,
        };
        let b = seqs.len();
        let len = seqs.iter().map(|s| s.len()).max().unwrap_or(0).max(1);
        let mut ids = vec![0u32; b * len];
        let mut mask = vec![0u32; b * len];
        for (r, s) in seqs.iter().enumerate() {
            ids[r * len..r * len + s.len()].copy_from_slice(s);
            mask[r * len..r * len + s.len()].fill(1);
        }
        let dev = Device::Cpu;
        let ids = Tensor::from_vec(ids, (b, len), &dev).map_err(model_err)?;
        let type_ids = ids.zeros_like().map_err(model_err)?;
        let mask = Tensor::from_vec(mask, (b, len), &dev).map_err(model_err)?;
        let hidden = model
            .forward(&ids, &type_ids, Some(&mask))
            .map_err(model_err)?;
        // Mean over real tokens: sum(h · mask) / max(sum(mask), 1e-9), as
        // sentence-transformers' Pooling does.
        let maskf = mask
            .to_dtype(DType::F32)
            .and_then(|m| m.unsqueeze(2))
            .map_err(model_err)?;
        let summed = hidden
            .broadcast_mul(&maskf)
            .and_then(|h| h.sum(1))
            .map_err(model_err)?;
        let counts = maskf
            .sum(1)
            .and_then(|c| c.clamp(1e-9f32, f32::MAX))
            .map_err(model_err)?;
        summed
            .broadcast_div(&counts)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(model_err)
    }
}
