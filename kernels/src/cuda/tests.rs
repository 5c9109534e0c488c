use proptest::prelude::*;

use super::*;
use crate::reference::ScalarKernel;

fn nvrtc_required() -> bool {
    std::env::var_os("STEAMRF_REQUIRE_NVRTC").is_some()
}

fn gpu_required() -> bool {
    std::env::var_os("STEAMRF_REQUIRE_GPU").is_some()
}

/// CI compiles the kernels with NVRTC from PyPI (no GPU needed): a kernel
/// that fails to compile fails the build.
#[test]
fn kernels_compile_with_nvrtc() {
    match compile() {
        Ok(ptx) => {
            let text = ptx.to_src();
            for f in ["topk_f32", "topk_f16", "to_f16"] {
                assert!(text.contains(f), "{f} missing from the PTX");
            }
        }
        Err(Error::Unavailable { message, .. }) if !nvrtc_required() => {
            eprintln!("skipped: {message} (scripts/test.sh provides NVRTC)");
        }
        Err(e) => panic!("{e}"),
    }
}

/// Without a driver (this CI machine), opening the backend is an error, not
/// a panic, and `auto` falls back to the CPU kernel.
#[test]
fn no_device_is_an_error_and_auto_falls_back_to_cpu() {
    let (driver, _) = libraries_present();
    match CudaKernel::new(0, Precision::F32) {
        Ok(k) => assert!(driver, "a device without libcuda? {k:?}"),
        Err(Error::Unavailable { backend, .. }) => {
            assert_eq!(backend, Backend::Cuda);
            let k = select(Choice::Auto, Precision::F32, CpuPrecision::Auto, 4).unwrap();
            assert_eq!(k.backend(), Backend::Cpu);
            assert!(select(Choice::Cuda, Precision::F32, CpuPrecision::Auto, 4).is_err());
            assert!(
                !gpu_required(),
                "STEAMRF_REQUIRE_GPU is set but no device works"
            );
        }
        Err(e) => panic!("{e}"),
    }
    for cpu in [CpuPrecision::Auto, CpuPrecision::F32] {
        assert_eq!(
            select(Choice::Cpu, Precision::F32, cpu, 4)
                .unwrap()
                .backend(),
            Backend::Cpu
        );
    }
    // int8 on request: the kernel where the CPU has VNNI, a named error elsewhere.
    match select(Choice::Cpu, Precision::F32, CpuPrecision::Int8, 4) {
        Ok(k) => assert!(crate::quant::vnni_available(), "{:?}", k.backend()),
        Err(e) => assert!(e.to_string().contains("VNNI"), "{e}"),
    }
}

fn device() -> Option<CudaKernel> {
    match CudaKernel::new(0, Precision::F32) {
        Ok(k) => Some(k),
        Err(e) => {
            assert!(!gpu_required(), "STEAMRF_REQUIRE_GPU is set: {e}");
            None
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// On a GPU (skipped without one, required by kernels/gpu-check.sh): the
    /// CUDA backend returns the scalar reference's hits (scores within 1e-4;
    /// the same indices except where scores tie within that).
    #[test]
    fn cuda_matches_the_reference(
        nq in 1usize..9,
        rows in 0usize..3000,
        dim in 1usize..70,
        k in 0usize..20,
        min in prop_oneof![Just(f32::NEG_INFINITY), -0.2f32..0.5],
        filter in any::<bool>(),
        seed in 0u64..1000,
    ) {
        let Some(gpu) = device() else { return Ok(()) };
        let val = |i: usize| (((i as u64).wrapping_mul(2654435761).wrapping_add(seed)) % 2001) as f32 / 1000.0 - 1.0;
        let mut data: Vec<f32> = (0..rows * dim).map(val).collect();
        // Exact duplicates make ties.
        if rows > 10 {
            let (a, b) = data.split_at_mut(5 * dim);
            b[..dim].copy_from_slice(&a[..dim]);
        }
        let corpus = Corpus::from_vec(data, dim).unwrap_or_else(|_| Corpus::new(dim));
        let queries: Vec<f32> = (0..nq * dim).map(|i| val(i + 99_991)).collect();
        let odd = |_q: usize, r: usize| r.is_multiple_of(3);
        let params = SearchParams { k, min_score: min, exclude: if filter { Some(&odd) } else { None } };
        let Ok(want) = ScalarKernel.top_k(&queries, &corpus, &params) else { return Ok(()) };
        let got = gpu.top_k(&queries, &corpus, &params).unwrap();
        prop_assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            prop_assert_eq!(g.len(), w.len());
            for (a, b) in g.iter().zip(w) {
                prop_assert!((a.score - b.score).abs() < 1e-4, "{} vs {}", a.score, b.score);
                if a.index != b.index {
                    prop_assert!((a.score - b.score).abs() < 1e-4);
                }
            }
        }
    }
}

/// Incremental device updates: after appending and replacing rows, the
/// device copy answers like a fresh one.
#[test]
fn device_copy_follows_corpus_changes() {
    let Some(gpu) = device() else { return };
    let mut c = Corpus::from_rows(&[1.0, 0.0, 0.0, 1.0], 2).unwrap();
    let p = SearchParams::top(1);
    assert_eq!(gpu.top_k(&[0.0, 1.0], &c, &p).unwrap()[0][0].index, 1);
    c.push_rows(&[-1.0, 1.0]).unwrap();
    c.set_row(1, &[1.0, 0.1]).unwrap();
    let hits = gpu.top_k(&[-1.0, 0.9], &c, &p).unwrap();
    assert_eq!(hits[0][0].index, 2);
}
