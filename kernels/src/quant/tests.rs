use proptest::prelude::*;

use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn f32_linear(x: &[f32], w: &[f32], bias: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; t * n];
    for i in 0..t {
        for j in 0..n {
            out[i * n + j] = bias[j] + (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum::<f32>();
        }
    }
    out
}

fn both() -> [Format; 2] {
    [Format::Int16, Format::Int8]
}

/// The VNNI kernel itself where the CPU has VNNI, whichever unit `forward`
/// picks (int8 runs on AMX tiles where it can), so both formats' VNNI
/// paths are checked on AMX machines too.
fn vnni_kernel(layer: &QuantLinear, x: &[f32], t: usize, gelu: bool) -> Option<Vec<f32>> {
    #[cfg(target_arch = "x86_64")]
    if vnni_available() {
        let q = layer.quantise(x, t);
        let mut out = vec![f32::NAN; t * layer.n];
        // SAFETY: the CPU has AVX-512F, BW and VNNI (checked just above);
        // `q` is this layer's quantisation of t rows, `out` holds t × n.
        unsafe { vnni::forward(layer, &q, &mut out, t, gelu) };
        return Some(out);
    }
    None
}

proptest! {
    /// VNNI and the scalar reference compute the same integers on odd shapes
    /// (row tails, channel tails, k not a multiple of the group), NaN inputs
    /// included.
    #[test]
    fn vnni_matches_the_scalar_reference(t in 0usize..20, k in 1usize..70, n in 1usize..110, seed in 0u64..1000) {
        let mut x = values(t * k, seed);
        if t > 0 {
            x[(t * k - 1).min(17)] = f32::NAN;
        }
        let w = values(n * k, seed + 1);
        let bias = values(n, seed + 2);
        for format in both() {
            let layer = QuantLinear::new(format, &w, &bias, n, k);
            let mut fast = vec![f32::NAN; t * n];
            let mut slow = vec![f32::NAN; t * n];
            layer.forward(&mut fast, &x, t);
            layer.forward_scalar(&mut slow, &x, t);
            for (a, b) in fast.iter().zip(&slow) {
                prop_assert!(a.is_finite(), "{format:?}: {a}");
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{format:?}: {a} vs {b}");
            }
            for (a, b) in vnni_kernel(&layer, &x, t, false).unwrap_or_default().iter().zip(&slow) {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{format:?} on VNNI: {a} vs {b}");
            }
        }
    }

    /// GELU in the epilogue gives GELU after the layer, within a few ulps
    /// (the 16-lane GELU against the scalar one), on odd shapes.
    #[test]
    fn gelu_in_the_epilogue_is_the_layer_then_gelu(t in 0usize..20, k in 1usize..70, n in 1usize..110, seed in 0u64..1000) {
        let x: Vec<f32> = values(t * k, seed).iter().map(|v| 4.0 * v).collect();
        let w = values(n * k, seed + 1);
        let bias = values(n, seed + 2);
        for format in both() {
            let layer = QuantLinear::new(format, &w, &bias, n, k);
            let mut fused = vec![f32::NAN; t * n];
            let mut pre = vec![f32::NAN; t * n];
            layer.forward_gelu(&mut fused, &x, t);
            layer.forward(&mut pre, &x, t);
            let on_vnni = vnni_kernel(&layer, &x, t, true);
            for (a, &p) in fused.iter().chain(on_vnni.iter().flatten()).zip(pre.iter().cycle()) {
                let b = crate::nn::gelu(p);
                // A few ulps of the result, and of the input where 1 + erf
                // cancels (as `nn`'s own test of the 16-lane GELU).
                let bound = 1e-5 * b.abs() + 8.0 * f32::EPSILON * p.abs();
                prop_assert!((a - b).abs() <= bound, "{format:?}: gelu({p}) = {a}, not {b}");
            }
        }
    }

    /// Against f32 the error is the quantisation steps': with |x|, |w| <= 1,
    /// at most k · (w step / 2 + x step / 2) per output.
    #[test]
    fn integer_layers_are_close_to_f32(t in 1usize..10, k in 1usize..300, n in 1usize..60, seed in 0u64..1000) {
        let x = values(t * k, seed);
        let w = values(n * k, seed + 5);
        let bias = values(n, seed + 6);
        let want = f32_linear(&x, &w, &bias, t, k, n);
        for format in both() {
            let layer = QuantLinear::new(format, &w, &bias, n, k);
            let mut got = vec![0.0; t * n];
            layer.forward(&mut got, &x, t);
            let (w_max, a_max) = format.limits(k);
            let x_step = if format == Format::Int8 { 2.0 / a_max } else { 1.0 / a_max };
            let bound = k as f32 * (0.5 / w_max + 0.5 * x_step) * 1.01 + 1e-4;
            for (a, b) in got.iter().zip(&want) {
                prop_assert!((a - b).abs() <= bound, "{format:?}: {a} vs {b} (bound {bound})");
            }
        }
    }

    /// The AVX-512 quantisers give the scalar ones' values.
    #[test]
    fn quantisers_agree(k in 1usize..90, seed in 0u64..1000, nan in 0usize..90) {
        let mut x = values(k, seed);
        x[nan % k] = f32::NAN;
        prop_assert_eq!(min_max(&x), min_max_body(&x));
        let (lo, hi) = min_max(&x);
        let (mut a, mut b) = (vec![7u8; 2 * k], vec![7u8; 2 * k]);
        codes_i16(&x, 1000.0, 1182.0, &mut a);
        codes_i16_body(&x, 1000.0, 1182.0, &mut b);
        prop_assert_eq!(&a, &b);
        let inv = 255.0 / (hi - lo);
        codes_u8(&x, lo, inv, &mut a[..k]);
        codes_u8_body(&x, lo, inv, &mut b[..k]);
        prop_assert_eq!(a, b);
    }
}

/// Rows past one block of rows, and inputs past one chunk of groups (sums
/// carried between chunks, then finished in registers), with tails of rows,
/// channels and groups: the same integers as the scalar reference.
#[test]
fn row_blocks_and_chunks_match_the_scalar_reference() {
    let (t, k, n): (usize, usize, usize) = (601, 1601, 53);
    for format in both() {
        let per = format.per_group();
        let stride = k.div_ceil(per) * 4;
        assert!(k.div_ceil(per) > 2 * KC, "{format:?}: fewer than 3 chunks");
        assert!(
            t * stride > 2 * ROWS_BYTES,
            "{format:?}: fewer than 3 row blocks"
        );
        let x = values(t * k, 11);
        let w = values(n * k, 12);
        let bias = values(n, 13);
        let layer = QuantLinear::new(format, &w, &bias, n, k);
        let (mut fast, mut slow) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
        layer.forward(&mut fast, &x, t);
        layer.forward_scalar(&mut slow, &x, t);
        let on_vnni = vnni_kernel(&layer, &x, t, false);
        for (a, b) in fast
            .iter()
            .chain(on_vnni.iter().flatten())
            .zip(slow.iter().cycle())
        {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{format:?}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn no_inputs_give_the_bias() {
    for format in both() {
        let layer = QuantLinear::new(format, &[], &[1.0, 2.0], 2, 0);
        let mut out = vec![f32::NAN; 6];
        layer.forward(&mut out, &[], 3);
        assert_eq!(out, [1.0, 2.0, 1.0, 2.0, 1.0, 2.0], "{format:?}");
        if let Some(v) = vnni_kernel(&layer, &[], 3, false) {
            assert_eq!(v, out, "{format:?} on VNNI");
        }
    }
}

#[test]
fn int16_sums_cannot_overflow() {
    // The largest k · a_max · w_max stays below 2^31 for every k.
    for k in [1, 2, 3, 384, 1536, 4096, 1 << 20] {
        let (w, a) = Format::Int16.limits(k);
        assert!(
            (k as f64) * f64::from(w) * f64::from(a) < 2f64.powi(31),
            "k = {k}"
        );
    }
    // All inputs and weights at the extreme: the sum is still exact.
    let (t, k, n) = (3, 1536, 20);
    let x = vec![-1.0f32; t * k];
    let w = vec![-1.0f32; n * k];
    let layer = QuantLinear::new(Format::Int16, &w, &vec![0.0; n], n, k);
    let mut out = vec![0.0; t * n];
    layer.forward(&mut out, &x, t);
    assert!(
        out.iter().all(|&v| (v - 1536.0).abs() < 1e-2),
        "{:?}",
        &out[..3]
    );
}

#[test]
fn the_suite_says_which_integer_path_it_ran() {
    // A visible line per machine: which path the parity tests above exercised.
    let amx = crate::amx::available(crate::amx::Amx::Int8);
    eprintln!(
        "integer linear layers: {} on this CPU",
        match (vnni_available(), amx) {
            (true, true) =>
                "int16 on AVX-512 VNNI (vpdpwssd), int8 on AMX tiles (tdpbusd), and the scalar reference",
            (true, false) => "AVX-512 VNNI kernels (vpdpwssd, vpdpbusd) and the scalar reference",
            _ => "scalar reference only (no AVX-512 VNNI)",
        }
    );
}

#[test]
fn constant_rows_and_zero_weights_are_exact() {
    let x = vec![0.25f32; 3 * 8];
    let w = vec![0.0f32; 5 * 8];
    for format in both() {
        let layer = QuantLinear::new(format, &w, &[1.0, 2.0, 3.0, 4.0, 5.0], 5, 8);
        let mut out = vec![0.0; 15];
        layer.forward(&mut out, &x, 3);
        assert_eq!(out[..5], [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(layer.weight(4, 7), 0.0);
    }
}

#[test]
#[ignore = "timing, by hand: cargo test --release -p steamrf-kernels quant::tests::timing -- --ignored --nocapture"]
fn timing() {
    use std::time::Instant;
    for (t, k, n) in [
        (1184usize, 384usize, 1152usize),
        (1184, 384, 1536),
        (1184, 1536, 384),
        (12, 384, 1152),
    ] {
        let x = values(t * k, 1);
        let w = values(n * k, 2);
        let b = vec![0.0f32; n];
        let mut out = vec![0.0f32; t * n];
        let reps = (2_000_000_000 / (t * k * n)).max(1);
        let mut time = |f: &mut dyn FnMut(&mut [f32])| {
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let s = Instant::now();
                for _ in 0..reps {
                    f(&mut out);
                }
                best = best.min(s.elapsed().as_secs_f64() / reps as f64);
            }
            best
        };
        let f32s = time(&mut |o| crate::nn::linear(o, &x, &w, &b, t, k, n));
        let flop = 2.0 * (t * k * n) as f64;
        let mut line = format!("{t}x{k}x{n}: f32 {:.0} GFLOP/s", flop / f32s / 1e9);
        for format in both() {
            let layer = QuantLinear::new(format, &w, &b, n, k);
            let s = time(&mut |o| layer.forward(o, &x, t));
            line += &format!(
                ", {format:?} {:.0} G op/s ({:.2}x)",
                flop / s / 1e9,
                f32s / s
            );
        }
        let layer = crate::bf16::Bf16Linear::new(&w, &b, n, k);
        let s = time(&mut |o| layer.forward(o, &x, t));
        line += &format!(", bf16 {:.0} GFLOP/s ({:.2}x)", flop / s / 1e9, f32s / s);
        eprintln!("{line}");
    }
}

#[derive(Debug, Clone)]
enum RowOp {
    Push(u64),
    Set(usize, u64),
    SwapRemove(usize),
}

fn row_op() -> impl Strategy<Value = RowOp> {
    prop_oneof![
        3 => (0u64..1000).prop_map(RowOp::Push),
        1 => (0usize..1000, 0u64..1000).prop_map(|(j, s)| RowOp::Set(j, s)),
        2 => (0usize..1000).prop_map(RowOp::SwapRemove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A layer edited row by row (appends across block boundaries, swap
    /// removals that drop a block, replacements) is byte for byte the layer
    /// built from the edited matrix, and computes the same outputs on the
    /// machine's fastest path.
    #[test]
    fn row_edits_equal_a_layer_built_from_the_result(
        k in 1usize..40,
        start in 0usize..60,
        ops in prop::collection::vec(row_op(), 1..80),
    ) {
        for format in both() {
            let mut rows: Vec<Vec<f32>> = (0..start).map(|j| values(k, j as u64)).collect();
            let flat = |rows: &[Vec<f32>]| rows.concat();
            let mut layer = QuantLinear::new(format, &flat(&rows), &vec![0.5; start], start, k);
            for op in &ops {
                match *op {
                    RowOp::Push(seed) => {
                        rows.push(values(k, seed));
                        layer.push_row(rows.last().unwrap(), 0.5);
                    }
                    RowOp::Set(j, seed) if !rows.is_empty() => {
                        let j = j % rows.len();
                        rows[j] = values(k, seed + 7);
                        layer.set_row(j, &rows[j]);
                    }
                    RowOp::SwapRemove(j) if !rows.is_empty() => {
                        let j = j % rows.len();
                        rows.swap_remove(j);
                        layer.swap_remove_row(j);
                    }
                    _ => {}
                }
                let n = rows.len();
                let built = QuantLinear::new(format, &flat(&rows), &vec![0.5; n], n, k);
                prop_assert_eq!(layer.outputs(), n);
                prop_assert!(layer.packed == built.packed);
                prop_assert_eq!(&layer.scale, &built.scale);
                prop_assert_eq!(&layer.col_sum, &built.col_sum);
                prop_assert_eq!(&layer.bias, &built.bias);
            }
            let n = rows.len();
            let built = QuantLinear::new(format, &flat(&rows), &vec![0.5; n], n, k);
            let x = values(5 * k, 3);
            let (mut a, mut b) = (vec![0.0; 5 * n], vec![0.0; 5 * n]);
            layer.forward(&mut a, &x, 5);
            built.forward(&mut b, &x, 5);
            prop_assert_eq!(a, b);
        }
    }
}
