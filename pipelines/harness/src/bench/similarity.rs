//! `steamrf bench similarity`: GFLOP/s of the CPU kernel (top-k included)
//! beside numpy's matmul (OpenBLAS) on the same shapes, and the CUDA
//! kernel where a device works, in the same run.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use steamrf_pipelines::error::{Error, Result};

/// Options of `steamrf bench similarity`.
#[derive(Debug, Clone)]
pub struct SimilarityBench {
    /// Queries per call.
    pub queries: usize,
    /// Corpus rows.
    pub corpus: usize,
    /// Dimension.
    pub dim: usize,
    /// Hits per query.
    pub k: usize,
    /// Python with numpy and threadpoolctl (scripts/tools.sh installs one).
    pub python: PathBuf,
    /// `cpu` (reference: numpy/OpenBLAS) or `cuda` (reference: cuBLAS GEMM only).
    pub backend: String,
    /// `f32`, `f16` (CUDA only) or `int8` (CPU only).
    pub precision: String,
    /// With `int8`: candidates rescored exactly per query, × k.
    pub rescore: usize,
}

/// `steamrf bench similarity --backend cuda`: the CUDA kernel (cuBLAS GEMM +
/// top-k kernel, host merge) beside cuBLAS GEMM alone on the same shapes.
pub(super) fn similarity_cuda(
    b: &SimilarityBench,
    corpus: &steamrf_kernels::Corpus,
    queries: &[f32],
) -> Result<Vec<String>> {
    use steamrf_kernels::cuda::{CudaKernel, Precision};
    use steamrf_kernels::{SearchParams, SimilarityKernel, cpu::CpuKernel};
    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let precision = if b.precision == "f16" {
        Precision::F16
    } else {
        Precision::F32
    };
    let kernel = CudaKernel::new(0, precision).map_err(internal)?;
    let flops = 2.0 * b.queries as f64 * b.corpus as f64 * b.dim as f64;
    let params = SearchParams::top(b.k);
    // Warm-up: uploads the corpus (kept on the device) and loads cuBLAS.
    kernel.top_k(queries, corpus, &params).map_err(internal)?;
    let mut best = f64::INFINITY;
    let mut hits = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        hits = kernel.top_k(queries, corpus, &params).map_err(internal)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let mut gemm = f64::INFINITY;
    for _ in 0..3 {
        gemm = gemm.min(kernel.time_gemm_only(queries, corpus).map_err(internal)?);
    }
    let q4 = &queries[..(4 * b.dim).min(queries.len())];
    let cpu = CpuKernel::default()
        .top_k(q4, corpus, &params)
        .map_err(internal)?;
    let agree = cpu
        .iter()
        .zip(&hits)
        .filter(|(c, g)| c.first().map(|h| h.index) == g.first().map(|h| h.index))
        .count();
    let (ours, blas) = (flops / best / 1e9, flops / gemm / 1e9);
    Ok(vec![
        format!(
            "steamrf cuda kernel on {} ({precision:?}, blocks of {} rows, top-{} kernel + host merge): {best:.4} s, {ours:.0} GFLOP/s",
            kernel.name, kernel.block_rows, b.k
        ),
        format!("cuBLAS SGEMM only, same blocks: {gemm:.4} s, {blas:.0} GFLOP/s"),
        format!("top-1 agrees with the CPU kernel on {agree} of 4 queries"),
        format!(
            "RESULT steamrf_gflops={ours:.1} blas_gflops={blas:.1} ratio={:.3}",
            ours / blas
        ),
    ])
}

/// `steamrf bench similarity`: GFLOP/s of the CPU kernel (top-k included)
/// beside numpy's matmul (OpenBLAS) on the same shapes, in the same run.
///
/// # Errors
/// Kernel input errors, or the numpy reference failing to run.
pub fn similarity(b: &SimilarityBench) -> Result<Vec<String>> {
    use rand::{Rng, SeedableRng};
    use steamrf_kernels::{
        Corpus, SearchParams, SimilarityKernel, cpu::CpuKernel, reference::ScalarKernel,
    };
    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let mut out = Vec::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut normal =
        |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let corpus = Corpus::from_vec(normal(b.corpus * b.dim), b.dim).map_err(internal)?;
    let queries = normal(b.queries * b.dim);
    if b.backend == "cuda" {
        return similarity_cuda(b, &corpus, &queries);
    }
    let flops = 2.0 * b.queries as f64 * b.corpus as f64 * b.dim as f64;
    let kernel = CpuKernel::default();
    let params = SearchParams::top(b.k);
    // Warm-up on a slice of the work (pages in the corpus, spins up the threads).
    kernel
        .top_k(&queries[..b.dim.min(queries.len())], &corpus, &params)
        .map_err(internal)?;
    let mut best = f64::INFINITY;
    let mut hits = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        hits = kernel.top_k(&queries, &corpus, &params).map_err(internal)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let steamrf_gflops = flops / best / 1e9;
    out.push(format!(
        "steamrf cpu kernel ({} threads, blocks of {} rows x {} queries, top-{} fused): {best:.2} s, {steamrf_gflops:.1} GFLOP/s",
        kernel.threads, kernel.block_rows, kernel.query_block, b.k
    ));
    // Spot-check against the scalar reference on a few queries and a corpus slice.
    let sample_rows = b.corpus.min(20_000);
    let sample = Corpus::from_rows(&corpus.rows(0..sample_rows), b.dim).map_err(internal)?;
    let q4 = &queries[..(4 * b.dim).min(queries.len())];
    let fast = kernel.top_k(q4, &sample, &params).map_err(internal)?;
    let slow = ScalarKernel.top_k(q4, &sample, &params).map_err(internal)?;
    let max_diff = fast
        .iter()
        .zip(&slow)
        .flat_map(|(f, s)| f.iter().zip(s).map(|(a, b)| (a.score - b.score).abs()))
        .fold(0.0f32, f32::max);
    out.push(format!("  parity with the scalar reference (4 queries x {sample_rows} rows): max score difference {max_diff:.2e}; {} result lists", hits.len()));
    let (mut precision, mut ratio_vs_f32, mut recall) = ("f32", 1.0, 1.0);
    if b.precision == "int8" {
        let quant = steamrf_kernels::quant::QuantKernel::new(b.rescore).map_err(internal)?;
        // The first call also builds the int8 copy of the corpus: timed apart.
        let t = Instant::now();
        quant
            .top_k(&queries[..b.dim.min(queries.len())], &corpus, &params)
            .map_err(internal)?;
        let build = t.elapsed().as_secs_f64();
        let mut best8 = f64::INFINITY;
        let mut hits8 = Vec::new();
        for _ in 0..2 {
            let t = Instant::now();
            hits8 = quant.top_k(&queries, &corpus, &params).map_err(internal)?;
            best8 = best8.min(t.elapsed().as_secs_f64());
        }
        let (found, total) = hits
            .iter()
            .zip(&hits8)
            .fold((0, 0), |(f, n), (exact, got)| {
                let hit = |h: &&steamrf_kernels::Hit| got.iter().any(|g| g.index == h.index);
                (f + exact.iter().filter(hit).count(), n + exact.len())
            });
        precision = "int8";
        ratio_vs_f32 = best / best8;
        recall = found as f64 / total.max(1) as f64;
        out.push(format!(
            "steamrf int8 kernel ({}, {} threads, {} x k candidates rescored in f32): {best8:.2} s, {:.1} G op/s, {ratio_vs_f32:.2}x the f32 kernel; recall@{} against it {recall:.4}; int8 copy of the corpus {:.0} MiB (f32 {:.0} MiB), built in {build:.2} s",
            match steamrf_kernels::quant::int8_unit() {
                "amx" => "AMX-INT8 tiles",
                _ => "AVX-512 VNNI",
            },
            quant.threads,
            quant.rescore,
            flops / best8 / 1e9,
            b.k,
            quant.shadow_bytes() as f64 / (1 << 20) as f64,
            corpus.bytes() as f64 / (1 << 20) as f64,
        ));
    }

    let output = Command::new(&b.python)
        .arg("scripts/blas_bench.py")
        .args([
            "--queries",
            &b.queries.to_string(),
            "--corpus",
            &b.corpus.to_string(),
        ])
        .args(["--dim", &b.dim.to_string(), "--k", &b.k.to_string()])
        // Those two slow a current OpenBLAS down; unset for this command only.
        .env_remove("OPENBLAS_CORETYPE")
        .env_remove("OPENBLAS_L2_SIZE")
        .output()
        .map_err(|source| Error::Io {
            context: format!("running {}", b.python.display()),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::Internal {
            message: format!(
                "blas_bench.py failed: {}",
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| Error::Internal {
            message: format!("blas_bench.py output: {e}"),
        })?;
    let blas_gflops = report["gemm_gflops"].as_f64().unwrap_or(f64::NAN);
    out.push(format!(
        "numpy matmul (GEMM only, corpus in blocks of 16384): {blas_gflops:.1} GFLOP/s; with a top-{} per block: {:.1} GFLOP/s; BLAS: {}",
        b.k,
        report["topk_gflops"].as_f64().unwrap_or(f64::NAN),
        report["blas"]
    ));
    out.push(format!(
        "RESULT steamrf_gflops={steamrf_gflops:.1} blas_gflops={blas_gflops:.1} ratio={:.3} precision={precision} int8_unit={} ratio_vs_f32={ratio_vs_f32:.3} recall_at_{}={recall:.4}",
        steamrf_gflops / blas_gflops,
        if precision == "int8" {
            steamrf_kernels::quant::int8_unit()
        } else {
            "none"
        },
        b.k
    ));
    Ok(out)
}
