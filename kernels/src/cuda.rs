//! The CUDA backend: cuBLAS GEMM for the scores of a corpus block, then a
//! top-k kernel (`cuda/topk.cu`, compiled at run time by NVRTC) per query
//! row; the per-block lists are merged on the host.
//!
//! - CUDA is loaded dynamically (cudarc's `dynamic-loading`): building and
//!   running need no CUDA on the machine. [`CudaKernel::new`] checks for the
//!   driver and NVRTC libraries first and returns [`Error::Unavailable`]
//!   instead of letting cudarc panic.
//! - The corpus lives on the device and is updated incrementally: only the
//!   rows changed since the last call are uploaded ([`Corpus::changed_since`]).
//! - f32, or f16 storage and GEMM inputs/outputs with f32 accumulation
//!   ([`Precision::F16`]), which halves memory and doubles tensor-core speed at
//!   ~1e-3 score error.
//! - The exclusion filter is a host closure, so the device returns up to
//!   k + 16 candidates per query and the host filters them; a query left with
//!   fewer than k hits while its candidate list was full is recomputed on
//!   the CPU, so results are exact whatever the filter.
//!
//! [`select`] picks CUDA when a device is present, else the CPU kernel,
//! and says which (log line and `backend` label).

use std::sync::{Arc, Mutex};

use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::cpu::CpuKernel;
use crate::topk::TopK;
use crate::{
    Backend, Corpus, Error, Hit, PerCorpus, Prepared, Result, SearchParams, SimilarityKernel,
    prepare_search,
};

/// The top-k kernel's source.
pub const TOPK_SOURCE: &str = include_str!("cuda/topk.cu");

/// Candidates the device keeps per query per block at most (`MAXK` in the source).
pub const MAX_DEVICE_K: usize = 32;
/// Extra candidates fetched per query when an exclusion filter is set.
const FILTER_SLACK: usize = 16;
/// Threads per block of the top-k kernel (`THREADS` in the source).
const TOPK_THREADS: u32 = 128;

/// Storage and GEMM precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 everywhere.
    #[default]
    F32,
    /// f16 corpus, queries and scores; f32 accumulation.
    F16,
}

fn unavailable(message: impl Into<String>) -> Error {
    Error::Unavailable {
        backend: Backend::Cuda,
        message: message.into(),
    }
}

/// Whether the CUDA driver and NVRTC libraries can be loaded (no panic).
pub fn libraries_present() -> (bool, bool) {
    // SAFETY: these only try to dlopen the libraries and report success;
    // they touch no CUDA state.
    unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    }
}

/// Compiles the kernels with NVRTC (no device needed: CI runs this).
///
/// # Errors
/// [`Error::Unavailable`] without libnvrtc, or the compiler's log.
pub fn compile() -> Result<cudarc::nvrtc::Ptx> {
    if !libraries_present().1 {
        return Err(unavailable(
            "libnvrtc not found (put it on LD_LIBRARY_PATH; PyPI: nvidia-cuda-nvrtc-cu12)",
        ));
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        TOPK_SOURCE,
        cudarc::nvrtc::CompileOptions {
            name: Some("topk.cu".into()),
            ..Default::default()
        },
    )
    .map_err(|e| unavailable(format!("NVRTC failed to compile topk.cu: {e:?}")))
}

struct DeviceCorpus {
    version: u64,
    rows: usize,
    capacity: usize,
    f32: CudaSlice<f32>,
    f16: Option<CudaSlice<half::f16>>,
}

/// cuBLAS is column-major: the block's `n` rows are a dim×n matrix (lda =
/// dim), the queries dim×nq (ldb = dim); Aᵀ·B is n×nq (ldc = n), i.e. one
/// contiguous row of `n` scores per query.
/// `one` and `zero` are alpha and beta in the storage type.
fn scores_gemm<T>(n: usize, nq: usize, dim: usize, one: T, zero: T) -> GemmConfig<T> {
    GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: nq as i32,
        k: dim as i32,
        alpha: one,
        lda: dim as i32,
        ldb: dim as i32,
        beta: zero,
        ldc: n as i32,
    }
}

/// One call's scores buffer, in the storage precision, with the matching
/// device corpus and queries.
enum Scores<'a> {
    F32(CudaSlice<f32>),
    F16 {
        buf: CudaSlice<half::f16>,
        corpus: &'a CudaSlice<half::f16>,
        queries: &'a CudaSlice<half::f16>,
    },
}

/// One top-k launch over a block of scores.
struct TopkLaunch {
    nq: usize,
    n: usize,
    offset: usize,
    k: usize,
    min_score: f32,
}

/// The CUDA similarity kernel.
pub struct CudaKernel {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    topk_f32: CudaFunction,
    topk_f16: CudaFunction,
    to_f16: CudaFunction,
    /// The device copy of each corpus searched (one per tenant where
    /// relation extraction partitions by tenant), freed with its corpus.
    device: Mutex<PerCorpus<DeviceCorpus>>,
    /// Corpus rows per GEMM.
    pub block_rows: usize,
    /// Storage precision.
    pub precision: Precision,
    /// The device's name.
    pub name: String,
}

impl std::fmt::Debug for CudaKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernel")
            .field("name", &self.name)
            .field("block_rows", &self.block_rows)
            .field("precision", &self.precision)
            .finish_non_exhaustive()
    }
}

fn driver(e: impl std::fmt::Debug) -> Error {
    unavailable(format!("CUDA: {e:?}"))
}

impl CudaKernel {
    /// Opens device `ordinal`, compiles the kernels and sets up cuBLAS.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without the libraries, without a device, or if
    /// compilation fails; never a panic.
    pub fn new(ordinal: usize, precision: Precision) -> Result<Self> {
        let (has_driver, _) = libraries_present();
        if !has_driver {
            return Err(unavailable("libcuda not found: no NVIDIA driver"));
        }
        let ptx = compile()?;
        let ctx = CudaContext::new(ordinal).map_err(driver)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let stream = ctx.default_stream();
        let module = ctx.load_module(ptx).map_err(driver)?;
        let f = |n: &str| module.load_function(n).map_err(driver);
        Ok(Self {
            blas: CudaBlas::new(stream.clone()).map_err(driver)?,
            topk_f32: f("topk_f32")?,
            topk_f16: f("topk_f16")?,
            to_f16: f("to_f16")?,
            stream,
            device: Mutex::default(),
            block_rows: 65_536,
            precision,
            name,
        })
    }

    fn f16_of(&self, src: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<half::f16>> {
        let mut dst = self
            .stream
            .alloc_zeros::<half::f16>(n.max(1))
            .map_err(driver)?;
        let n64 = n as i64;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `to_f16(src, dst, n)` reads n floats of `src` and writes n
        // halves of `dst`; both hold at least n elements.
        unsafe {
            self.stream
                .launch_builder(&self.to_f16)
                .arg(src)
                .arg(&mut dst)
                .arg(&n64)
                .launch(cfg)
                .map_err(driver)?;
        }
        Ok(dst)
    }

    /// Brings the device copy of `corpus` up to date (incrementally when it
    /// can) and runs `f` with it.
    fn with_device<T>(
        &self,
        corpus: &Corpus,
        f: impl FnOnce(&DeviceCorpus) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self
            .device
            .lock()
            .map_err(|_| unavailable("poisoned device state"))?;
        let dim = corpus.dim();
        let rows = corpus.len();
        let mut slot = guard.take(corpus);
        let reuse = slot.as_ref().and_then(|d| {
            (rows <= d.capacity)
                .then(|| corpus.changed_since(d.version))
                .flatten()
        });
        match (slot.as_mut(), reuse) {
            (Some(d), Some(ranges)) => {
                if !ranges.is_empty() {
                    // The half-precision copy is rebuilt from the updated rows.
                    d.f16 = None;
                }
                for r in ranges {
                    let (a, b) = (r.start * dim, r.end.min(rows) * dim);
                    if a < b {
                        let mut view = d.f32.slice_mut(a..b);
                        self.stream
                            .memcpy_htod(&*corpus.rows(r.start..r.end.min(rows)), &mut view)
                            .map_err(driver)?;
                    }
                }
                d.version = corpus.version();
                d.rows = rows;
            }
            _ => {
                // Whole upload, with room to grow by half before the next one.
                let capacity = rows + rows / 2 + 1024;
                let mut buf = self
                    .stream
                    .alloc_zeros::<f32>(capacity * dim.max(1))
                    .map_err(driver)?;
                if rows > 0 {
                    let mut view = buf.slice_mut(0..rows * dim);
                    self.stream
                        .memcpy_htod(&*corpus.values(), &mut view)
                        .map_err(driver)?;
                }
                slot = Some(DeviceCorpus {
                    version: corpus.version(),
                    rows,
                    capacity,
                    f32: buf,
                    f16: None,
                });
            }
        }
        let mut d = slot.ok_or_else(|| unavailable("no device corpus"))?;
        if self.precision == Precision::F16 && d.f16.is_none() {
            d.f16 = Some(self.f16_of(&d.f32, d.rows * dim)?);
        }
        let out = f(&d);
        guard.put(corpus, d);
        out
    }

    /// Runs the top-k kernel `func` over one block's `scores` (nq rows of n),
    /// writing nq × k results into `out_s` / `out_i`.
    fn launch_topk<T: cudarc::driver::DeviceRepr>(
        &self,
        func: &CudaFunction,
        scores: &CudaSlice<T>,
        t: &TopkLaunch,
        out_s: &mut CudaSlice<f32>,
        out_i: &mut CudaSlice<u32>,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (t.nq as u32, 1, 1),
            block_dim: (TOPK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ld, n_valid, offset, k) = (t.n as i32, t.n as i32, t.offset as u32, t.k as i32);
        // SAFETY: the kernel reads nq rows of `ld` values of `scores` (which
        // holds at least nq × n) and writes nq × k values into `out_s` and
        // `out_i` (allocated with that size); T matches the kernel's type.
        unsafe {
            self.stream
                .launch_builder(func)
                .arg(scores)
                .arg(&ld)
                .arg(&n_valid)
                .arg(&offset)
                .arg(&k)
                .arg(&t.min_score)
                .arg(out_s)
                .arg(out_i)
                .launch(cfg)
                .map_err(driver)?;
        }
        Ok(())
    }

    /// Device top-`kk` per query, merged over blocks, before host filtering.
    fn device_top(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        kk: usize,
        min_score: f32,
    ) -> Result<Vec<Vec<Hit>>> {
        let dim = corpus.dim();
        let nq = queries.len() / dim;
        let q32 = self.stream.clone_htod(queries).map_err(driver)?;
        let q16 = match self.precision {
            Precision::F16 => Some(self.f16_of(&q32, queries.len())?),
            Precision::F32 => None,
        };
        let mut merged: Vec<TopK> = (0..nq).map(|_| TopK::new(kk)).collect();
        self.with_device(corpus, |d| {
            let block = self.block_rows.max(1);
            let mut out_s = self.stream.alloc_zeros::<f32>(nq * kk).map_err(driver)?;
            let mut out_i = self.stream.alloc_zeros::<u32>(nq * kk).map_err(driver)?;
            // One scores buffer for every block (the last may use less of it).
            let cap = nq * block.min(d.rows.max(1));
            let mut scores = match (&d.f16, &q16) {
                (Some(corpus), Some(queries)) => Scores::F16 {
                    buf: self.stream.alloc_zeros(cap).map_err(driver)?,
                    corpus,
                    queries,
                },
                _ => Scores::F32(self.stream.alloc_zeros(cap).map_err(driver)?),
            };
            let mut start = 0;
            while start < d.rows {
                let n = block.min(d.rows - start);
                let rows = start * dim..(start + n) * dim;
                let topk = TopkLaunch {
                    nq,
                    n,
                    offset: start,
                    k: kk,
                    min_score,
                };
                // Both GEMMs: A is the block's n×dim rows (column-major dim×n,
                // lda = dim), B the nq×dim queries (dim×nq, ldb = dim), C is
                // n×nq (ldc = n) in a buffer of nq × block ≥ nq × n values.
                match &mut scores {
                    Scores::F16 {
                        buf,
                        corpus,
                        queries,
                    } => {
                        let cfg = scores_gemm(n, nq, dim, half::f16::ONE, half::f16::ZERO);
                        let a = corpus.slice(rows);
                        // SAFETY: shapes and strides in bounds, as stated above.
                        unsafe { self.blas.gemm(cfg, &a, *queries, buf) }.map_err(driver)?;
                        self.launch_topk(&self.topk_f16, buf, &topk, &mut out_s, &mut out_i)?;
                    }
                    Scores::F32(buf) => {
                        let cfg = scores_gemm(n, nq, dim, 1.0f32, 0.0);
                        let a = d.f32.slice(rows);
                        // SAFETY: shapes and strides in bounds, as stated above.
                        unsafe { self.blas.gemm(cfg, &a, &q32, buf) }.map_err(driver)?;
                        self.launch_topk(&self.topk_f32, buf, &topk, &mut out_s, &mut out_i)?;
                    }
                }
                let s = self.stream.clone_dtoh(&out_s).map_err(driver)?;
                let i = self.stream.clone_dtoh(&out_i).map_err(driver)?;
                for (q, topk) in merged.iter_mut().enumerate() {
                    for r in 0..kk {
                        let idx = i[q * kk + r];
                        if idx != u32::MAX {
                            topk.push(Hit {
                                index: idx,
                                score: s[q * kk + r],
                            });
                        }
                    }
                }
                start += n;
            }
            Ok(())
        })?;
        Ok(merged.into_iter().map(TopK::into_sorted).collect())
    }
}

impl CudaKernel {
    /// Seconds for the scores alone (cuBLAS GEMM over every corpus block, no
    /// top-k), on the same shapes: the reference `bench similarity --backend
    /// cuda` compares against.
    ///
    /// # Errors
    /// CUDA failures.
    pub fn time_gemm_only(&self, queries: &[f32], corpus: &Corpus) -> Result<f64> {
        let dim = corpus.dim();
        let nq = queries.len() / dim.max(1);
        let q32 = self.stream.clone_htod(queries).map_err(driver)?;
        self.with_device(corpus, |d| {
            let block = self.block_rows.max(1);
            let mut scores = self
                .stream
                .alloc_zeros::<f32>(nq * block.min(d.rows.max(1)))
                .map_err(driver)?;
            self.stream.synchronize().map_err(driver)?;
            let t = std::time::Instant::now();
            let mut start = 0;
            while start < d.rows {
                let n = block.min(d.rows - start);
                let cfg = scores_gemm(n, nq, dim, 1.0f32, 0.0);
                let a = d.f32.slice(start * dim..(start + n) * dim);
                // SAFETY: the same shapes as in `device_top`; `scores` holds
                // nq × block ≥ nq × n values.
                unsafe { self.blas.gemm(cfg, &a, &q32, &mut scores) }.map_err(driver)?;
                start += n;
            }
            self.stream.synchronize().map_err(driver)?;
            Ok(t.elapsed().as_secs_f64())
        })
    }
}

impl SimilarityKernel for CudaKernel {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn top_k(
        &self,
        queries: &[f32],
        corpus: &Corpus,
        params: &SearchParams<'_>,
    ) -> Result<Vec<Vec<Hit>>> {
        let q = match prepare_search(queries, corpus, params)? {
            Prepared::Search(q) => q,
            Prepared::Answered(hits) => return Ok(hits),
        };
        let slack = if params.exclude.is_some() {
            FILTER_SLACK
        } else {
            0
        };
        let kk = params.k + slack;
        if kk > MAX_DEVICE_K {
            // Beyond what one device pass keeps per query: the CPU kernel answers.
            return CpuKernel::default().top_k(queries, corpus, params);
        }
        let mut hits = self.device_top(&q, corpus, kk, params.min_score)?;
        let mut redo = Vec::new();
        for (qi, h) in hits.iter_mut().enumerate() {
            let full = h.len() == kk;
            if let Some(ex) = params.exclude {
                h.retain(|x| !ex(qi, x.index as usize));
            }
            if h.len() < params.k && full && slack > 0 {
                redo.push(qi);
            }
            h.truncate(params.k);
        }
        if !redo.is_empty() {
            // Exact answers for queries whose filter removed too many candidates.
            let dim = corpus.dim();
            let mut sub = Vec::with_capacity(redo.len() * dim);
            for &qi in &redo {
                sub.extend_from_slice(&q[qi * dim..(qi + 1) * dim]);
            }
            let map = |i: usize| redo[i];
            let ex = params.exclude;
            let remapped = move |i: usize, row: usize| ex.is_some_and(|f| f(map(i), row));
            let p = SearchParams {
                exclude: Some(&remapped),
                ..*params
            };
            for (j, h) in CpuKernel::default()
                .top_k(&sub, corpus, &p)?
                .into_iter()
                .enumerate()
            {
                hits[redo[j]] = h;
            }
        }
        Ok(hits)
    }
}

/// Which backend to use: `"auto"` (CUDA if a device works, else CPU),
/// `"cuda"` (fail without one) or `"cpu"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// CUDA when available.
    Auto,
    /// CUDA or an error.
    Cuda,
    /// The CPU kernel.
    Cpu,
}

/// How the CPU kernel scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuPrecision {
    /// int8 ([`crate::quant::QuantKernel`]) where the CPU has AVX-512 VNNI, else f32.
    Auto,
    /// [`CpuKernel`]: exact f32.
    F32,
    /// int8 scoring with exact f32 rescoring, or an error without VNNI.
    Int8,
}

impl CpuPrecision {
    /// Whether the CPU scores in int8: `Int8`, or `Auto` on a CPU with
    /// AVX-512 VNNI (what [`select`] picks; the IVF's lists follow it).
    pub fn int8(self) -> bool {
        match self {
            Self::F32 => false,
            Self::Int8 => true,
            Self::Auto => crate::quant::vnni_available(),
        }
    }
}

/// Builds the kernel for `choice`, logging which backend runs and why. On
/// the CPU, `cpu` picks f32 or int8 (rescoring `k · rescore` candidates).
///
/// # Errors
/// [`Choice::Cuda`] without a usable device; [`CpuPrecision::Int8`] on a
/// CPU without AVX-512 VNNI.
pub fn select(
    choice: Choice,
    precision: Precision,
    cpu: CpuPrecision,
    rescore: usize,
) -> Result<Arc<dyn SimilarityKernel>> {
    let on_cpu = |why: &str| -> Result<Arc<dyn SimilarityKernel>> {
        match (cpu, crate::quant::QuantKernel::new(rescore)) {
            (CpuPrecision::Auto | CpuPrecision::Int8, Ok(k)) => {
                tracing::info!(
                    backend = "cpu",
                    precision = "int8",
                    rescore,
                    "Similarity kernel: CPU, int8 with exact rescoring ({why})."
                );
                Ok(Arc::new(k))
            }
            (CpuPrecision::Int8, Err(e)) => Err(e),
            _ => {
                tracing::info!(
                    backend = "cpu",
                    precision = "f32",
                    "Similarity kernel: CPU ({why})."
                );
                Ok(Arc::new(CpuKernel::default()))
            }
        }
    };
    match choice {
        Choice::Cpu => on_cpu("configured"),
        Choice::Cuda | Choice::Auto => match CudaKernel::new(0, precision) {
            Ok(k) => {
                tracing::info!(backend = "cuda", device = %k.name, ?precision, "Similarity kernel: CUDA.");
                Ok(Arc::new(k))
            }
            Err(e) if choice == Choice::Auto => {
                tracing::info!(reason = %e, "No usable CUDA device.");
                on_cpu("no usable CUDA device")
            }
            Err(e) => Err(e),
        },
    }
}

#[cfg(test)]
mod tests;
