//! A BERT encoder forward pass written on the kernels crate's dense ops
//! (`steamrf_kernels::nn`): the same arithmetic as candle's `BertModel`
//! (and PyTorch's), organised for throughput on a CPU core:
//!
//! - no padding: the linear layers run on the concatenated tokens of a whole
//!   sub-batch, and attention runs per sequence on its own length (padded
//!   positions contribute exactly zero in the padded formulation, so the
//!   results are the same);
//! - Q, K and V in one matrix multiply (weights concatenated at load);
//! - bias adds fused into the multiply, buffers reused across layers;
//! - GELU with a branch-free erf (max error 4.2e-7) instead of libm's;
//! - attention's scores scaled inside the softmax, each row padded with
//!   `-inf` to a multiple of 16 so it has no scalar tail; each residual add
//!   fused into the layer norm after it;
//! - at [`Precision::Int16`] or [`Precision::Int8`], the four Linear layers of
//!   each block on integer weights (per output channel) and activations (per
//!   token), summed exactly in i32 by AVX-512 VNNI (`steamrf_kernels::quant`);
//!   embeddings, attention, layer norm, softmax, GELU and pooling stay f32;
//! - at [`Precision::Bf16`], the same four layers on bf16 weights and
//!   activations, multiplied on AMX tiles with f32 sums
//!   (`steamrf_kernels::bf16`); the FFN's first layer applies GELU to each
//!   block of its outputs in L1 and hands them to the second already rounded
//!   and packed (no f32 copy of the `tokens × 1,536` activations); the rest
//!   as above. (Attention's two small
//!   products on tiles too, one head at a time, measured slower: 639
//!   against 903 sentences/s.)
//!
//! Weights come from the same `model.safetensors` (each tensor through candle's loader).

use candle_core::safetensors::Load;
use candle_core::{DType, Device};
use candle_transformers::models::bert::Config as BertConfig;
use safetensors::SafeTensors;
use steamrf_kernels::bf16::{Bf16Linear, Bf16Rows};
use steamrf_kernels::nn::{
    MatMut, MatRef, add_assign, add_layer_norm, gelu_erf, layer_norm, linear, matmul,
    softmax_rows_scaled,
};
use steamrf_kernels::quant::{Format, QuantLinear};

use super::minilm::Precision;

/// A Linear layer (`out = x · wᵀ + b`, `w` of `n × k`) in the format the
/// model was loaded at.
pub(super) enum Dense {
    F32 {
        w: Vec<f32>,
        b: Vec<f32>,
        n: usize,
        k: usize,
    },
    Quant(QuantLinear),
    Bf16(Bf16Linear),
}

impl Dense {
    pub(super) fn new(w: Vec<f32>, b: Vec<f32>, n: usize, k: usize, precision: Precision) -> Self {
        match precision {
            Precision::Int16 => Self::Quant(QuantLinear::new(Format::Int16, &w, &b, n, k)),
            Precision::Int8 => Self::Quant(QuantLinear::new(Format::Int8, &w, &b, n, k)),
            Precision::Bf16 => Self::Bf16(Bf16Linear::new(&w, &b, n, k)),
            Precision::F32 | Precision::Auto => Self::F32 { w, b, n, k },
        }
    }

    /// A BERT block's feed-forward part, `out = gelu(x · firstᵀ + b₁) ·
    /// secondᵀ + b₂` (`self` is the first layer). In bf16 the first layer
    /// hands its GELU output to the second already rounded and packed, so
    /// the `t × intermediate` activations never exist in f32; the other
    /// formats go through `inter` (grown as needed): int16 and int8 apply
    /// GELU as they write it, f32 in place after.
    pub(super) fn feed_forward(
        &self,
        second: &Self,
        out: &mut [f32],
        x: &[f32],
        t: usize,
        inter: &mut Intermediate,
    ) {
        match (self, second) {
            (Self::Bf16(first), Self::Bf16(second)) => {
                first.forward_gelu_packed(&mut inter.packed, x, t);
                second.forward_packed(out, &inter.packed);
            }
            (Self::Quant(first), _) => {
                inter.f32.resize(t * first.outputs(), 0.0);
                first.forward_gelu(&mut inter.f32, x, t);
                second.apply(out, &inter.f32, t);
            }
            _ => {
                let width = match self {
                    Self::F32 { n, .. } => *n,
                    Self::Quant(l) => l.outputs(),
                    Self::Bf16(l) => l.outputs(),
                };
                inter.f32.resize(t * width, 0.0);
                self.apply(&mut inter.f32, x, t);
                gelu_erf(&mut inter.f32);
                second.apply(out, &inter.f32, t);
            }
        }
    }

    /// `out` (`t × n`) `= x` (`t × k`) `· wᵀ + b`.
    pub(super) fn apply(&self, out: &mut [f32], x: &[f32], t: usize) {
        match self {
            Self::F32 { w, b, n, k } => linear(out, x, w, b, t, *k, *n),
            Self::Quant(l) => l.forward(out, x, t),
            Self::Bf16(l) => l.forward(out, x, t),
        }
    }
}

/// The feed-forward part's intermediate activations, kept across layers.
#[derive(Default)]
pub(super) struct Intermediate {
    f32: Vec<f32>,
    packed: Bf16Rows,
}

struct Layer {
    qkv: Dense,
    attn_out: Dense,
    ln1_g: Vec<f32>,
    ln1_b: Vec<f32>,
    inter: Dense,
    out: Dense,
    ln2_g: Vec<f32>,
    ln2_b: Vec<f32>,
}

pub(super) struct NativeBert {
    hidden: usize,
    heads: usize,
    max_pos: usize,
    eps: f32,
    word: Vec<f32>,
    pos: Vec<f32>,
    token_type0: Vec<f32>,
    emb_ln_g: Vec<f32>,
    emb_ln_b: Vec<f32>,
    layers: Vec<Layer>,
}

/// The safetensors file, read one tensor at a time: loading then holds the
/// file and the model's own copy, never a third copy of every tensor.
struct Weights<'a> {
    tensors: SafeTensors<'a>,
    prefix: &'static str,
}

impl Weights<'_> {
    fn get(&self, name: &str, len: usize) -> Result<Vec<f32>, String> {
        // Older BERT checkpoints name a layer norm's weight and bias
        // `gamma` and `beta`.
        let legacy = name
            .strip_suffix("LayerNorm.weight")
            .map(|p| format!("{p}LayerNorm.gamma"))
            .or_else(|| {
                name.strip_suffix("LayerNorm.bias")
                    .map(|p| format!("{p}LayerNorm.beta"))
            });
        let view = self
            .tensors
            .tensor(&format!("{}{name}", self.prefix))
            .or_else(|e| match &legacy {
                Some(l) => self.tensors.tensor(&format!("{}{l}", self.prefix)),
                None => Err(e),
            })
            .or_else(|e| {
                // Heads outside the encoder (`cls.…`) carry no prefix.
                if self.prefix.is_empty() {
                    Err(e)
                } else {
                    self.tensors.tensor(name).or_else(|e| match &legacy {
                        Some(l) => self.tensors.tensor(l),
                        None => Err(e),
                    })
                }
            })
            .map_err(|_| format!("tensor {name} is missing"))?;
        let v = if view.dtype() == safetensors::Dtype::F32 {
            // The common case, copied straight from the file's bytes.
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        } else {
            view.load(&Device::Cpu)
                .and_then(|t| t.to_dtype(DType::F32))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(|e| format!("tensor {name}: {e}"))?
        };
        if v.len() != len {
            return Err(format!(
                "tensor {name} has {} values, expected {len}",
                v.len()
            ));
        }
        Ok(v)
    }
}

impl NativeBert {
    /// Loads the weights at `precision` (already resolved from `Auto`).
    pub(super) fn load(
        bytes: &[u8],
        config: &BertConfig,
        precision: Precision,
    ) -> Result<Self, String> {
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let prefix = if tensors
            .tensor("bert.embeddings.word_embeddings.weight")
            .is_ok()
        {
            "bert."
        } else {
            ""
        };
        let w = Weights { tensors, prefix };
        let (h, i) = (config.hidden_size, config.intermediate_size);
        if config.num_attention_heads == 0 || h % config.num_attention_heads != 0 {
            return Err(format!(
                "hidden size {h} is not a multiple of {} heads",
                config.num_attention_heads
            ));
        }
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = |s: &str| format!("encoder.layer.{l}.{s}");
            let mut qkv_w = w.get(&p("attention.self.query.weight"), h * h)?;
            qkv_w.extend(w.get(&p("attention.self.key.weight"), h * h)?);
            qkv_w.extend(w.get(&p("attention.self.value.weight"), h * h)?);
            let mut qkv_b = w.get(&p("attention.self.query.bias"), h)?;
            qkv_b.extend(w.get(&p("attention.self.key.bias"), h)?);
            qkv_b.extend(w.get(&p("attention.self.value.bias"), h)?);
            let dense = |name: &str, n: usize, k: usize| -> Result<Dense, String> {
                Ok(Dense::new(
                    w.get(&p(&format!("{name}.weight")), n * k)?,
                    w.get(&p(&format!("{name}.bias")), n)?,
                    n,
                    k,
                    precision,
                ))
            };
            layers.push(Layer {
                qkv: Dense::new(qkv_w, qkv_b, 3 * h, h, precision),
                attn_out: dense("attention.output.dense", h, h)?,
                ln1_g: w.get(&p("attention.output.LayerNorm.weight"), h)?,
                ln1_b: w.get(&p("attention.output.LayerNorm.bias"), h)?,
                inter: dense("intermediate.dense", i, h)?,
                out: dense("output.dense", h, i)?,
                ln2_g: w.get(&p("output.LayerNorm.weight"), h)?,
                ln2_b: w.get(&p("output.LayerNorm.bias"), h)?,
            });
        }
        let token_types = w.get(
            "embeddings.token_type_embeddings.weight",
            config.type_vocab_size * h,
        )?;
        Ok(Self {
            hidden: h,
            heads: config.num_attention_heads,
            max_pos: config.max_position_embeddings,
            eps: config.layer_norm_eps as f32,
            word: w.get("embeddings.word_embeddings.weight", config.vocab_size * h)?,
            pos: w.get(
                "embeddings.position_embeddings.weight",
                config.max_position_embeddings * h,
            )?,
            token_type0: token_types[..h].to_vec(),
            emb_ln_g: w.get("embeddings.LayerNorm.weight", h)?,
            emb_ln_b: w.get("embeddings.LayerNorm.bias", h)?,
            layers,
        })
    }

    /// Mean-pooled (not normalised) hidden states, one row per sequence.
    pub(super) fn forward(&self, seqs: &[&[u32]]) -> Result<Vec<f32>, String> {
        let h = self.hidden;
        let x = self.hidden_states(seqs)?;
        // Mean pooling over each sequence's tokens.
        let mut pooled = vec![0.0f32; seqs.len() * h];
        let mut start = 0;
        for (r, s) in seqs.iter().enumerate() {
            let dst = &mut pooled[r * h..(r + 1) * h];
            for t in start..start + s.len() {
                add_assign(dst, &x[t * h..(t + 1) * h]);
            }
            let n = (s.len() as f32).max(1e-9);
            for v in dst.iter_mut() {
                *v /= n;
            }
            start += s.len();
        }
        Ok(pooled)
    }

    /// The hidden size.
    pub(super) fn hidden(&self) -> usize {
        self.hidden
    }

    /// The word embeddings (`vocab × hidden`), which a masked-LM head's
    /// decoder shares.
    pub(super) fn word_embeddings(&self) -> &[f32] {
        &self.word
    }

    /// The last layer's hidden state of every token, the sequences'
    /// tokens concatenated (`Σ len × hidden`).
    pub(super) fn hidden_states(&self, seqs: &[&[u32]]) -> Result<Vec<f32>, String> {
        let h = self.hidden;
        let dh = h / self.heads;
        let total: usize = seqs.iter().map(|s| s.len()).sum();
        let longest = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        if longest > self.max_pos {
            return Err(format!(
                "a sequence of {longest} tokens exceeds the model's {} positions",
                self.max_pos
            ));
        }
        let vocab = self.word.len() / h;
        // Embeddings: word + position + token type 0, then layer norm.
        let mut x = vec![0.0f32; total * h];
        let mut t = 0;
        for s in seqs {
            for (p, &id) in s.iter().enumerate() {
                let id = id as usize;
                if id >= vocab {
                    return Err(format!("token id {id} outside the vocabulary of {vocab}"));
                }
                let row = &mut x[t * h..(t + 1) * h];
                row.copy_from_slice(&self.word[id * h..(id + 1) * h]);
                add_assign(row, &self.pos[p * h..(p + 1) * h]);
                add_assign(row, &self.token_type0);
                t += 1;
            }
        }
        layer_norm(&mut x, &self.emb_ln_g, &self.emb_ln_b, self.eps);

        let mut qkv = vec![0.0f32; total * 3 * h];
        let mut ctx = vec![0.0f32; total * h];
        let mut attn = vec![0.0f32; total * h];
        let mut inter = Intermediate::default();
        // A sequence's scores, each row padded to a multiple of 16 with
        // -inf (per head, below) so the softmax runs without a scalar tail;
        // the product with V never reads the padding.
        let mut scores = vec![0.0f32; longest * longest.next_multiple_of(16)];
        let scale = 1.0 / (dh as f32).sqrt();
        for layer in &self.layers {
            layer.qkv.apply(&mut qkv, &x, total);
            let mut start = 0;
            for s in seqs {
                let len = s.len();
                if len == 0 {
                    continue;
                }
                let base = start * 3 * h;
                let padded = len.next_multiple_of(16);
                let sc = &mut scores[..len * padded];
                for head in 0..self.heads {
                    let q = MatRef::new(&qkv[base + head * dh..], len, dh, 3 * h, 1);
                    let k = MatRef::new(&qkv[base + h + head * dh..], len, dh, 3 * h, 1);
                    let v = MatRef::new(&qkv[base + 2 * h + head * dh..], len, dh, 3 * h, 1);
                    matmul(MatMut::new(sc, len, len, padded, 1), q, k.t(), false);
                    // Again per head: the last head's softmax overwrote them.
                    for row in sc.chunks_exact_mut(padded) {
                        row[len..].fill(f32::NEG_INFINITY);
                    }
                    softmax_rows_scaled(sc, padded, scale);
                    matmul(
                        MatMut::new(&mut ctx[start * h + head * dh..], len, dh, h, 1),
                        MatRef::new(sc, len, len, padded, 1),
                        v,
                        false,
                    );
                }
                start += len;
            }
            layer.attn_out.apply(&mut attn, &ctx, total);
            add_layer_norm(&mut attn, &x, &layer.ln1_g, &layer.ln1_b, self.eps);
            layer
                .inter
                .feed_forward(&layer.out, &mut x, &attn, total, &mut inter);
            add_layer_norm(&mut x, &attn, &layer.ln2_g, &layer.ln2_b, self.eps);
        }
        Ok(x)
    }
}

/// A BERT masked-LM head (`cls.predictions`): dense + GELU + layer norm,
/// then the decoder, whose weights are the word embeddings (tied).
pub(super) struct MlmHead {
    dense_w: Vec<f32>,
    dense_b: Vec<f32>,
    ln_g: Vec<f32>,
    ln_b: Vec<f32>,
    /// The decoder's bias, one per vocabulary entry.
    pub(super) bias: Vec<f32>,
    eps: f32,
}

impl MlmHead {
    /// Loads `cls.predictions.*` from the same safetensors file as `bert`.
    pub(super) fn load(bytes: &[u8], bert: &NativeBert, eps: f32) -> Result<Self, String> {
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let w = Weights {
            tensors,
            prefix: "",
        };
        let h = bert.hidden;
        let vocab = bert.word.len() / h;
        let bias = w
            .get("cls.predictions.bias", vocab)
            .or_else(|_| w.get("cls.predictions.decoder.bias", vocab))?;
        Ok(Self {
            dense_w: w.get("cls.predictions.transform.dense.weight", h * h)?,
            dense_b: w.get("cls.predictions.transform.dense.bias", h)?,
            ln_g: w.get("cls.predictions.transform.LayerNorm.weight", h)?,
            ln_b: w.get("cls.predictions.transform.LayerNorm.bias", h)?,
            bias,
            eps,
        })
    }

    /// The head's transform of `x` (`t × hidden`), before the decoder.
    pub(super) fn transform(&self, x: &[f32], t: usize) -> Vec<f32> {
        let h = self.dense_b.len();
        let mut out = vec![0.0f32; t * h];
        linear(&mut out, x, &self.dense_w, &self.dense_b, t, h, h);
        gelu_erf(&mut out);
        layer_norm(&mut out, &self.ln_g, &self.ln_b, self.eps);
        out
    }
}
