//! Dense kernels for a transformer encoder's forward pass on the CPU: a
//! strided matrix multiply on gemm's SIMD micro-kernels, and the
//! element-wise pieces around it (bias, layer norm with its residual add,
//! exact-erf GELU, softmax, column maxima), written as plain loops the
//! compiler vectorises. Softmax alone is AVX-512 intrinsics where the CPU
//! has them (attention's rows are short, and the portable loop's scalar
//! tails and lane folds were most of its cost); a test holds it to the
//! portable loop's values bit for bit.
//!
//! The embedder in `steamrf-operators` assembles all-MiniLM-L6-v2 from these.

use gemm::{Parallelism, gemm};

macro_rules! simd_variants {
    ($feature:literal, $module:ident) => {
        #[cfg(target_arch = "x86_64")]
        mod $module {
            #[target_feature(enable = $feature)]
            pub(super) fn gelu_erf(x: &mut [f32]) {
                super::gelu_erf_body(x)
            }
            #[target_feature(enable = $feature)]
            pub(super) fn max_rows_into(dst: &mut [f32], rows: &[f32]) {
                super::max_rows_into_body(dst, rows)
            }
            #[target_feature(enable = $feature)]
            pub(super) fn max_of(x: &[f32]) -> f32 {
                super::max(x)
            }
            #[target_feature(enable = $feature)]
            pub(super) fn layer_norm(x: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
                super::layer_norm_body(x, gamma, beta, eps)
            }
            #[target_feature(enable = $feature)]
            pub(super) fn add_layer_norm(
                x: &mut [f32],
                y: &[f32],
                gamma: &[f32],
                beta: &[f32],
                eps: f32,
            ) {
                super::add_layer_norm_body(x, y, gamma, beta, eps)
            }
        }
    };
}
simd_variants!("avx512f", avx512);
simd_variants!("avx2,fma", avx2);

/// A read-only strided matrix view: element `(i, j)` is
/// `data[i * row_stride + j * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// A mutable strided matrix view (see [`MatRef`]).
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

/// Panics unless every element of a `rows × cols` view with these strides lies in `len` values.
fn check_view(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    let fits = rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len;
    assert!(
        fits,
        "a {rows}x{cols} view with strides ({rs}, {cs}) does not fit in {len} values"
    );
}

impl<'a> MatRef<'a> {
    /// A view of `data`.
    ///
    /// # Panics
    /// If an element would lie outside `data`.
    pub fn new(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        check_view(data.len(), rows, cols, row_stride, col_stride);
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// A dense row-major `rows × cols` matrix.
    pub fn dense(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

impl<'a> MatMut<'a> {
    /// A mutable view of `data`.
    ///
    /// # Panics
    /// If an element would lie outside `data`.
    pub fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        check_view(data.len(), rows, cols, row_stride, col_stride);
        Self {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// A dense row-major `rows × cols` matrix.
    pub fn dense(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::new(data, rows, cols, cols, 1)
    }
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`), single-threaded.
///
/// # Panics
/// If the shapes disagree.
pub fn matmul(dst: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    assert_eq!(a.cols, b.rows, "inner dimensions differ");
    assert_eq!(
        (dst.rows, dst.cols),
        (a.rows, b.cols),
        "output shape differs"
    );
    if dst.rows == 0 || dst.cols == 0 {
        return;
    }
    if a.cols == 0 {
        if !accumulate {
            for i in 0..dst.rows {
                for j in 0..dst.cols {
                    dst.data[i * dst.row_stride + j * dst.col_stride] = 0.0;
                }
            }
        }
        return;
    }
    let isz = |x: usize| x as isize;
    // SAFETY: the constructors checked that every element (i, j) of each view,
    // at i * row_stride + j * col_stride, lies inside its slice, and the shape
    // asserts above make gemm read exactly a.rows × a.cols of `a`,
    // b.rows × b.cols of `b` and write dst.rows × dst.cols of `dst`. `dst` is
    // the only mutable borrow, so it cannot alias `a` or `b`. With
    // read_dst = false gemm never reads `dst`'s old values.
    unsafe {
        gemm(
            dst.rows,
            dst.cols,
            a.cols,
            dst.data.as_mut_ptr(),
            isz(dst.col_stride),
            isz(dst.row_stride),
            accumulate,
            a.data.as_ptr(),
            isz(a.col_stride),
            isz(a.row_stride),
            b.data.as_ptr(),
            isz(b.col_stride),
            isz(b.row_stride),
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `out = x · wᵀ + bias` for `x` of `t × k`, `w` of `n × k` (PyTorch's Linear
/// layout), `out` of `t × n`.
///
/// # Panics
/// If the lengths disagree.
pub fn linear(out: &mut [f32], x: &[f32], w: &[f32], bias: &[f32], t: usize, k: usize, n: usize) {
    assert_eq!(bias.len(), n);
    assert_eq!(out.len(), t * n);
    for row in out.chunks_exact_mut(n) {
        row.copy_from_slice(bias);
    }
    matmul(
        MatMut::dense(out, t, n),
        MatRef::dense(x, t, k),
        MatRef::dense(w, n, k).t(),
        true,
    );
}

/// In-place layer norm over rows of `dim` values: `(x - mean) / sqrt(var + eps) * gamma + beta`.
pub fn layer_norm(x: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    dispatch!(layer_norm, layer_norm_body(x, gamma, beta, eps))
}

#[inline(always)]
fn layer_norm_body(x: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let dim = gamma.len();
    for row in x.chunks_exact_mut(dim) {
        let mean = sum(row) / dim as f32;
        normalise(row, mean, gamma, beta, eps);
    }
}

/// One row of a layer norm, given its mean.
#[inline(always)]
fn normalise(row: &mut [f32], mean: f32, gamma: &[f32], beta: &[f32], eps: f32) {
    let sq = lane_sums(row, |v| (v - mean) * (v - mean));
    let var = fold_lanes(sq, |a, b| a + b) / row.len() as f32;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
        *v = (*v - mean) * inv * g + b;
    }
}

/// `x = layer_norm(x + y)` (a BERT block's residual and norm): the same
/// values as [`add_assign`] then [`layer_norm`], row by row, so each row is
/// still in L1 when it is normalised (one pass over `x` fewer).
///
/// # Panics
/// If `x` and `y` differ in length.
pub fn add_layer_norm(x: &mut [f32], y: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    assert_eq!(x.len(), y.len(), "the residual differs in length");
    dispatch!(add_layer_norm, add_layer_norm_body(x, y, gamma, beta, eps))
}

#[inline(always)]
fn add_layer_norm_body(x: &mut [f32], y: &[f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let dim = gamma.len();
    for (row, res) in x.chunks_exact_mut(dim).zip(y.chunks_exact(dim)) {
        for (v, w) in row.iter_mut().zip(res) {
            *v += w;
        }
        let mean = sum(row) / dim as f32;
        normalise(row, mean, gamma, beta, eps);
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// erf for f32: a rational approximation on [-4, 4] (outside, erf is ±1 in
/// f32), branch-free so it vectorises. Max absolute error 4.2e-7 against the
/// exact function (checked in the tests); PyTorch's exact GELU uses libm's erf.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let x = x.clamp(-4.0, 4.0);
    let x2 = x * x;
    let mut p = ERF_P[0];
    for c in &ERF_P[1..] {
        p = p * x2 + c;
    }
    let mut q = ERF_Q[0];
    for c in &ERF_Q[1..] {
        q = q * x2 + c;
    }
    x * p / q
}

/// [`erf`]'s rational approximation `x · P(x²) / Q(x²)`: the coefficients
/// of P and Q, highest degree first (Q's are all negative, so Q < 0).
#[allow(clippy::excessive_precision)]
const ERF_P: [f32; 7] = [
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
];
#[allow(clippy::excessive_precision)]
const ERF_Q: [f32; 5] = [
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
];

/// In-place exact GELU: `x · (1 + erf(x / √2)) / 2`.
pub fn gelu_erf(x: &mut [f32]) {
    dispatch!(gelu_erf, gelu_erf_body(x))
}

#[inline(always)]
fn gelu_erf_body(x: &mut [f32]) {
    for v in x {
        *v = gelu(*v);
    }
}

/// Exact GELU of one value, `x · (1 + erf(x / √2)) / 2`, with [`erf`]:
/// inlined, so a loop of it vectorises (what [`gelu_erf`] runs, and what
/// `bf16::Bf16Linear::forward_gelu` applies while packing its input).
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// e^x for f32, branch-free so it vectorises (libm's expf is a call per
/// value): Cephes' range reduction and degree-6 polynomial, within 2 ULP
/// of the exact value for x in [-87, 88] (checked in the tests); below that
/// the result is ~1e-38 rather than 0, which no softmax can tell apart.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // n = round(x / ln 2) by the 1.5 * 2^23 trick (no SSE4.1 needed).
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = x - n * 0.693_359_375 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_150_0e-4_f32;
    p = p * r + 1.398_199_950_7e-3;
    p = p * r + 8.333_451_907_3e-3;
    p = p * r + 4.166_579_589_4e-2;
    p = p * r + 1.666_666_545_9e-1;
    p = p * r + 5.000_000_120_1e-1;
    let y = p * r * r + r + 1.0;
    // 2^n through the exponent bits, without a float-to-int conversion (which
    // Rust saturates, and that blocks vectorisation): n + 127 is an integer
    // in [1, 254], so it sits in the low mantissa bits of MAGIC + n + 127.
    let biased = (n + (MAGIC + 127.0)).to_bits() - MAGIC.to_bits();
    y * f32::from_bits(biased << 23)
}

/// Sum with 16 independent accumulators, so the compiler vectorises it (a
/// plain fold is one long dependency chain: float addition is not associative).
/// The lanes are folded as a tree (8 + 8, 4 + 4, …): four vector steps
/// instead of sixteen dependent adds, which matters for short rows (a
/// softmax over a 32-token sequence's scores).
#[inline(always)]
fn sum(x: &[f32]) -> f32 {
    fold_lanes(lane_sums(x, |v| v), |a, b| a + b)
}

/// Lane `i % 16` sums `f` of values `i`, `i + 16`, …: in whole chunks of
/// 16, so it vectorises (indexing lanes modulo 16 did not).
#[inline(always)]
fn lane_sums(x: &[f32], f: impl Fn(f32) -> f32) -> [f32; 16] {
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(rest) {
        *a += f(v);
    }
    acc
}

/// `acc`'s 16 lanes combined by `op` as a tree (8 with 8, 4 with 4, …).
#[inline(always)]
fn fold_lanes(mut acc: [f32; 16], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = 8;
    while width > 0 {
        for i in 0..width {
            acc[i] = op(acc[i], acc[i + width]);
        }
        width /= 2;
    }
    acc[0]
}

/// Maximum with 16 independent lanes, folded as a tree (see [`sum`]).
#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = if *v > *a { *v } else { *a };
        }
    }
    for (a, v) in acc.iter_mut().zip(rest) {
        *a = if *v > *a { *v } else { *a };
    }
    fold_lanes(acc, |a, b| if b > a { b } else { a })
}

/// In-place softmax over each row of `cols` values.
pub fn softmax_rows(x: &mut [f32], cols: usize) {
    softmax_rows_scaled(x, cols, 1.0);
}

/// In-place softmax of `scale · x` over each row of `cols` values (`scale`
/// positive): attention's scaled scores in one pass fewer. Rows whose
/// length is a multiple of 16 run without a scalar tail; padding a row with
/// `-inf` to get there adds ~1e-38 per padded value to its sum (`exp`'s
/// floor), which no f32 sum of at least one `exp(0) = 1` can hold.
pub fn softmax_rows_scaled(x: &mut [f32], cols: usize, scale: f32) {
    if cols == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked on the line above.
            return unsafe { softmax512::softmax_rows(x, cols, scale) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { softmax_avx2(x, cols, scale) };
        }
    }
    softmax_rows_body(x, cols, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn softmax_avx2(x: &mut [f32], cols: usize, scale: f32) {
    softmax_rows_body(x, cols, scale)
}

/// Softmax rows in AVX-512 intrinsics: the same steps as
/// [`softmax_rows_body`] (the same `exp`, the max and the sum folded as the
/// same tree), with a row's last partial 16 values under a mask instead of
/// a scalar tail, and the two folds as `reduce` shuffles rather than
/// sixteen-lane arrays (attention's rows are short: per row, the folds
/// were most of the cost).
/// [`gelu`] on 16 lanes for callers that round the result to bf16 (the
/// bf16 Linear layers' packing): the same rational erf, but evaluated with
/// fused multiply-adds and `1 / q` as `vrcp14ps` refined by one Newton step
/// instead of a division, which costs as much as the rest of GELU. Within
/// a few f32 ulps of [`gelu`] (a test), far inside bf16's rounding.
#[cfg(target_arch = "x86_64")]
pub(crate) mod gelu512 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub(crate) fn gelu16(x: __m512) -> __m512 {
        let set = _mm512_set1_ps;
        let z = _mm512_mul_ps(x, set(std::f32::consts::FRAC_1_SQRT_2));
        // NaN stays NaN, as with `f32::clamp` (`max_ps` and `min_ps` return
        // their second operand when either is NaN).
        let z = _mm512_min_ps(set(4.0), _mm512_max_ps(set(-4.0), z));
        let z2 = _mm512_mul_ps(z, z);
        let mut p = set(super::ERF_P[0]);
        for &c in &super::ERF_P[1..] {
            p = _mm512_fmadd_ps(p, z2, set(c));
        }
        let mut q = set(super::ERF_Q[0]);
        for &c in &super::ERF_Q[1..] {
            q = _mm512_fmadd_ps(q, z2, set(c));
        }
        // q <= -0.0142 for every z (all its coefficients are negative), so
        // its reciprocal is finite: 14 bits, then ~28 after one step.
        let r = _mm512_rcp14_ps(q);
        let r = _mm512_mul_ps(r, _mm512_fnmadd_ps(q, r, set(2.0)));
        // Kept within [-1, 1], so 1 + erf is 0, not -1e-7, where erf
        // saturates (GELU(-6) is -0, as in [`super::gelu`]).
        let erf = _mm512_mul_ps(_mm512_mul_ps(z, p), r);
        let erf = _mm512_min_ps(set(1.0), _mm512_max_ps(set(-1.0), erf));
        // 0.5 · x · (1 + erf), in that order, so GELU(-inf) is NaN as in
        // [`super::gelu`].
        _mm512_mul_ps(_mm512_mul_ps(set(0.5), x), _mm512_add_ps(set(1.0), erf))
    }
}

#[cfg(target_arch = "x86_64")]
mod softmax512 {
    use std::arch::x86_64::*;

    /// [`super::exp`] on 16 lanes, the same operations in the same order
    /// (no fused multiply-adds), so the same values.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::excessive_precision)]
    fn exp16(x: __m512) -> __m512 {
        let set = _mm512_set1_ps;
        // NaN stays NaN, as with `f32::clamp` (`max_ps` and `min_ps`
        // return their second operand when either is NaN).
        let x = _mm512_min_ps(set(88.0), _mm512_max_ps(set(-87.0), x));
        const MAGIC: f32 = 12_582_912.0;
        let magic = set(MAGIC);
        let n = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(x, set(std::f32::consts::LOG2_E)), magic),
            magic,
        );
        let r = _mm512_sub_ps(
            _mm512_sub_ps(x, _mm512_mul_ps(n, set(0.693_359_375))),
            _mm512_mul_ps(n, set(-2.121_944_4e-4)),
        );
        let mut p = set(1.987_569_150_0e-4);
        for c in [
            1.398_199_950_7e-3,
            8.333_451_907_3e-3,
            4.166_579_589_4e-2,
            1.666_666_545_9e-1,
            5.000_000_120_1e-1,
        ] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), set(c));
        }
        let y = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
            set(1.0),
        );
        let biased = _mm512_sub_epi32(
            _mm512_castps_si512(_mm512_add_ps(n, set(MAGIC + 127.0))),
            _mm512_castps_si512(magic),
        );
        _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased)))
    }

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn softmax_rows(x: &mut [f32], cols: usize, scale: f32) {
        let full = cols / 16;
        let tail = cols % 16;
        let mask: __mmask16 = ((1u32 << tail) - 1) as u16;
        let scale = _mm512_set1_ps(scale);
        let low = _mm512_set1_ps(f32::NEG_INFINITY);
        for row in x.chunks_exact_mut(cols) {
            let p = row.as_mut_ptr();
            // SAFETY: `row` holds `cols` = 16 · full + tail values; each
            // whole load or store below touches 16 of the first 16 · full,
            // and each masked one only the `tail` after them.
            unsafe {
                // `max(v, m)` keeps `m` when `v` is NaN, as the scalar rule.
                let mut m = low;
                for c in 0..full {
                    m = _mm512_max_ps(_mm512_loadu_ps(p.add(16 * c)), m);
                }
                if tail > 0 {
                    m = _mm512_max_ps(_mm512_mask_loadu_ps(low, mask, p.add(16 * full)), m);
                }
                let m = _mm512_set1_ps(_mm512_reduce_max_ps(m));
                let mut acc = _mm512_setzero_ps();
                for c in 0..full {
                    let v = _mm512_loadu_ps(p.add(16 * c));
                    let e = exp16(_mm512_mul_ps(_mm512_sub_ps(v, m), scale));
                    _mm512_storeu_ps(p.add(16 * c), e);
                    acc = _mm512_add_ps(acc, e);
                }
                if tail > 0 {
                    let v = _mm512_mask_loadu_ps(m, mask, p.add(16 * full));
                    let e = exp16(_mm512_mul_ps(_mm512_sub_ps(v, m), scale));
                    _mm512_mask_storeu_ps(p.add(16 * full), mask, e);
                    acc = _mm512_mask_add_ps(acc, mask, acc, e);
                }
                let inv = _mm512_set1_ps(1.0 / _mm512_reduce_add_ps(acc));
                for c in 0..full {
                    let v = _mm512_loadu_ps(p.add(16 * c));
                    _mm512_storeu_ps(p.add(16 * c), _mm512_mul_ps(v, inv));
                }
                if tail > 0 {
                    let v = _mm512_maskz_loadu_ps(mask, p.add(16 * full));
                    _mm512_mask_storeu_ps(p.add(16 * full), mask, _mm512_mul_ps(v, inv));
                }
            }
        }
    }
}

#[inline(always)]
fn softmax_rows_body(x: &mut [f32], cols: usize, scale: f32) {
    for row in x.chunks_exact_mut(cols) {
        let m = max(row);
        for v in row.iter_mut() {
            *v = exp((*v - m) * scale);
        }
        let inv = 1.0 / sum(row);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// The largest value of `x` (`-inf` when empty; a NaN never wins).
pub fn max_of(x: &[f32]) -> f32 {
    dispatch!(max_of, max(x))
}

/// `dst[j] = max(dst[j], rows[i · n + j])` over every row `i` of `rows`,
/// `n = dst.len()`: a column-wise maximum, as SPLADE pools its logits over
/// a text's tokens. A NaN in `rows` never wins (`v > d` is false).
///
/// # Panics
/// If `rows` is not whole rows of `dst.len()` values.
pub fn max_rows_into(dst: &mut [f32], rows: &[f32]) {
    let n = dst.len();
    assert!(
        rows.is_empty() || n > 0 && rows.len().is_multiple_of(n),
        "{} values are not rows of {n}",
        rows.len()
    );
    if n == 0 {
        return;
    }
    dispatch!(max_rows_into, max_rows_into_body(dst, rows))
}

#[inline(always)]
fn max_rows_into_body(dst: &mut [f32], rows: &[f32]) {
    for row in rows.chunks_exact(dst.len()) {
        // `if v > d` (not `f32::max`, whose NaN rule blocks `vmaxps`).
        for (d, &v) in dst.iter_mut().zip(row) {
            *d = if v > *d { v } else { *d };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    proptest! {
        #[test]
        fn matmul_matches_naive(m in 0usize..20, k in 0usize..40, n in 0usize..20, seed in 0u64..1000) {
            let val = |i: usize| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 500.0 - 1.0;
            let a: Vec<f32> = (0..m * k).map(val).collect();
            let b: Vec<f32> = (0..k * n).map(|i| val(i + 7)).collect();
            let mut c = vec![9.0; m * n];
            matmul(MatMut::dense(&mut c, m, n), MatRef::dense(&a, m, k), MatRef::dense(&b, k, n), false);
            let want = naive(&a, &b, m, k, n);
            for (x, y) in c.iter().zip(&want) {
                prop_assert!((x - y).abs() < 1e-4, "{x} vs {y}");
            }
        }
    }

    #[test]
    fn linear_uses_the_pytorch_layout_and_adds_the_bias() {
        // x: 2×3, w: 2 outputs × 3 inputs.
        let x = [1.0, 2.0, 3.0, 0.0, 1.0, 0.0];
        let w = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let mut out = [0.0; 4];
        linear(&mut out, &x, &w, &[10.0, 20.0], 2, 3, 2);
        assert_eq!(out, [11.0, 23.0, 10.0, 20.0]);
    }

    #[test]
    fn strided_views_multiply_a_head_slice() {
        // Two "heads" of width 2 interleaved in rows of 4; multiply head 1 by its transpose.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let head = MatRef::new(&x[2..], 2, 2, 4, 1);
        let mut c = [0.0; 4];
        matmul(MatMut::dense(&mut c, 2, 2), head, head.t(), false);
        assert_eq!(c, [25.0, 53.0, 53.0, 113.0]);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn views_outside_the_slice_are_rejected() {
        let x = [0.0; 5];
        let _ = MatRef::new(&x, 2, 3, 3, 1);
    }

    #[test]
    fn erf_is_accurate() {
        // Reference values of erf to 1e-9.
        for (x, want) in [
            (0.0f32, 0.0f64),
            (0.1, 0.112_462_916),
            (0.5, 0.520_499_878),
            (1.0, 0.842_700_793),
            (1.5, 0.966_105_146),
            (2.0, 0.995_322_265),
            (3.0, 0.999_977_910),
            (5.0, 1.0),
            (-1.0, -0.842_700_793),
        ] {
            assert!(
                (f64::from(erf(x)) - want).abs() < 5e-7,
                "erf({x}) = {}",
                erf(x)
            );
        }
    }

    /// The 16-lane GELU the bf16 packing uses stays within a few ulps of
    /// the scalar one (plus a few ulps of `x` where `1 + erf` cancels), and
    /// keeps NaN and the infinities' results.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn gelu16_is_gelu_within_a_few_ulp() {
        use std::arch::x86_64::*;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("gelu16: no AVX-512 on this machine, not run");
            return;
        }
        let mut xs: Vec<f32> = (0..40_000).map(|i| -10.0 + i as f32 * 0.0005).collect();
        xs.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            5.67,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 0.5);
        let mut worst = 0.0f32;
        for run in xs.chunks_exact(16) {
            let mut got = [0.0f32; 16];
            // SAFETY: AVX-512F checked above; 16 values each side.
            unsafe {
                let v = gelu512::gelu16(_mm512_loadu_ps(run.as_ptr()));
                _mm512_storeu_ps(got.as_mut_ptr(), v);
            }
            for (&x, &g) in run.iter().zip(&got) {
                let want = gelu(x);
                if want.is_nan() {
                    assert!(g.is_nan(), "gelu16({x}) = {g}, want NaN");
                } else if want.is_infinite() {
                    assert_eq!(g, want, "gelu16({x})");
                } else {
                    // erf's own error (a few ulps of 1) times x / 2, where
                    // 1 + erf cancels.
                    let err = (g - want).abs();
                    let tol = 4.0 * f32::EPSILON * want.abs() + 2.0 * f32::EPSILON * x.abs();
                    assert!(err <= tol, "gelu16({x}) = {g}, want {want}");
                    worst = worst.max(err / tol);
                }
            }
        }
        eprintln!("gelu16: worst error {worst:.2} of the tolerance");
    }

    #[test]
    fn exp_is_within_a_few_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = f64::from(x).exp();
            let rel = ((f64::from(exp(x)) - want) / want).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(
            worst < 3.0 * f64::from(f32::EPSILON),
            "worst relative error {worst}"
        );
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37 && exp(-1000.0) >= 0.0);
    }

    proptest! {
        /// Every path the CPU has (AVX-512 intrinsics, AVX2) gives the
        /// portable loop's values, on rows of any length, NaN included.
        #[test]
        fn softmax_paths_agree(cols in 1usize..70, rows in 1usize..5, seed in 0u64..1000, nan in 0usize..400) {
            let val = |i: usize| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 40.0 - 12.0;
            let mut x: Vec<f32> = (0..cols * rows).map(val).collect();
            if nan < x.len() {
                x[nan] = f32::NAN;
            }
            let mut want = x.clone();
            softmax_rows_body(&mut want, cols, 0.37);
            let mut got = x.clone();
            softmax_rows_scaled(&mut got, cols, 0.37);
            for (a, b) in got.iter().zip(&want) {
                prop_assert!(a.to_bits() == b.to_bits() || a.is_nan() && b.is_nan(), "{a} vs {b}");
            }
        }
    }

    proptest! {
        /// The fused residual and norm gives exactly the two steps' values.
        #[test]
        fn add_layer_norm_is_add_then_layer_norm(dim in 1usize..70, rows in 1usize..4, seed in 0u64..1000) {
            let val = |i: usize| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 100.0 - 5.0;
            let x: Vec<f32> = (0..dim * rows).map(val).collect();
            let y: Vec<f32> = (0..dim * rows).map(|i| val(i + 3)).collect();
            let g: Vec<f32> = (0..dim).map(|i| val(i + 5)).collect();
            let b: Vec<f32> = (0..dim).map(|i| val(i + 9)).collect();
            let mut want = x.clone();
            add_assign(&mut want, &y);
            layer_norm(&mut want, &g, &b, 1e-12);
            let mut got = x;
            add_layer_norm(&mut got, &y, &g, &b, 1e-12);
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn scaled_softmax_pads_with_minus_infinity() {
        // One row of 3 scores padded to 16 with -inf, scaled by 0.5:
        // the same as softmax(0.5 · [1, 2, 3]).
        let mut padded = [f32::NEG_INFINITY; 16];
        padded[..3].copy_from_slice(&[1.0, 2.0, 3.0]);
        softmax_rows_scaled(&mut padded, 16, 0.5);
        let mut plain = [0.5, 1.0, 1.5];
        softmax_rows(&mut plain, 3);
        assert_eq!(padded[..3], plain);
        assert!(padded[3..].iter().all(|&v| v < 1e-37));
        let total: f32 = plain.iter().sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    proptest! {
        #[test]
        fn column_maxima_match_a_fold(n in 1usize..70, rows in 0usize..9, seed in 0u64..1000) {
            let val = |i: usize| ((i as u64 * 2654435761 + seed) % 1000) as f32 / 50.0 - 10.0;
            let data: Vec<f32> = (0..n * rows).map(val).collect();
            let mut got = vec![-5.0f32; n];
            max_rows_into(&mut got, &data);
            for j in 0..n {
                let want = (0..rows).map(|i| data[i * n + j]).fold(-5.0f32, f32::max);
                prop_assert_eq!(got[j], want);
            }
            let all = data.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            prop_assert_eq!(max_of(&data), all);
        }
    }

    #[test]
    fn column_maxima_ignore_nan() {
        let mut d = [1.0, f32::NEG_INFINITY];
        max_rows_into(&mut d, &[f32::NAN, 2.0, 0.5, f32::NAN]);
        assert_eq!(d, [1.0, 2.0]);
    }

    #[test]
    fn layer_norm_and_softmax() {
        let mut x = [1.0, 2.0, 3.0, 4.0];
        layer_norm(&mut x, &[1.0, 1.0], &[0.0, 0.5], 0.0);
        assert_eq!(x, [-1.0, 1.5, -1.0, 1.5]);
        let mut s = [0.0, 0.0, 1000.0, f32::MIN];
        softmax_rows(&mut s, 2);
        assert_eq!(s[..3], [0.5, 0.5, 1.0]);
        assert!(s[3] < 1e-37, "{}", s[3]);
    }
}
