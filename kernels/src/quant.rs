//! Integer Linear layers on AVX-512 VNNI: the embedder's reduced-precision
//! paths.
//!
//! One packed layout and one micro-kernel serve two formats ([`Format`]):
//!
//! - [`Format::Int16`]: weights and activations in 16-bit integers, summed by
//!   `vpdpwssd` (two products per 32-bit lane). The value range is cut so that
//!   no sum can overflow `i32`: `k · a_max · w_max < 2³¹` (±2,364 for k = 384,
//!   ±1,182 for k = 1,536: 11 to 12 bits and a sign, against int8's 7).
//! - [`Format::Int8`]: `u8` activations × `i8` weights, summed by `vpdpbusd`
//!   (four products per lane): twice int16's rate, a coarser result.
//!
//! In both, **weights** are quantised once, per output channel and
//! symmetric: `w[j][p] ≈ s_w[j] · q[j][p]`, and packed in blocks of [`NR`]
//! output channels; inside a block, for each group of inputs that fills
//! 4 bytes (two i16 or four i8), the channels' groups side by side, so one
//! 64-byte load is the operand for 16 channels. **Activations** are quantised
//! per row (per token) when the layer runs: int16 symmetric
//! (`x ≈ s[i] · q[i][p]`), int8 asymmetric (`x ≈ m[i] + s[i] · u[i][p]`,
//! `u` in `0..=255`, `m` the row's minimum). **Accumulation** is exact in
//! `i32`, then `out[i][j] = s_w[j] · (s[i] · acc[i][j] + m[i] · Σ_p q[j][p]) +
//! bias[j]` in f32 (`m = 0` for int16).
//!
//! Measured on an Intel Xeon (Emerald Rapids; AMX not exposed to the guest),
//! one core, register-resident loops of zmm instructions: `vfmadd231ps` 5.3 G/s
//! (169 GFLOP/s), `vdpbf16ps` 1.3 G/s (84 GFLOP/s: half the f32 rate, so bf16
//! is no gain on this CPU), `vpdpwssd` 5.7 G/s (366 G op/s, 2.2×), `vpdpbusd`
//! 5.5 G/s (707 G op/s, 4.2×).
//!
//! The VNNI kernel's loops (`vnni::forward_as`): rows in blocks whose
//! activations fit `ROWS_BYTES` (kept in L2 while every block of [`NR`]
//! channels passes over them), inputs in chunks of `KC` groups (the
//! chunk's slice of a weight block, 36 KiB, stays in L1), and `MR` × NR
//! tiles of `i32` sums in 24 zmm registers. The last chunk's sums go from
//! registers through the epilogue (scales, bias, GELU for a feed-forward
//! block's first layer) straight to the f32 output. Measured on an Intel
//! Xeon with AMX (lscpu model 167; `vpdpwssd` 411 G op/s per core against
//! `vfmadd231ps` 226 GFLOP/s, 1.82×), one thread, the embedder's shapes at
//! t = 1,184: 275 → 300 – 330 G op/s (73 – 80% of the instruction's rate;
//! 1.7 – 1.9× gemm's f32) with those loops, from a chunk of 128 groups, no
//! row blocks and the sums stored and reloaded for a separate epilogue
//! (`quant::tests::timing`).
//!
//! [`QuantLinear::forward_scalar`] computes the same integers without SIMD:
//! the reference the VNNI kernel is tested against.

use crate::aligned::Aligned;

/// Output channels per packed block (three zmm registers of `i32`).
pub const NR: usize = 48;
/// Rows per micro-kernel call.
const MR: usize = 8;
/// 4-byte groups per chunk: the chunk's slice of a block (36 KiB) stays in
/// L1, and k = 384 in int16 is one chunk (192 beat 96, 128 and 256 here).
const KC: usize = 192;
/// Bytes of activations per block of rows, kept in L2 (256 KiB beat 512 KiB
/// and 1 MiB here).
const ROWS_BYTES: usize = 256 << 10;
/// Zero bytes after the packed weights (see `QuantLinear::new`).
const AMX_SLACK: usize = 15 * NR * 4;

/// Whether this CPU runs [`QuantLinear::forward`] on VNNI (else it runs the
/// scalar reference, correct but slow: callers choose f32 then).
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What runs [`Format::Int8`] layers on this CPU: `"amx"` (AMX-INT8 tiles),
/// `"vnni"` (AVX-512 VNNI) or `"scalar"` (the reference).
pub fn int8_unit() -> &'static str {
    if int8_on_amx() {
        "amx"
    } else if vnni_available() {
        "vnni"
    } else {
        "scalar"
    }
}

/// Whether [`Format::Int8`] runs on AMX-INT8 tiles: AMX granted, and
/// AVX-512 (VNNI's checks) for the shared epilogue.
fn int8_on_amx() -> bool {
    crate::amx::available(crate::amx::Amx::Int8) && vnni_available()
}

/// The integer format of a [`QuantLinear`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `i16 × i16` (`vpdpwssd`), ranges cut so `i32` sums cannot overflow.
    Int16,
    /// `u8 × i8` (`vpdpbusd`).
    Int8,
}

impl Format {
    /// Inputs per 4-byte group.
    fn per_group(self) -> usize {
        match self {
            Self::Int16 => 2,
            Self::Int8 => 4,
        }
    }

    /// The largest weight and the largest activation magnitude for `k`
    /// inputs: for int16, `k · a · w < 2³¹` holds.
    fn limits(self, k: usize) -> (f32, f32) {
        match self {
            Self::Int16 => {
                let l = (((1u64 << 31) - 1) as f64 / k.max(1) as f64)
                    .sqrt()
                    .floor()
                    .min(32_767.0) as f32;
                (l, l)
            }
            Self::Int8 => (127.0, 255.0),
        }
    }
}

/// A Linear layer (`out = x · wᵀ + bias`, PyTorch's layout: `w` is `n × k`)
/// with integer weights.
#[derive(Debug, Clone)]
pub struct QuantLinear {
    format: Format,
    n: usize,
    k: usize,
    /// 4-byte groups per row: `k.div_ceil(format.per_group())`.
    groups: usize,
    /// `[n.div_ceil(NR)][groups][NR][4 bytes]`, then [`AMX_SLACK`] bytes;
    /// padding is zero.
    packed: Aligned<u8>,
    /// Per output channel, padded to whole blocks with zeros.
    scale: Vec<f32>,
    /// `Σ_p q[j][p]` as f32, padded (only int8's asymmetric activations use it).
    col_sum: Vec<f32>,
    bias: Vec<f32>,
    /// The largest activation magnitude (int16) or code (int8).
    a_max: f32,
}

/// Activations of one call, quantised per row.
#[derive(Default)]
struct Quantised {
    /// `t` rows of `groups · 4` bytes (i16 little-endian or u8), padding zero.
    bytes: Vec<u8>,
    scale: Vec<f32>,
    /// Each row's offset (int8's minimum; 0 for int16).
    min: Vec<f32>,
}

impl Quantised {
    const fn empty() -> Self {
        Self {
            bytes: Vec::new(),
            scale: Vec::new(),
            min: Vec::new(),
        }
    }
}

impl QuantLinear {
    /// Quantises `w` (`n × k`, row-major) per output channel.
    ///
    /// # Panics
    /// If the lengths disagree, or a weight is not finite.
    pub fn new(format: Format, w: &[f32], bias: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "weights are not {n} x {k}");
        assert_eq!(bias.len(), n, "bias is not {n} long");
        assert!(w.iter().all(|v| v.is_finite()), "a weight is not finite");
        let groups = k.div_ceil(format.per_group());
        let blocks = n.div_ceil(NR);
        let (_, a_max) = format.limits(k);
        // AMX_SLACK zero bytes past the last block: the AMX path's last
        // B tiles may read up to 15 groups past the end (multiplied by
        // zero activations).
        let mut layer = Self {
            format,
            n,
            k,
            groups,
            packed: Aligned::zeroed(blocks * groups * NR * 4 + AMX_SLACK),
            scale: vec![0.0f32; blocks * NR],
            col_sum: vec![0.0f32; blocks * NR],
            bias: bias.to_vec(),
            a_max,
        };
        for j in 0..n {
            layer.write_row(j, &w[j * k..(j + 1) * k]);
        }
        layer
    }

    /// Quantises `row` into output channel `j`'s codes, scale and code sum.
    fn write_row(&mut self, j: usize, row: &[f32]) {
        let (w_max, _) = self.format.limits(self.k);
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = if amax > 0.0 { amax / w_max } else { 1.0 };
        self.scale[j] = s;
        let per = self.format.per_group();
        let mut sum = 0i64;
        for (p, v) in row.iter().enumerate() {
            let q = (v / s).round().clamp(-w_max, w_max) as i32;
            sum += i64::from(q);
            let at = self.lane(j, p / per);
            match self.format {
                Format::Int16 => {
                    let o = at + (p % 2) * 2;
                    self.packed[o..o + 2].copy_from_slice(&(q as i16).to_le_bytes());
                }
                Format::Int8 => self.packed[at + p % 4] = q as i8 as u8,
            }
        }
        self.col_sum[j] = sum as f32;
    }

    /// Where output channel `j`'s 4-byte group `g` sits in `packed`.
    fn lane(&self, j: usize, g: usize) -> usize {
        (j / NR) * self.groups * NR * 4 + g * NR * 4 + (j % NR) * 4
    }

    /// Replaces output channel `j`'s weights (`k` values) with `row`: the
    /// layer is then the one [`QuantLinear::new`] builds from the changed
    /// matrix, byte for byte. Row-wise changes are what an index over a
    /// changing corpus needs ([`crate::ivf::IvfKernel`]'s int8 lists).
    ///
    /// # Panics
    /// If `j` is out of range, `row` is not `k` long, or a value is not finite.
    pub fn set_row(&mut self, j: usize, row: &[f32]) {
        assert!(j < self.n, "output {j} of {}", self.n);
        assert_eq!(row.len(), self.k, "row is not {} long", self.k);
        assert!(row.iter().all(|v| v.is_finite()), "a weight is not finite");
        self.write_row(j, row);
    }

    /// Appends an output channel with weights `row` and `bias`.
    ///
    /// # Panics
    /// As [`QuantLinear::set_row`].
    pub fn push_row(&mut self, row: &[f32], bias: f32) {
        let j = self.n;
        if j == self.scale.len() {
            // A new block of zeros; the slack after it stays zero.
            let block = self.groups * NR * 4;
            self.packed.resize(self.packed.len() + block, 0);
            self.scale.resize(self.scale.len() + NR, 0.0);
            self.col_sum.resize(self.col_sum.len() + NR, 0.0);
        }
        self.n += 1;
        self.bias.push(bias);
        self.set_row(j, row);
    }

    /// Removes output channel `j`, moving the last one into its place (as
    /// `Vec::swap_remove` does with the rows).
    ///
    /// # Panics
    /// If `j` is out of range.
    pub fn swap_remove_row(&mut self, j: usize) {
        assert!(j < self.n, "output {j} of {}", self.n);
        let last = self.n - 1;
        for g in 0..self.groups {
            let (from, to) = (self.lane(last, g), self.lane(j, g));
            if from != to {
                self.packed.copy_within(from..from + 4, to);
            }
            self.packed[from..from + 4].fill(0);
        }
        self.scale.swap(j, last);
        self.col_sum.swap(j, last);
        self.scale[last] = 0.0;
        self.col_sum[last] = 0.0;
        self.bias.swap_remove(j);
        self.n = last;
        let blocks = self.n.div_ceil(NR);
        if blocks * NR < self.scale.len() {
            // The dropped block is all zeros now, as the slack is.
            self.packed
                .truncate(blocks * self.groups * NR * 4 + AMX_SLACK);
            self.scale.truncate(blocks * NR);
            self.col_sum.truncate(blocks * NR);
        }
    }

    /// Output channels.
    pub fn outputs(&self) -> usize {
        self.n
    }

    /// Bytes held (weights, scales, sums, bias).
    pub fn bytes(&self) -> usize {
        self.packed.len() + 4 * (self.scale.len() + self.col_sum.len() + self.bias.len())
    }

    /// The weight of output `j`, input `p`, as the kernel sees it (dequantised).
    pub fn weight(&self, j: usize, p: usize) -> f32 {
        self.code(j, p) as f32 * self.scale[j]
    }

    /// The integer weight of output `j`, input `p`.
    fn code(&self, j: usize, p: usize) -> i32 {
        let per = self.format.per_group();
        let at = (j / NR) * self.groups * NR * 4 + (p / per) * NR * 4 + (j % NR) * 4;
        match self.format {
            Format::Int16 => {
                let o = at + (p % 2) * 2;
                i32::from(i16::from_le_bytes([self.packed[o], self.packed[o + 1]]))
            }
            Format::Int8 => i32::from(self.packed[at + p % 4] as i8),
        }
    }

    /// `out = x · wᵀ + bias` for `x` of `t × k`, `out` of `t × n`, on VNNI
    /// where the CPU has it, else [`Self::forward_scalar`]. Both compute the
    /// same integers; the f32 epilogue may differ in the last bit (FMA).
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward(&self, out: &mut [f32], x: &[f32], t: usize) {
        self.forward_then(out, x, t, false);
    }

    /// `out = gelu(x · wᵀ + bias)` (exact-erf GELU): a BERT block's first
    /// feed-forward layer. On VNNI the GELU runs in the epilogue, on each
    /// 16 outputs while they are in registers (`nn::gelu512::gelu16`, within
    /// a few ulps of [`crate::nn::gelu`]); elsewhere after the layer.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward_gelu(&self, out: &mut [f32], x: &[f32], t: usize) {
        self.forward_then(out, x, t, true);
    }

    fn forward_then(&self, out: &mut [f32], x: &[f32], t: usize, gelu: bool) {
        assert_eq!(x.len(), t * self.k, "input is not {t} x {}", self.k);
        assert_eq!(out.len(), t * self.n, "output is not {t} x {}", self.n);
        if self.k == 0 {
            // No inputs: every row is the bias (the AMX path needs a group).
            for row in out.chunks_exact_mut(self.n.max(1)) {
                row.copy_from_slice(&self.bias);
            }
            if gelu {
                crate::nn::gelu_erf(out);
            }
            return;
        }
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if self.format == Format::Int8 && int8_on_amx() {
            let q = self.quantise(x, t);
            // SAFETY: the CPU has AMX-TILE and AMX-INT8 with the tile data
            // permission, and AVX-512F (checked just above); `q` is this
            // layer's quantisation of t rows and `out` holds t × n values
            // (asserted above).
            unsafe { amx_int8::forward(self, &q, out, t) };
            if gelu {
                crate::nn::gelu_erf(out);
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if vnni_available() {
            // This thread's quantised activations, kept between calls (fresh
            // ones cost a memset, or page faults, per layer).
            thread_local! {
                static ACTIVATIONS: std::cell::Cell<Quantised> = const {
                    std::cell::Cell::new(Quantised::empty())
                };
            }
            let mut q = ACTIVATIONS.take();
            self.quantise_into(x, t, &mut q);
            // SAFETY: the CPU has AVX-512F, AVX-512BW and AVX-512 VNNI (checked
            // by vnni_available); `q` is this layer's quantisation of t rows
            // and `out` holds t × n values (asserted above).
            unsafe { vnni::forward(self, &q, out, t, gelu) };
            ACTIVATIONS.set(q);
            return;
        }
        self.forward_scalar(out, x, t);
        if gelu {
            crate::nn::gelu_erf(out);
        }
    }

    /// The same computation in portable scalar code: the reference.
    ///
    /// # Panics
    /// If the lengths disagree.
    pub fn forward_scalar(&self, out: &mut [f32], x: &[f32], t: usize) {
        assert_eq!(x.len(), t * self.k, "input is not {t} x {}", self.k);
        assert_eq!(out.len(), t * self.n, "output is not {t} x {}", self.n);
        let q = self.quantise(x, t);
        let stride = self.groups * 4;
        for i in 0..t {
            let row = &q.bytes[i * stride..(i + 1) * stride];
            let a = |p: usize| -> i64 {
                match self.format {
                    Format::Int16 => i64::from(i16::from_le_bytes([row[2 * p], row[2 * p + 1]])),
                    Format::Int8 => i64::from(row[p]),
                }
            };
            for j in 0..self.n {
                let acc: i64 = (0..self.k).map(|p| a(p) * i64::from(self.code(j, p))).sum();
                out[i * self.n + j] = self.scale[j]
                    * (q.scale[i] * acc as f32 + q.min[i] * self.col_sum[j])
                    + self.bias[j];
            }
        }
    }

    fn quantise(&self, x: &[f32], t: usize) -> Quantised {
        let mut q = Quantised::empty();
        self.quantise_into(x, t, &mut q);
        q
    }

    /// Quantises `t` rows of `x` into `q`, reusing its buffers: every byte
    /// of the `t` rows is written, codes or zero padding.
    fn quantise_into(&self, x: &[f32], t: usize, q: &mut Quantised) {
        let row_bytes = self.groups * 4;
        q.bytes.resize(t * row_bytes, 0);
        q.scale.clear();
        q.scale.resize(t, 0.0);
        q.min.clear();
        q.min.resize(t, 0.0);
        let used = match self.format {
            Format::Int16 => 2 * self.k,
            Format::Int8 => self.k,
        };
        for row in q.bytes[..t * row_bytes].chunks_exact_mut(row_bytes.max(1)) {
            row[used..].fill(0);
        }
        if self.k > 0 {
            for (i, row) in x.chunks_exact(self.k).enumerate() {
                let (lo, hi) = match min_max(row) {
                    (lo, hi) if lo.is_finite() && hi.is_finite() => (lo, hi),
                    // Every value NaN, or one infinite: codes stay defined.
                    _ => (0.0, 0.0),
                };
                let dst = &mut q.bytes[i * self.groups * 4..(i + 1) * self.groups * 4];
                match self.format {
                    Format::Int16 => {
                        let amax = lo.abs().max(hi.abs());
                        let s = if amax > 0.0 && amax.is_finite() {
                            amax / self.a_max
                        } else {
                            1.0
                        };
                        q.scale[i] = s;
                        codes_i16(row, 1.0 / s, self.a_max, dst);
                    }
                    Format::Int8 => {
                        let range = hi - lo;
                        let s = if range > 0.0 && range.is_finite() {
                            range / self.a_max
                        } else {
                            1.0
                        };
                        q.scale[i] = s;
                        q.min[i] = lo;
                        codes_u8(row, lo, 1.0 / s, dst);
                    }
                }
            }
        }
    }
}

/// Minimum and maximum of a row, NaN ignored (±∞ when all are NaN).
fn min_max(row: &[f32]) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked on the line above.
        return unsafe { simd::min_max(row) };
    }
    min_max_body(row)
}

#[inline(always)]
fn min_max_body(row: &[f32]) -> (f32, f32) {
    let mut lo = [f32::INFINITY; 16];
    let mut hi = [f32::NEG_INFINITY; 16];
    for (p, &v) in row.iter().enumerate() {
        // A comparison with NaN is false: NaN never replaces a bound.
        if v < lo[p % 16] {
            lo[p % 16] = v;
        }
        if v > hi[p % 16] {
            hi[p % 16] = v;
        }
    }
    (
        lo.iter().copied().fold(f32::INFINITY, f32::min),
        hi.iter().copied().fold(f32::NEG_INFINITY, f32::max),
    )
}

/// `round(x · inv)` clamped to `±limit`, as little-endian i16 (NaN → 0).
fn codes_i16(row: &[f32], inv: f32, limit: f32, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked on the line above.
        return unsafe { simd::codes_i16(row, inv, limit, dst) };
    }
    codes_i16_body(row, inv, limit, dst)
}

#[inline(always)]
fn codes_i16_body(row: &[f32], inv: f32, limit: f32, dst: &mut [u8]) {
    for (d, &v) in dst.chunks_exact_mut(2).zip(row) {
        // The clamp keeps NaN; `as` then maps it to 0.
        let q = (v * inv).round_ties_even().clamp(-limit, limit) as i16;
        d.copy_from_slice(&q.to_le_bytes());
    }
}

/// `round((x - lo) · inv)` clamped to `0..=255` (NaN → 0).
fn codes_u8(row: &[f32], lo: f32, inv: f32, dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked on the line above.
        return unsafe { simd::codes_u8(row, lo, inv, dst) };
    }
    codes_u8_body(row, lo, inv, dst)
}

#[inline(always)]
fn codes_u8_body(row: &[f32], lo: f32, inv: f32, dst: &mut [u8]) {
    for (d, &v) in dst.iter_mut().zip(row) {
        *d = ((v - lo) * inv).round_ties_even().clamp(0.0, 255.0) as u8;
    }
}

/// The quantisers in AVX-512 (the compiler does not vectorise float → int
/// conversions with Rust's saturating `as`), giving the scalar bodies' values:
/// `vcvtps2dq` rounds to nearest even, and max/min with a constant second
/// operand map NaN to that constant.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn min_max(row: &[f32]) -> (f32, f32) {
        let whole = row.len() / 16 * 16;
        let (mut lo, mut hi) = (
            _mm512_set1_ps(f32::INFINITY),
            _mm512_set1_ps(f32::NEG_INFINITY),
        );
        for c in row[..whole].chunks_exact(16) {
            // SAFETY: `c` holds 16 values.
            let v = unsafe { _mm512_loadu_ps(c.as_ptr()) };
            // min/max return the second operand when either is NaN.
            lo = _mm512_min_ps(v, lo);
            hi = _mm512_max_ps(v, hi);
        }
        let (tlo, thi) = super::min_max_body(&row[whole..]);
        (
            _mm512_reduce_min_ps(lo).min(tlo),
            _mm512_reduce_max_ps(hi).max(thi),
        )
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn codes_i16(row: &[f32], inv: f32, limit: f32, dst: &mut [u8]) {
        let whole = row.len() / 16 * 16;
        let (vinv, top, bottom) = (
            _mm512_set1_ps(inv),
            _mm512_set1_ps(limit),
            _mm512_set1_ps(-limit),
        );
        for (c, d) in row[..whole].chunks_exact(16).zip(dst.chunks_exact_mut(32)) {
            // SAFETY: `c` holds 16 values and `d` 32 bytes.
            unsafe {
                let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), vinv);
                // NaN → 0 first (max/min would turn it into a bound).
                let v = _mm512_mask_blend_ps(
                    _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v),
                    v,
                    _mm512_setzero_ps(),
                );
                let v = _mm512_min_ps(_mm512_max_ps(v, bottom), top);
                let codes = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(v));
                _mm256_storeu_si256(d.as_mut_ptr().cast(), codes);
            }
        }
        super::codes_i16_body(&row[whole..], inv, limit, &mut dst[2 * whole..]);
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn codes_u8(row: &[f32], lo: f32, inv: f32, dst: &mut [u8]) {
        let whole = row.len() / 16 * 16;
        let (vlo, vinv, zero, top) = (
            _mm512_set1_ps(lo),
            _mm512_set1_ps(inv),
            _mm512_setzero_ps(),
            _mm512_set1_ps(255.0),
        );
        for (c, d) in row[..whole].chunks_exact(16).zip(dst.chunks_exact_mut(16)) {
            // SAFETY: `c` holds 16 values and `d` 16 bytes.
            unsafe {
                let v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), vlo), vinv);
                let v = _mm512_min_ps(_mm512_max_ps(v, zero), top);
                let bytes = _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(v));
                _mm_storeu_si128(d.as_mut_ptr().cast(), bytes);
            }
        }
        super::codes_u8_body(&row[whole..], lo, inv, &mut dst[whole..]);
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{Format, KC, MR, NR, QuantLinear, Quantised, ROWS_BYTES};
    use std::arch::x86_64::*;

    /// `gelu`: GELU applied to each output in the epilogue.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI; `q` must be
    /// `layer.quantise` of `t` rows and `out` hold `t × n` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn forward(
        layer: &QuantLinear,
        q: &Quantised,
        out: &mut [f32],
        t: usize,
        gelu: bool,
    ) {
        match layer.format {
            // SAFETY: this function's own contract.
            Format::Int16 => unsafe { forward_as::<true>(layer, q, out, t, gelu) },
            // SAFETY: as above.
            Format::Int8 => unsafe { forward_as::<false>(layer, q, out, t, gelu) },
        }
    }

    /// `WIDE`: i16 pairs (`vpdpwssd`), else u8 × i8 quadruples (`vpdpbusd`).
    ///
    /// # Safety
    /// As [`forward`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn forward_as<const WIDE: bool>(
        layer: &QuantLinear,
        q: &Quantised,
        out: &mut [f32],
        t: usize,
        gelu: bool,
    ) {
        let blocks = layer.n.div_ceil(NR);
        let groups = layer.groups;
        let stride = groups * 4;
        // At least one: with no inputs (k = 0) the outputs are the bias.
        let chunks = groups.div_ceil(KC).max(1);
        // Rows in blocks whose activations (`ROWS_BYTES`) stay in L2 while
        // every block of channels passes over them.
        let rows_per_block = (ROWS_BYTES / stride.max(1)).max(MR) / MR * MR;
        // One block's sums for a block of rows, carried between chunks of
        // groups (none when one chunk holds them all: the sums go from
        // registers to the epilogue).
        let mut acc = if chunks > 1 {
            vec![0i32; rows_per_block.min(t) * NR]
        } else {
            Vec::new()
        };
        for i0 in (0..t).step_by(rows_per_block) {
            let i1 = (i0 + rows_per_block).min(t);
            for b in 0..blocks {
                let panel = &layer.packed[b * groups * NR * 4..(b + 1) * groups * NR * 4];
                let finish = Finish::new(layer, b, gelu);
                // Chunks of KC groups: the chunk's slice of the panel (KC × 192
                // bytes) stays in L1 while every row tile passes over it.
                for c in 0..chunks {
                    let (g0, g1) = (c * KC, ((c + 1) * KC).min(groups));
                    let chunk = &panel[g0 * NR * 4..g1 * NR * 4];
                    let step = Step {
                        first: c == 0,
                        last: c + 1 == chunks,
                    };
                    let mut i = i0;
                    while i < i1 {
                        let rows = (i1 - i).min(MR);
                        let a = &q.bytes[i * stride + 4 * g0..];
                        let sums = if chunks > 1 {
                            &mut acc[(i - i0) * NR..(i - i0 + rows) * NR]
                        } else {
                            &mut []
                        };
                        let to = Rows {
                            out: &mut out[i * layer.n..(i + rows) * layer.n],
                            scale: &q.scale[i..i + rows],
                            min: &q.min[i..i + rows],
                        };
                        // SAFETY: the CPU features are this function's own
                        // contract; `a` starts at row i, group g0, and holds
                        // `rows` rows of `stride` bytes from there less 4·g0 (so
                        // every group below g1 - g0 of every row); `chunk` holds
                        // g1 - g0 groups of NR × 4 bytes; `sums` holds rows × NR
                        // values unless one chunk is the whole row (then it is
                        // never read or written: the first chunk is the last);
                        // `to` holds `rows` rows of the output, scales and offsets.
                        unsafe {
                            match rows {
                                8 => tile::<8, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                7 => tile::<7, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                6 => tile::<6, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                5 => tile::<5, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                4 => tile::<4, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                3 => tile::<3, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                2 => tile::<2, WIDE>(a, stride, chunk, sums, step, &finish, to),
                                _ => tile::<1, WIDE>(a, stride, chunk, sums, step, &finish, to),
                            }
                        }
                        i += rows;
                    }
                }
            }
        }
    }

    /// Which chunk of groups a tile call sums: the first starts from zero,
    /// the last hands its sums to the epilogue instead of storing them.
    #[derive(Clone, Copy)]
    struct Step {
        first: bool,
        last: bool,
    }

    /// Block `b`'s per-channel epilogue terms (padded to NR, so always
    /// readable), and how many of its channels exist.
    struct Finish<'a> {
        scale: &'a [f32],
        col_sum: &'a [f32],
        bias: &'a [f32],
        /// The block's first channel.
        j0: usize,
        cols: usize,
        n: usize,
        /// GELU after the affine step.
        gelu: bool,
    }

    impl<'a> Finish<'a> {
        fn new(layer: &'a QuantLinear, b: usize, gelu: bool) -> Self {
            let j0 = b * NR;
            Self {
                scale: &layer.scale[j0..j0 + NR],
                col_sum: &layer.col_sum[j0..j0 + NR],
                bias: &layer.bias[j0..],
                j0,
                cols: (layer.n - j0).min(NR),
                n: layer.n,
                gelu,
            }
        }
    }

    /// The rows one tile call finishes: their outputs (whole rows) and their
    /// activations' scales and offsets.
    struct Rows<'a> {
        out: &'a mut [f32],
        scale: &'a [f32],
        min: &'a [f32],
    }

    /// `out[row][b·NR + c] = s_w · (s[row] · acc + m[row] · Σ q) + bias` for
    /// block `b`'s channels, `acc[row · stride + c]` its sums.
    ///
    /// # Safety
    /// AVX-512F; `acc` holds `t` rows of at least NR sums, `stride` apart;
    /// `q` is `layer.quantise` of t rows and `out` holds `t × n` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn epilogue(
        layer: &QuantLinear,
        q: &Quantised,
        acc: &[i32],
        stride: usize,
        b: usize,
        out: &mut [f32],
        t: usize,
    ) {
        debug_assert!(t == 0 || acc.len() >= (t - 1) * stride + NR);
        let cols = (layer.n - b * NR).min(NR);
        for row in 0..t {
            let (s, m) = (_mm512_set1_ps(q.scale[row]), _mm512_set1_ps(q.min[row]));
            for c in 0..NR / 16 {
                let valid = cols.saturating_sub(c * 16).min(16);
                if valid == 0 {
                    break;
                }
                let j0 = b * NR + c * 16;
                let mask: __mmask16 = if valid == 16 {
                    0xffff
                } else {
                    (1u16 << valid) - 1
                };
                // SAFETY: `acc` holds row · stride + NR values (this
                // function's contract); scale and col_sum are padded to whole
                // blocks, so 16 values from j0 < blocks · NR are in bounds;
                // the bias load and the store are masked to the `valid`
                // channels that exist, and row < t, j0 + valid <= n keep the
                // store inside `out`.
                unsafe {
                    let sum = _mm512_loadu_si512(acc.as_ptr().add(row * stride + c * 16).cast());
                    let sw = _mm512_loadu_ps(layer.scale.as_ptr().add(j0));
                    let cs = _mm512_loadu_ps(layer.col_sum.as_ptr().add(j0));
                    let bias = _mm512_maskz_loadu_ps(mask, layer.bias.as_ptr().add(j0));
                    let v = affine(sum, s, m, cs, sw, bias);
                    _mm512_mask_storeu_ps(out.as_mut_ptr().add(row * layer.n + j0), mask, v);
                }
            }
        }
    }

    /// `s_w · (s · sum + m · Σ q) + bias` on 16 channels of one row: the
    /// epilogue's formula, for the separate epilogue and the fused one.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn affine(sum: __m512i, s: __m512, m: __m512, cs: __m512, sw: __m512, bias: __m512) -> __m512 {
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), s, _mm512_mul_ps(m, cs)),
            sw,
            bias,
        )
    }

    /// `acc + a · b` by pairs of i16 (`vpdpwssd`), in inline assembly: LLVM
    /// rewrites the intrinsic into `vpmaddwd` + `vpaddd` for CPUs it does
    /// not know to be fast at it (seen: 163 instead of 330 G op/s here).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    fn dpwssd(mut acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: one register-only instruction of AVX-512 VNNI, which this
        // function's target features require of the caller's CPU.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {acc}, {a}, {b}",
                acc = inout(zmm_reg) acc,
                a = in(zmm_reg) a,
                b = in(zmm_reg) b,
                options(pure, nomem, nostack),
            );
        }
        acc
    }

    /// `sums[r][c] += Σ_g a[r][g] · chunk[g][c]` for `R` rows (`stride` bytes
    /// apart) over the chunk's 4-byte groups; from zero on the first chunk,
    /// and on the last the epilogue instead of a store:
    /// `out[r][j] = s_w[j] · (s[r] · sum + m[r] · Σ q[j]) + bias[j]` for the
    /// block's channels.
    ///
    /// # Safety
    /// VNNI as above; `a.len() >= (R - 1) * stride + 4 * groups`, where
    /// `groups = chunk.len() / (NR * 4)`; `sums.len() >= R * NR` unless
    /// `step` is both first and last; `to` holds R rows of `finish.n`
    /// outputs and R scales and offsets.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const R: usize, const WIDE: bool>(
        a: &[u8],
        stride: usize,
        chunk: &[u8],
        sums: &mut [i32],
        step: Step,
        finish: &Finish<'_>,
        to: Rows<'_>,
    ) {
        let groups = chunk.len() / (NR * 4);
        debug_assert!(a.len() >= (R - 1) * stride + 4 * groups);
        debug_assert!((step.first && step.last) || sums.len() >= R * NR);
        debug_assert!(to.out.len() >= R * finish.n && to.scale.len() >= R && to.min.len() >= R);
        let (ap, bp, sp) = (a.as_ptr(), chunk.as_ptr(), sums.as_mut_ptr());
        let mut regs = [[_mm512_setzero_si512(); 3]; R];
        if !step.first {
            for (r, regs) in regs.iter_mut().enumerate() {
                for (c, reg) in regs.iter_mut().enumerate() {
                    // SAFETY: r < R and c < 3, so r·NR + 16c + 16 <= R·NR
                    // <= sums.len() (not the first chunk).
                    *reg = unsafe { _mm512_loadu_si512(sp.add(r * NR + 16 * c).cast()) };
                }
            }
        }
        for g in 0..groups {
            // SAFETY: g < groups, so the 192 bytes at g·NR·4 lie in the
            // chunk, and the 4 bytes at r·stride + 4g in row r < R of `a`.
            unsafe {
                let b = bp.add(g * NR * 4);
                let b0 = _mm512_loadu_si512(b.cast());
                let b1 = _mm512_loadu_si512(b.add(64).cast());
                let b2 = _mm512_loadu_si512(b.add(128).cast());
                for (r, regs) in regs.iter_mut().enumerate() {
                    let x = _mm512_set1_epi32(
                        ap.add(r * stride + 4 * g).cast::<i32>().read_unaligned(),
                    );
                    if WIDE {
                        regs[0] = dpwssd(regs[0], x, b0);
                        regs[1] = dpwssd(regs[1], x, b1);
                        regs[2] = dpwssd(regs[2], x, b2);
                    } else {
                        regs[0] = _mm512_dpbusd_epi32(regs[0], x, b0);
                        regs[1] = _mm512_dpbusd_epi32(regs[1], x, b1);
                        regs[2] = _mm512_dpbusd_epi32(regs[2], x, b2);
                    }
                }
            }
        }
        if !step.last {
            for (r, regs) in regs.iter().enumerate() {
                for (c, reg) in regs.iter().enumerate() {
                    // SAFETY: as for the loads above.
                    unsafe { _mm512_storeu_si512(sp.add(r * NR + 16 * c).cast(), *reg) };
                }
            }
            return;
        }
        let op = to.out.as_mut_ptr();
        for c in 0..NR / 16 {
            let valid = finish.cols.saturating_sub(c * 16).min(16);
            if valid == 0 {
                break;
            }
            let mask: __mmask16 = if valid == 16 {
                0xffff
            } else {
                (1u16 << valid) - 1
            };
            // SAFETY: scale and col_sum hold NR values, so 16 from 16c; the
            // bias load is masked to the `valid` channels that exist
            // (j0 + 16c + valid <= n = bias.len()).
            let (sw, cs, bias) = unsafe {
                (
                    _mm512_loadu_ps(finish.scale.as_ptr().add(16 * c)),
                    _mm512_loadu_ps(finish.col_sum.as_ptr().add(16 * c)),
                    _mm512_maskz_loadu_ps(mask, finish.bias.as_ptr().add(16 * c)),
                )
            };
            for (r, regs) in regs.iter().enumerate() {
                let (s, m) = (_mm512_set1_ps(to.scale[r]), _mm512_set1_ps(to.min[r]));
                let v = affine(regs[c], s, m, cs, sw, bias);
                let v = if finish.gelu {
                    crate::nn::gelu512::gelu16(v)
                } else {
                    v
                };
                // SAFETY: row r < R of `to.out` (R rows of n), channels
                // j0 + 16c .. j0 + 16c + valid <= n; the store is masked.
                unsafe {
                    _mm512_mask_storeu_ps(op.add(r * finish.n + finish.j0 + 16 * c), mask, v);
                }
            }
        }
    }
}

/// [`Format::Int8`] on AMX tiles (`tdpbusd`: u8 × i8 quadruples summed
/// in i32), reading the same packed weights as the VNNI kernel: a block's
/// 16-channel slice over 16 groups is a B tile with rows 192 bytes apart.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx_int8 {
    use std::cell::Cell;

    use super::{NR, QuantLinear, Quantised, vnni::epilogue};
    use crate::aligned::Aligned;
    use crate::amx::{Config, release, tile_dot, tile_load, tile_store, tile_zero};

    thread_local! {
        /// Each thread's padded activations and sums, reused between calls.
        static BUFFERS: Cell<(Aligned<u8>, Vec<i32>)> = const { Cell::new((Aligned::new(), Vec::new())) };
    }

    /// Channels and rows per tile; groups (4 bytes) per tile row.
    const TT: usize = 16;

    /// # Safety
    /// The CPU must have AMX-TILE and AMX-INT8 with the tile data permission,
    /// and AVX-512F; `q` is `layer.quantise` of `t` rows, `out` holds `t × n`.
    pub(super) unsafe fn forward(layer: &QuantLinear, q: &Quantised, out: &mut [f32], t: usize) {
        if t == 0 {
            return;
        }
        let groups = layer.groups;
        let gp = groups.div_ceil(TT) * TT;
        let tp = t.div_ceil(2 * TT) * 2 * TT;
        let blocks = layer.n.div_ceil(NR);
        let np = blocks * NR;
        // Activations with rows and groups padded by zeros, and the sums:
        // this thread's buffers, kept between calls (fresh ones cost page
        // faults on every call). Every sum the epilogue uses is stored by a
        // tile first; the rest (channels past n) it masks off.
        let row_a = 4 * gp;
        let (mut a, mut acc) = BUFFERS.take();
        if a.len() < tp * row_a {
            a.resize(tp * row_a, 0);
        }
        for (i, dst) in a[..tp * row_a].chunks_exact_mut(row_a).enumerate() {
            let real = if i < t { 4 * groups } else { 0 };
            if real > 0 {
                dst[..real].copy_from_slice(&q.bytes[i * real..(i + 1) * real]);
            }
            dst[real..].fill(0);
        }
        if acc.len() < tp * np {
            acc.resize(tp * np, 0);
        }
        // 16-channel slices holding channels, in pairs (an odd last slice is
        // paired with itself and stored once).
        let slices = layer.n.div_ceil(TT);
        let slice = |s: usize| (s / 3) * groups * NR * 4 + (s % 3) * TT * 4;
        let (b_stride, c_stride) = (NR * 4, np * 4);
        let config = Config::full();
        // SAFETY: for every tile statement: AMX with the permission (this
        // function's contract), every tile 16 rows of 64 bytes. A loads: rows
        // ib..ib+32 < tp of `a`, bytes 4·g0..4·g0+64 <= row_a. B loads: slice
        // s < slices lies in block s / 3 < blocks; its 16 rows from group
        // g0 < gp end at most (gp - groups) ≤ 15 rows past the last block,
        // inside the AMX_SLACK zero bytes `packed` keeps. Stores: rows
        // ib..ib+32 of `acc` (tp × np), channels s·16..s·16+16 <= np.
        unsafe {
            config.load();
            for ib in (0..tp).step_by(2 * TT) {
                let a0 = a.as_ptr().add(ib * row_a);
                let a1 = a0.add(TT * row_a);
                for s in (0..slices).step_by(2) {
                    let s1 = if s + 1 < slices { s + 1 } else { s };
                    let b0 = layer.packed.as_ptr().add(slice(s));
                    let b1 = layer.packed.as_ptr().add(slice(s1));
                    tile_zero!("0");
                    tile_zero!("1");
                    tile_zero!("2");
                    tile_zero!("3");
                    for g0 in (0..gp).step_by(TT) {
                        tile_load!("4", a0.add(4 * g0), row_a);
                        tile_load!("6", b0.add(g0 * NR * 4), b_stride);
                        tile_dot!("tdpbusd", "0", "4", "6");
                        tile_load!("7", b1.add(g0 * NR * 4), b_stride);
                        tile_dot!("tdpbusd", "1", "4", "7");
                        tile_load!("5", a1.add(4 * g0), row_a);
                        tile_dot!("tdpbusd", "2", "5", "6");
                        tile_dot!("tdpbusd", "3", "5", "7");
                    }
                    let c = acc.as_mut_ptr().add(ib * np);
                    tile_store!("0", c.add(s * TT), c_stride);
                    tile_store!("2", c.add(TT * np + s * TT), c_stride);
                    if s1 != s {
                        tile_store!("1", c.add(s1 * TT), c_stride);
                        tile_store!("3", c.add(TT * np + s1 * TT), c_stride);
                    }
                }
            }
            release();
        }
        for b in 0..blocks {
            // SAFETY: AVX-512F (this function's contract); `acc` from b·NR
            // holds t rows of NR sums, np apart.
            unsafe { epilogue(layer, q, &acc[b * NR..], np, b, out, t) };
        }
        BUFFERS.set((a, acc));
    }
}

#[cfg(test)]
mod tests;

mod search;
pub(crate) use search::rescore_exactly;
pub use search::{INT8_MIN_ROWS, QuantKernel, SLACK};
