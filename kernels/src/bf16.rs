//! bf16 Linear layers on AMX tiles: the embedder's fastest path on CPUs that
//! have AMX (Intel Xeon 4th generation and later).
//!
//! [`Bf16Linear`] holds a Linear layer's weights (`out = x · wᵀ + bias`,
//! PyTorch's layout: `w` is `n × k`) rounded once to bf16 (round to nearest
//! even) and packed as AMX B tiles. A call rounds its activations to bf16
//! the same way and multiplies on the tiles with `tdpbf16ps`, which sums the
//! exact products in f32; the bias is the accumulators' starting value. This
//! is the arithmetic of PyTorch's `torch.autocast("cpu", dtype=bfloat16)`
//! for a Linear layer.
//!
//! Tiles: a C tile is 16 rows × 16 f32, an A tile 16 rows × 32 bf16 (of
//! `k`), a B tile 16 pairs of `k` × 16 outputs × 2 bf16 (the "VNNI" layout:
//! for each pair of inputs, the 16 outputs' pairs side by side). The
//! micro-kernel keeps 2 × 2 C tiles (32 rows × 32 outputs), loads two A and
//! two B tiles per 32 inputs and issues four `tdpbf16ps` (16 × 16 × 32
//! products each). `k` and `n` are padded to multiples of 32 with zeros;
//! rows to a multiple of 32 in a scratch copy of the activations. Weights
//! and activation tiles start on a cache line (`aligned.rs`), so each
//! 64-byte tile row is one line.
//!
//! A feed-forward block's two layers can skip the f32 activations between
//! them: [`Bf16Linear::forward_gelu_packed`] applies GELU to each 32 × 32
//! block of outputs in L1 and writes it as the next layer's A tiles
//! ([`Bf16Rows`]), which [`Bf16Linear::forward_packed`] multiplies.
//!
//! Where AMX is missing or Linux refuses it ([`amx_available`]), callers
//! choose another path. [`Bf16Linear::forward_scalar`] computes the same
//! products without AMX: the reference the tiles are tested against.

use crate::aligned::Aligned;
use crate::amx::Amx;

/// Inputs per tile row (32 bf16 = 64 bytes).
const KT: usize = 32;
/// Rows and outputs per tile.
const TT: usize = 16;
/// Rows and outputs per micro-kernel block (2 × 2 tiles).
const BLOCK: usize = 2 * TT;
/// bf16 values per packed tile.
const TILE: usize = TT * KT;

/// Whether this CPU and kernel run [`Bf16Linear::forward`] on AMX tiles
/// (see [`crate::amx::available`]).
pub fn amx_available() -> bool {
    crate::amx::available(Amx::Bf16)
}

/// `v` rounded to bf16, to nearest with ties to even (the `half` crate's
/// conversion, which the AVX-512 packing below reproduces).
fn to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

/// The f32 value of a bf16.
fn from_bf16(b: u16) -> f32 {
    half::bf16::from_bits(b).to_f32()
}

/// A Linear layer with bf16 weights packed for AMX (see the module docs).
#[derive(Debug, Clone)]
pub struct Bf16Linear {
    n: usize,
    k: usize,
    /// `k` padded to a multiple of [`KT`].
    kp: usize,
    /// `n` padded to a multiple of [`BLOCK`].
    np: usize,
    /// `[np / 16][kp / 32]` B tiles of [`TILE`] values; padding is zero.
    tiles: Aligned<u16>,
    /// Padded to `np` with zeros.
    bias: Aligned<f32>,
}

impl Bf16Linear {
    /// Rounds `w` (`n × k`, row-major) to bf16 and packs it.
    ///
    /// # Panics
    /// If the lengths disagree, or a weight is not finite.
    pub fn new(w: &[f32], bias: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are not {n} x {k}");
        assert_eq!(bias.len(), n, "bias is not {n} long");
        assert!(w.iter().all(|v| v.is_finite()), "a weight is not finite");
        let kp = k.div_ceil(KT) * KT;
        let np = n.div_ceil(BLOCK) * BLOCK;
        let kb = kp / KT;
        let mut tiles = Aligned::zeroed(np * kp);
        for j in 0..n {
            for p in 0..k {
                tiles[Self::slot(kb, j, p)] = to_bf16(w[j * k + p]);
            }
        }
        let mut padded = Aligned::zeroed(np);
        padded[..n].copy_from_slice(bias);
        Self {
            n,
            k,
            kp,
            np,
            tiles,
            bias: padded,
        }
    }

    /// Where output `j`, input `p` sits in the packed tiles: tile
    /// `(j / 16, p / 32)`, row `(p % 32) / 2`, column `j % 16`, half `p % 2`.
    fn slot(kb: usize, j: usize, p: usize) -> usize {
        ((j / TT) * kb + p / KT) * TILE + (p % KT) / 2 * (2 * TT) + (j % TT) * 2 + p % 2
    }

    /// Output channels.
    pub fn outputs(&self) -> usize {
        self.n
    }

    /// The weight of output `j`, input `p`, as the tiles hold it.
    pub fn weight(&self, j: usize, p: usize) -> f32 {
        from_bf16(self.tiles[Self::slot(self.kp / KT, j, p)])
    }

    /// `out = x · wᵀ + bias` for `x` of `t × k`, `out` of `t × n`, on AMX
    /// where [`amx_available`], else [`Self::forward_scalar`]. Both sum the
    /// same exact products in f32, in different orders.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward(&self, out: &mut [f32], x: &[f32], t: usize) {
        self.forward_of(out, x, t, Input::AsIs);
    }

    /// `out = gelu(x) · wᵀ + bias`, GELU applied to each input as it is
    /// rounded and packed: one pass over `x` instead of two. With AVX-512 the
    /// GELU is the 16-lane one (`nn::gelu512`, a few f32 ulps from
    /// [`crate::nn::gelu`]), so the result is `forward` on `gelu_erf(x)` to
    /// within a bf16 step of an input now and then (a test).
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward_gelu(&self, out: &mut [f32], x: &[f32], t: usize) {
        self.forward_of(out, x, t, Input::Gelu);
    }

    /// `gelu(x · wᵀ + bias)`, rounded to bf16 and laid out as the input
    /// of a next layer with `n` inputs, without the f32 output: a BERT
    /// block's first FFN layer feeding its second, whose products then come
    /// from [`Self::forward_packed`]. GELU and rounding run on each 32 × 32
    /// block of outputs while it is in L1, so the `t × n` f32 activations
    /// are neither written nor read back. The same values as [`Self::forward`]
    /// then [`Self::forward_gelu`] on AMX.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward_gelu_packed(&self, out: &mut Bf16Rows, x: &[f32], t: usize) {
        assert_eq!(x.len(), t * self.k, "input is not {t} x {}", self.k);
        let tp = t.div_ceil(BLOCK) * BLOCK;
        out.t = t;
        out.k = self.n;
        // np is n rounded up to 32 inputs: the next layer's padded width.
        out.tiles.resize(tp * self.np, 0);
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if amx_available() && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AMX with the tile permission (amx_available) and
            // AVX-512F; x holds t × k values (asserted above) and out.tiles
            // tp × np.
            unsafe {
                amx::forward(
                    self,
                    amx::Src::F32(x, t, Input::AsIs),
                    amx::Dst::GeluPacked(&mut out.tiles),
                )
            };
            return;
        }
        let mut y = vec![0.0f32; t * self.n];
        self.forward_scalar(&mut y, x, t);
        pack_rows(&y, t, self.n, tp, &mut out.tiles, Input::Gelu);
    }

    /// `out = rows · wᵀ + bias` for activations already rounded and packed
    /// by [`Self::forward_gelu_packed`].
    ///
    /// # Panics
    /// If `rows` does not have this layer's `k` inputs, or `out` is not
    /// `rows × n`.
    pub fn forward_packed(&self, out: &mut [f32], rows: &Bf16Rows) {
        let t = rows.t;
        assert_eq!(
            rows.k, self.k,
            "packed rows of {} inputs, the layer takes {}",
            rows.k, self.k
        );
        assert_eq!(out.len(), t * self.n, "output is not {t} x {}", self.n);
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if amx_available() {
            // SAFETY: as in forward_gelu_packed; rows.tiles holds the
            // t.div_ceil(32) · 32 × kp tiles forward_gelu_packed wrote.
            unsafe { amx::forward(self, amx::Src::Packed(&rows.tiles), amx::Dst::F32(out, t)) };
            return;
        }
        self.forward_scalar(out, &rows.unpack(), t);
    }

    fn forward_of(&self, out: &mut [f32], x: &[f32], t: usize, input: Input) {
        assert_eq!(x.len(), t * self.k, "input is not {t} x {}", self.k);
        assert_eq!(out.len(), t * self.n, "output is not {t} x {}", self.n);
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if amx_available() {
            // SAFETY: the CPU has AMX-TILE and AMX-BF16 and this process
            // holds the tile data permission (amx_available); x and out have
            // t × k and t × n values (asserted above).
            unsafe { amx::forward(self, amx::Src::F32(x, t, input), amx::Dst::F32(out, t)) };
            return;
        }
        match input {
            Input::AsIs => self.forward_scalar(out, x, t),
            Input::Gelu => {
                let x: Vec<f32> = x.iter().map(|&v| crate::nn::gelu(v)).collect();
                self.forward_scalar(out, &x, t);
            }
        }
    }

    /// The same products (bf16 activations × bf16 weights, exact in f32),
    /// summed in f64 and rounded once: the reference.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward_scalar(&self, out: &mut [f32], x: &[f32], t: usize) {
        assert_eq!(x.len(), t * self.k, "input is not {t} x {}", self.k);
        assert_eq!(out.len(), t * self.n, "output is not {t} x {}", self.n);
        let kb = self.kp / KT;
        for i in 0..t {
            let row: Vec<f64> = x[i * self.k..(i + 1) * self.k]
                .iter()
                .map(|&v| f64::from(from_bf16(to_bf16(v))))
                .collect();
            for j in 0..self.n {
                let acc: f64 = row
                    .iter()
                    .enumerate()
                    .map(|(p, a)| a * f64::from(from_bf16(self.tiles[Self::slot(kb, j, p)])))
                    .sum();
                out[i * self.n + j] = (acc + f64::from(self.bias[j])) as f32;
            }
        }
    }
}

/// Activations rounded to bf16 in the A-tile layout ([`pack_rows`]'s):
/// one layer's output handed to the next without an f32 copy
/// ([`Bf16Linear::forward_gelu_packed`], [`Bf16Linear::forward_packed`]).
/// Reusable: each call resizes it.
#[derive(Debug, Clone, Default)]
pub struct Bf16Rows {
    /// `[t / 16 rounded up to even][k / 32 rounded up]` tiles of 16 rows ×
    /// 32 inputs; padding rows and inputs zero.
    tiles: Aligned<u16>,
    t: usize,
    k: usize,
}

impl Bf16Rows {
    /// Empty; the first call sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.t
    }

    /// The values as `t × k` f32 (the scalar path's input).
    fn unpack(&self) -> Vec<f32> {
        let kb = self.k.div_ceil(KT);
        let mut x = vec![0.0f32; self.t * self.k];
        for i in 0..self.t {
            for p in 0..self.k {
                x[i * self.k + p] = from_bf16(
                    self.tiles[(i / TT) * kb * TILE + (p / KT) * TILE + (i % TT) * KT + p % KT],
                );
            }
        }
        x
    }
}

/// What a call does to its inputs before rounding them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    AsIs,
    Gelu,
}

/// Rounds the `t × k` rows of `x` (or their GELU) to bf16 and lays them out as A tiles in
/// `a`: `[tp / 16][k / 32 rounded up]` tiles of 16 rows × 32 inputs, rows
/// `t..tp` and inputs past `k` zero. In AVX-512 where the CPU has it; the
/// same values as [`to_bf16`] either way (GELU: see [`Bf16Linear::forward_gelu`]).
fn pack_rows(x: &[f32], t: usize, k: usize, tp: usize, a: &mut [u16], input: Input) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked on the line above.
        return unsafe { simd::pack_rows(x, t, k, tp, a, input) };
    }
    pack_rows_body(x, t, k, tp, a, |src, dst| {
        for (d, &v) in dst.iter_mut().zip(src) {
            *d = to_bf16(match input {
                Input::AsIs => v,
                Input::Gelu => crate::nn::gelu(v),
            });
        }
    });
}

/// [`pack_rows`] with `round` converting one run of at most 32 values.
#[inline(always)]
fn pack_rows_body(
    x: &[f32],
    t: usize,
    k: usize,
    tp: usize,
    a: &mut [u16],
    mut round: impl FnMut(&[f32], &mut [u16]),
) {
    let kb = k.div_ceil(KT);
    for i in 0..tp {
        let base = (i / TT) * kb * TILE + (i % TT) * KT;
        let src = if i < t {
            &x[i * k..(i + 1) * k]
        } else {
            &[][..]
        };
        for c in 0..kb {
            let dst = &mut a[base + c * TILE..base + c * TILE + KT];
            let run = &src[(c * KT).min(src.len())..((c + 1) * KT).min(src.len())];
            round(run, &mut dst[..run.len()]);
            dst[run.len()..].fill(0);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Input, KT, TILE, TT};
    use crate::nn::gelu512::gelu16;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn pack_rows(
        x: &[f32],
        t: usize,
        k: usize,
        tp: usize,
        a: &mut [u16],
        input: Input,
    ) {
        let gelu = input == Input::Gelu;
        let kb = k.div_ceil(KT);
        // Whole runs of 16 values in a row; the rest of the row (under 16
        // values) is rounded one by one, and a tile row's inputs past `k`
        // are zero.
        let whole = k / 16;
        for i in 0..tp {
            let base = (i / TT) * kb * TILE + (i % TT) * KT;
            if i >= t {
                for c in 0..kb {
                    a[base + c * TILE..base + c * TILE + KT].fill(0);
                }
                continue;
            }
            let src = &x[i * k..(i + 1) * k];
            for h in 0..whole {
                // Run h is inputs 16h..16h + 16: tile column h / 2, half h % 2.
                let at = base + (h / 2) * TILE + (h % 2) * 16;
                let run = &src[h * 16..h * 16 + 16];
                let dst = &mut a[at..at + 16];
                // SAFETY: AVX-512F (this function's contract); `run` holds
                // 16 f32 and `dst` 16 u16.
                unsafe {
                    let v = _mm512_loadu_ps(run.as_ptr());
                    let v = if gelu { gelu16(v) } else { v };
                    round16(v, dst);
                }
            }
            // The last run of under 16 values, loaded under a mask (GELU
            // the same 16-lane one as every other value), then zeros to the
            // end of the row's last tile column.
            let rest = k - whole * 16;
            if rest > 0 {
                let mut r = [0u16; 16];
                // SAFETY: AVX-512F (this function's contract); the masked
                // load reads only the `rest` values left in `src`.
                unsafe {
                    let v = _mm512_maskz_loadu_ps((1u16 << rest) - 1, src.as_ptr().add(whole * 16));
                    round16(if gelu { gelu16(v) } else { v }, &mut r);
                }
                for (j, &b) in r[..rest].iter().enumerate() {
                    let p = whole * 16 + j;
                    a[base + (p / KT) * TILE + p % KT] = b;
                }
            }
            for p in k..kb * KT {
                a[base + (p / KT) * TILE + p % KT] = 0;
            }
        }
    }

    /// GELU of 32 values ([`gelu16`]), rounded to bf16.
    ///
    /// # Safety
    /// AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn gelu_round(src: &[f32], dst: &mut [u16]) {
        assert!(src.len() >= 32 && dst.len() >= 32);
        for h in 0..2 {
            // SAFETY: AVX-512F (this function's contract); 16 values each
            // side from 16h (asserted above).
            unsafe {
                let v = _mm512_loadu_ps(src.as_ptr().add(16 * h));
                round16(gelu16(v), &mut dst[16 * h..]);
            }
        }
    }

    /// 16 values to bf16: `bits + 0x7fff + ((bits >> 16) & 1)`, then
    /// `>> 16` (to nearest, ties to even); NaN keeps its top bits, made quiet.
    ///
    /// # Safety
    /// AVX-512F; `dst` holds at least 16 values.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn round16(v: __m512, dst: &mut [u16]) {
        debug_assert!(dst.len() >= 16);
        let bits = _mm512_castps_si512(v);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        let r = _mm512_mask_blend_epi32(nan, rounded, quiet);
        let h = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(r));
        // SAFETY: 16 values (this function's contract).
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), h) };
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use std::cell::Cell;

    use super::{BLOCK, Bf16Linear, Input, KT, TILE, TT, pack_rows};
    use crate::aligned::Aligned;
    use crate::amx::{Config, release, tile_dot, tile_load, tile_store};

    thread_local! {
        /// Each thread's activation tiles and partial-block outputs, reused
        /// between calls.
        static BUFFERS: Cell<(Aligned<u16>, Vec<f32>)> = const { Cell::new((Aligned::new(), Vec::new())) };
    }

    /// Where a call's activations come from.
    pub(super) enum Src<'a> {
        /// `t × k` f32 rows, rounded and packed here (`Input` first).
        F32(&'a [f32], usize, Input),
        /// Rows packed already ([`super::Bf16Rows`]'s tiles, `k` inputs).
        Packed(&'a [u16]),
    }

    /// Where its outputs go.
    pub(super) enum Dst<'a> {
        /// `t × n` f32.
        F32(&'a mut [f32], usize),
        /// GELU of each output, rounded and packed as A tiles of a layer
        /// with `np` inputs (`tp × np` values).
        GeluPacked(&'a mut [u16]),
    }

    /// A 32 × 32 block of outputs, 32 f32 per row, on one cache line each
    /// pair of 16.
    #[repr(C, align(64))]
    struct Block([f32; BLOCK * BLOCK]);

    /// # Safety
    /// The CPU must have AMX-TILE and AMX-BF16, with the tile data
    /// permission granted to this process. `Src::F32` holds `t × k` values
    /// and `Dst::F32` `t × n`; `Src::Packed` holds the `tp × kp` tiles of
    /// the same `t` rows ([`super::Bf16Rows`]), and `Dst::GeluPacked` has
    /// room for `tp × np`, where `tp` is `t` rounded up to 32.
    pub(super) unsafe fn forward(layer: &Bf16Linear, src: Src<'_>, dst: Dst<'_>) {
        let (n, k, kp, np) = (layer.n, layer.k, layer.kp, layer.np);
        let kb = kp / KT;
        // The activations in bf16, packed as A tiles: `[tp / 16][kb]` tiles
        // of 16 rows × 32 inputs, so every tile load reads 1 KiB in a row.
        // Padding rows and inputs are zero. The buffers are this thread's,
        // kept between calls: fresh ones per call cost more than the
        // products (page faults and zeroing of a few MB).
        let (mut buffer, mut scratch) = BUFFERS.take();
        let (a, t): (&[u16], usize) = match src {
            Src::F32(x, t, input) => {
                let tp = t.div_ceil(BLOCK) * BLOCK;
                if buffer.len() < tp * kp {
                    buffer.resize(tp * kp, 0);
                }
                pack_rows(x, t, k, tp, &mut buffer, input);
                (&buffer, t)
            }
            Src::Packed(tiles) => (tiles, tiles.len() / kp),
        };
        let tp = t.div_ceil(BLOCK) * BLOCK;
        // Raw pointers, taken once: the tiles store through them.
        let (out, packed, t) = match dst {
            Dst::F32(out, rows) => (out.as_mut_ptr(), std::ptr::null_mut(), rows),
            Dst::GeluPacked(packed) => (std::ptr::null_mut(), packed.as_mut_ptr(), t),
        };
        let to_f32 = packed.is_null();
        let mut block = Block([0.0; BLOCK * BLOCK]);
        let block = block.0.as_mut_ptr();
        let config = Config::full();
        let stride = 2 * KT;
        // SAFETY: for every asm statement below: the CPU runs AMX with the
        // tile permission (this function's contract) and the configuration
        // gives every tile 16 rows of 64 bytes. Each load reads 16 rows of
        // 64 bytes: an A tile (1 KiB in a row) inside `a` (tp / 16 × kb
        // tiles), a B tile inside `tiles` (np / 16 × kb tiles), or the bias
        // row with stride 0 (16 values from jb + 16 ≤ np). Each store writes
        // 16 rows of 16 f32 at `ld` values apart into `dst`: `out` rows
        // ib..ib+32 (a full block and np == n), `scratch` (32 rows of np
        // values), columns jb..jb+32 ≤ np, or `block` (32 rows of 32).
        // GELU and rounding read `block` after its stores and write one
        // tile row of 32 values inside `packed` (tp × np: row i < tp, tile
        // column jb / 32 < np / 32), on a CPU with AVX-512F (every AMX CPU;
        // checked by the callers of `Dst::GeluPacked`).
        unsafe {
            config.load();
            for ib in (0..tp).step_by(BLOCK) {
                let full = ib + BLOCK <= t && np == n;
                let (dst, ld) = if !to_f32 {
                    (block, BLOCK)
                } else if full {
                    (out.add(ib * n), n)
                } else {
                    if scratch.len() < BLOCK * np {
                        scratch.resize(BLOCK * np, 0.0f32);
                    }
                    (scratch.as_mut_ptr(), np)
                };
                let row_bytes = 4 * ld;
                let a0 = a.as_ptr().add((ib / TT) * kb * TILE);
                let a1 = a0.add(kb * TILE);
                for jb in (0..np).step_by(BLOCK) {
                    let bias = layer.bias.as_ptr().add(jb);
                    tile_load!("0", bias, 0usize);
                    tile_load!("1", bias.add(TT), 0usize);
                    tile_load!("2", bias, 0usize);
                    tile_load!("3", bias.add(TT), 0usize);
                    let b0 = layer.tiles.as_ptr().add((jb / TT) * kb * TILE);
                    let b1 = b0.add(kb * TILE);
                    for c in 0..kb {
                        tile_load!("4", a0.add(c * TILE), stride);
                        tile_load!("6", b0.add(c * TILE), stride);
                        tile_dot!("tdpbf16ps", "0", "4", "6");
                        tile_load!("7", b1.add(c * TILE), stride);
                        tile_dot!("tdpbf16ps", "1", "4", "7");
                        tile_load!("5", a1.add(c * TILE), stride);
                        tile_dot!("tdpbf16ps", "2", "5", "6");
                        tile_dot!("tdpbf16ps", "3", "5", "7");
                    }
                    let at = if to_f32 { jb } else { 0 };
                    tile_store!("0", dst.add(at), row_bytes);
                    tile_store!("1", dst.add(at + TT), row_bytes);
                    tile_store!("2", dst.add(TT * ld + at), row_bytes);
                    tile_store!("3", dst.add(TT * ld + at + TT), row_bytes);
                    if !to_f32 {
                        // Output columns jb..jb + 32 are the next layer's
                        // tile column jb / 32; rows past t stay zero.
                        let next_kb = np / KT;
                        for r in 0..BLOCK {
                            let i = ib + r;
                            let to = (i / TT) * next_kb * TILE + (jb / KT) * TILE + (i % TT) * KT;
                            let row = std::slice::from_raw_parts_mut(packed.add(to), KT);
                            if i < t {
                                let c = std::slice::from_raw_parts(block.add(r * BLOCK), BLOCK);
                                super::simd::gelu_round(c, row);
                            } else {
                                row.fill(0);
                            }
                        }
                    }
                }
                if to_f32 && !full {
                    for r in 0..t.saturating_sub(ib).min(BLOCK) {
                        std::ptr::copy_nonoverlapping(
                            scratch.as_ptr().add(r * np),
                            out.add((ib + r) * n),
                            n,
                        );
                    }
                }
            }
            release();
        }
        BUFFERS.set((buffer, scratch));
    }
}

#[cfg(test)]
mod tests;
