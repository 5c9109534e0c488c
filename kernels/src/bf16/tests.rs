use proptest::prelude::*;

use super::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u64 * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// Which path `forward` takes on this machine, in the test log.
fn path() -> &'static str {
    if amx_available() { "amx" } else { "scalar" }
}

/// The packing (AVX-512 where the CPU has it) rounds as the `half` crate
/// does, on the values where rounding is delicate: ties, subnormals,
/// infinities, the largest finite value.
#[test]
fn packing_rounds_like_the_half_crate() {
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        // Exactly halfway between two bf16 values: ties go to the even one.
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
    ];
    let mut all: Vec<f32> = values(5000, 3).iter().map(|v| v * 1e3).collect();
    all.extend(specials);
    all.push(f32::NAN);
    let k = all.len();
    let mut got = vec![7u16; BLOCK * k.div_ceil(KT) * KT];
    pack_rows(&all, 1, k, BLOCK, &mut got, Input::AsIs);
    for (p, &v) in all.iter().enumerate() {
        let g = got[(p / KT) * TILE + p % KT];
        if v.is_nan() {
            assert!(from_bf16(g).is_nan());
        } else {
            assert_eq!(g, half::bf16::from_f32(v).to_bits(), "{v:e}");
        }
    }
}

proptest! {
    /// The AVX-512 packing gives the scalar values in the tile layout, NaN
    /// included, padding zero.
    #[test]
    fn packing_agrees(t in 1usize..40, k in 1usize..90, seed in 0u64..1000, nan in 0usize..3600) {
        let mut x: Vec<f32> = values(t * k, seed).iter().map(|v| v * 37.0).collect();
        x[nan % (t * k)] = f32::NAN;
        let (tp, kb) = (t.div_ceil(BLOCK) * BLOCK, k.div_ceil(KT));
        let mut got = vec![7u16; tp * kb * KT];
        pack_rows(&x, t, k, tp, &mut got, Input::AsIs);
        for i in 0..tp {
            for p in 0..kb * KT {
                let g = got[(i / TT) * kb * TILE + (p / KT) * TILE + (i % TT) * KT + p % KT];
                if i >= t || p >= k {
                    prop_assert_eq!(g, 0);
                } else if x[i * k + p].is_nan() {
                    prop_assert!(from_bf16(g).is_nan());
                } else {
                    prop_assert_eq!(g, to_bf16(x[i * k + p]));
                }
            }
        }
    }

    /// GELU while packing gives the tiles of GELU first, then packing, to
    /// within one bf16 step (the packing's GELU refines a reciprocal where
    /// [`crate::nn::gelu`] divides: a few f32 ulps apart, which moves a value
    /// across a bf16 rounding boundary now and then), and `forward_gelu`
    /// `forward` of `gelu_erf(x)` to within what one such step can move an
    /// output.
    #[test]
    fn gelu_while_packing_is_gelu_then_packing(t in 1usize..40, k in 1usize..90, n in 1usize..40, seed in 0u64..1000) {
        let x: Vec<f32> = values(t * k, seed).iter().map(|v| v * 6.0).collect();
        let mut g = x.clone();
        crate::nn::gelu_erf(&mut g);
        let (tp, kb) = (t.div_ceil(BLOCK) * BLOCK, k.div_ceil(KT));
        let mut fused = vec![7u16; tp * kb * KT];
        let mut plain = vec![9u16; tp * kb * KT];
        pack_rows(&x, t, k, tp, &mut fused, Input::Gelu);
        pack_rows(&g, t, k, tp, &mut plain, Input::AsIs);
        // How far each packed input moved, and so the most a row's outputs
        // can move (weights |w| <= 1).
        let mut row_moved = vec![0.0f32; tp];
        for (i, moved) in row_moved.iter_mut().enumerate().take(t) {
            for p in 0..k {
                let at = (i / TT) * kb * TILE + (p / KT) * TILE + (i % TT) * KT + p % KT;
                let (f, q) = (from_bf16(fused[at]), from_bf16(plain[at]));
                // One bf16 step of the value, or a few f32 ulps of x where
                // 1 + erf cancels.
                let tol = q.abs() / 128.0 + 4.0 * f32::EPSILON * x[i * k + p].abs();
                prop_assert!((f - q).abs() <= tol, "{f:e} vs {q:e} for x = {}", x[i * k + p]);
                *moved += (f - q).abs();
            }
        }
        let layer = Bf16Linear::new(&values(n * k, seed + 1), &values(n, seed + 2), n, k);
        let mut a = vec![f32::NAN; t * n];
        let mut b = vec![f32::NAN; t * n];
        layer.forward_gelu(&mut a, &x, t);
        layer.forward(&mut b, &g, t);
        for (r, (a, b)) in a.chunks(n).zip(b.chunks(n)).enumerate() {
            for (a, b) in a.iter().zip(b) {
                // Plus f32 summation slack over k terms of |product| <= 6.
                prop_assert!((a - b).abs() <= row_moved[r] + 1e-5 * k as f32, "{}: {a} vs {b}", path());
            }
        }
    }

    /// A first FFN layer handing its GELU output packed to the second gives
    /// the bits of the two steps through f32 (`forward`, then
    /// `forward_gelu`) on AMX, and the same values to f32 rounding on the
    /// scalar path; the packed rows are the packing of that GELU output.
    #[test]
    fn packed_handover_is_forward_then_forward_gelu(t in 0usize..70, k in 1usize..70, n in 1usize..70, m in 1usize..40, seed in 0u64..1000) {
        let x: Vec<f32> = values(t * k, seed).iter().map(|v| v * 3.0).collect();
        let first = Bf16Linear::new(&values(n * k, seed + 1), &values(n, seed + 2), n, k);
        let second = Bf16Linear::new(&values(m * n, seed + 3), &values(m, seed + 4), m, n);
        let mut y = vec![f32::NAN; t * n];
        let mut want = vec![f32::NAN; t * m];
        first.forward(&mut y, &x, t);
        second.forward_gelu(&mut want, &y, t);
        let mut rows = Bf16Rows::new();
        // Used once for another shape first: each call resizes it.
        first.forward_gelu_packed(&mut rows, &x[..k.min(x.len())], t.min(1));
        first.forward_gelu_packed(&mut rows, &x, t);
        prop_assert_eq!(rows.rows(), t);
        let mut got = vec![f32::NAN; t * m];
        second.forward_packed(&mut got, &rows);
        let tp = t.div_ceil(BLOCK) * BLOCK;
        let mut plain = vec![7u16; tp * n.div_ceil(KT) * KT];
        pack_rows(&y, t, n, tp, &mut plain, Input::Gelu);
        if amx_available() {
            prop_assert_eq!(&*rows.tiles, &plain[..]);
            prop_assert_eq!(got, want);
        } else {
            for (a, b) in got.iter().zip(&want) {
                prop_assert!((a - b).abs() <= 1e-5 * (n as f32 + 1.0), "{a} vs {b}");
            }
        }
    }

    /// The tiles and the scalar reference agree on odd shapes: row tails
    /// (t not a multiple of 32), output tails, inputs not a multiple of 32.
    #[test]
    fn tiles_match_the_scalar_reference(t in 0usize..70, k in 1usize..100, n in 1usize..80, seed in 0u64..1000) {
        let x = values(t * k, seed);
        let w = values(n * k, seed + 1);
        let bias = values(n, seed + 2);
        let layer = Bf16Linear::new(&w, &bias, n, k);
        let mut fast = vec![f32::NAN; t * n];
        let mut slow = vec![f32::NAN; t * n];
        layer.forward(&mut fast, &x, t);
        layer.forward_scalar(&mut slow, &x, t);
        for (a, b) in fast.iter().zip(&slow) {
            // f32 sums of k exact products, |product| <= 1.
            prop_assert!((a - b).abs() <= 2e-6 * (k as f32 + 1.0), "{}: {a} vs {b}", path());
        }
    }
}

/// The shapes of the embedder (MiniLM: k 384 and 1,536, n 384, 1,152 and
/// 1,536): against f32 the error is bf16's (8 bits of mantissa).
#[test]
fn embedder_shapes_are_close_to_f32() {
    eprintln!("bf16 Linear path on this machine: {}", path());
    for (t, k, n) in [(37, 384, 1152), (70, 1536, 384), (33, 384, 1536)] {
        let x = values(t * k, 11);
        let w: Vec<f32> = values(n * k, 12).iter().map(|v| v * 0.05).collect();
        let bias = values(n, 13);
        let layer = Bf16Linear::new(&w, &bias, n, k);
        let mut got = vec![0.0; t * n];
        layer.forward(&mut got, &x, t);
        let mut exact = vec![0.0; t * n];
        layer.forward_scalar(&mut exact, &x, t);
        for i in 0..t {
            for j in 0..n {
                let f32_ref: f32 =
                    bias[j] + (0..k).map(|p| x[i * k + p] * w[j * k + p]).sum::<f32>();
                let (g, e) = (got[i * n + j], exact[i * n + j]);
                assert!((g - e).abs() <= 1e-4, "{t}x{k}x{n}: {g} vs {e}");
                // Two roundings of 2^-9 relative each, over k terms of
                // magnitude <= 0.05, as a random walk with slack.
                assert!(
                    (g - f32_ref).abs() <= 0.02,
                    "{t}x{k}x{n}: {g} vs f32 {f32_ref}"
                );
            }
        }
    }
    let layer = Bf16Linear::new(&[0.1, -0.2], &[0.0], 1, 2);
    // Every tile row one cache line (crate::aligned).
    assert_eq!(layer.tiles.as_ptr() as usize % 64, 0);
    assert_eq!(layer.outputs(), 1);
    assert_eq!(layer.weight(0, 1), from_bf16(to_bf16(-0.2)));
}

/// What rounding and packing the activations costs per value, with and
/// without GELU, beside `gelu_erf` alone.
#[test]
#[ignore = "timing, by hand: cargo test --release -p steamrf-kernels bf16::tests::pack_timing -- --ignored --nocapture"]
fn pack_timing() {
    use std::time::Instant;
    for (t, k) in [(512usize, 384usize), (512, 1536)] {
        let x: Vec<f32> = values(t * k, 1).iter().map(|v| v * 3.0).collect();
        let tp = t.div_ceil(BLOCK) * BLOCK;
        let mut a = vec![0u16; tp * k.div_ceil(KT) * KT];
        for input in [Input::AsIs, Input::Gelu] {
            let mut best = f64::INFINITY;
            for _ in 0..50 {
                let s = Instant::now();
                pack_rows(&x, t, k, tp, &mut a, input);
                best = best.min(s.elapsed().as_secs_f64());
            }
            let mut g = x.clone();
            let s = Instant::now();
            crate::nn::gelu_erf(&mut g);
            let ge = s.elapsed().as_secs_f64();
            eprintln!(
                "{t}x{k} {input:?}: {:.1} us, {:.2} ns/value; gelu_erf alone {:.1} us",
                best * 1e6,
                best * 1e9 / (t * k) as f64,
                ge * 1e6
            );
        }
    }
}
