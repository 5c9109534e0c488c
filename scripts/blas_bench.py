#!/usr/bin/env python3
"""The BLAS reference for `steamrf bench similarity`: numpy's matmul (OpenBLAS,
as bundled in the numpy wheel) on the same shapes, corpus streamed in blocks.

Prints one JSON object: GEMM-only GFLOP/s, GFLOP/s with a top-k per block
(argpartition), and which BLAS kernel threadpoolctl says is running.
"""
import argparse, json, time
import numpy as np
from threadpoolctl import threadpool_info

ap = argparse.ArgumentParser()
ap.add_argument("--queries", type=int, default=1000)
ap.add_argument("--corpus", type=int, default=1_000_000)
ap.add_argument("--dim", type=int, default=384)
ap.add_argument("--k", type=int, default=10)
ap.add_argument("--block", type=int, default=16384)
a = ap.parse_args()

rng = np.random.default_rng(0)
q = rng.standard_normal((a.queries, a.dim), dtype=np.float32)
q /= np.linalg.norm(q, axis=1, keepdims=True)
c = rng.standard_normal((a.corpus, a.dim), dtype=np.float32)
c /= np.linalg.norm(c, axis=1, keepdims=True)
out = np.empty((a.queries, a.block), dtype=np.float32)
flops = 2.0 * a.queries * a.corpus * a.dim

def gemm_only():
    t = time.perf_counter()
    for s in range(0, a.corpus, a.block):
        blk = c[s:s + a.block]
        np.matmul(q, blk.T, out=out[:, :blk.shape[0]])
    return time.perf_counter() - t

def with_topk():
    t = time.perf_counter()
    best_s = np.full((a.queries, a.k), -np.inf, dtype=np.float32)
    best_i = np.zeros((a.queries, a.k), dtype=np.int64)
    for s in range(0, a.corpus, a.block):
        blk = c[s:s + a.block]
        sc = np.matmul(q, blk.T, out=out[:, :blk.shape[0]])
        kk = min(a.k, sc.shape[1])
        idx = np.argpartition(-sc, kk - 1, axis=1)[:, :kk]
        cand_s = np.concatenate([best_s, np.take_along_axis(sc, idx, 1)], axis=1)
        cand_i = np.concatenate([best_i, idx + s], axis=1)
        top = np.argpartition(-cand_s, a.k - 1, axis=1)[:, :a.k]
        best_s = np.take_along_axis(cand_s, top, 1)
        best_i = np.take_along_axis(cand_i, top, 1)
    return time.perf_counter() - t

gemm_only()  # warm-up: page in the corpus, start the BLAS threads
t_gemm = min(gemm_only() for _ in range(2))
t_topk = with_topk()
blas = [{k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")} for i in threadpool_info() if i.get("user_api") == "blas"]
print(json.dumps({"gemm_seconds": t_gemm, "gemm_gflops": flops / t_gemm / 1e9,
                  "topk_seconds": t_topk, "topk_gflops": flops / t_topk / 1e9, "blas": blas}))
