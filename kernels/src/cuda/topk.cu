// Top-k per query over a block of precomputed scores (one row per query,
// written by cuBLAS), compiled at run time by NVRTC. No headers: f16 scores
// are converted with inline PTX.
//
// One thread block per query row. Each thread keeps its own best K' (score
// descending, index ascending on ties, only scores >= min_score) over a
// strided slice of the row, in registers; the block then merges the
// per-thread lists in shared memory with K' rounds of a block-wide argmax.

#define THREADS 128
#define MAXK 32
#define NO_INDEX 0xffffffffu

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }

__device__ __forceinline__ float load(const unsigned short* p, long i) {
    float f;
    unsigned short h = p[i];
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ bool better(float s, unsigned i, float t, unsigned j) {
    return s > t || (s == t && i < j);
}

template <typename T>
__device__ void topk_rows(const T* scores, int ld, int n_valid, unsigned row_offset, int k,
                          float min_score, float* out_s, unsigned* out_i) {
    __shared__ float ss[THREADS * MAXK];
    __shared__ unsigned si[THREADS * MAXK];
    __shared__ float ws[THREADS / 32];
    __shared__ unsigned wi[THREADS / 32];
    __shared__ int wt[THREADS / 32];
    __shared__ int winner;

    const int q = blockIdx.x;
    const T* row = scores + (long)q * ld;
    float ls[MAXK];
    unsigned li[MAXK];
    int cnt = 0;
    for (int j = threadIdx.x; j < n_valid; j += THREADS) {
        float s = load(row, j);
        if (!(s >= min_score)) continue;
        unsigned idx = (unsigned)j;
        if (cnt == k && !better(s, idx, ls[k - 1], li[k - 1])) continue;
        int p = cnt < k ? cnt : k - 1;
        while (p > 0 && better(s, idx, ls[p - 1], li[p - 1])) {
            ls[p] = ls[p - 1];
            li[p] = li[p - 1];
            p--;
        }
        ls[p] = s;
        li[p] = idx;
        if (cnt < k) cnt++;
    }
    for (int t = 0; t < MAXK; t++) {
        ss[threadIdx.x * MAXK + t] = t < cnt ? ls[t] : neg_inf();
        si[threadIdx.x * MAXK + t] = t < cnt ? li[t] : NO_INDEX;
    }
    __syncthreads();
    int head = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = 0; r < k; r++) {
        float s = head < MAXK ? ss[threadIdx.x * MAXK + head] : neg_inf();
        unsigned i = head < MAXK ? si[threadIdx.x * MAXK + head] : NO_INDEX;
        int t = threadIdx.x;
        for (int off = 16; off > 0; off >>= 1) {
            float s2 = __shfl_down_sync(0xffffffffu, s, off);
            unsigned i2 = __shfl_down_sync(0xffffffffu, i, off);
            int t2 = __shfl_down_sync(0xffffffffu, t, off);
            if (better(s2, i2, s, i)) { s = s2; i = i2; t = t2; }
        }
        if (lane == 0) { ws[warp] = s; wi[warp] = i; wt[warp] = t; }
        __syncthreads();
        if (threadIdx.x == 0) {
            float bs = ws[0]; unsigned bi = wi[0]; int bt = wt[0];
            for (int w = 1; w < THREADS / 32; w++) {
                if (better(ws[w], wi[w], bs, bi)) { bs = ws[w]; bi = wi[w]; bt = wt[w]; }
            }
            long o = (long)q * k + r;
            if (bi == NO_INDEX) {
                out_s[o] = neg_inf();
                out_i[o] = NO_INDEX;
                winner = -1;
            } else {
                out_s[o] = bs;
                out_i[o] = bi + row_offset;
                winner = bt;
            }
        }
        __syncthreads();
        if (threadIdx.x == winner) head++;
        __syncthreads();
    }
}

extern "C" __global__ void topk_f32(const float* scores, int ld, int n_valid, unsigned row_offset,
                                    int k, float min_score, float* out_s, unsigned* out_i) {
    topk_rows<float>(scores, ld, n_valid, row_offset, k, min_score, out_s, out_i);
}

extern "C" __global__ void topk_f16(const unsigned short* scores, int ld, int n_valid,
                                    unsigned row_offset, int k, float min_score, float* out_s,
                                    unsigned* out_i) {
    topk_rows<unsigned short>(scores, ld, n_valid, row_offset, k, min_score, out_s, out_i);
}

// f32 -> f16 conversion for the half-precision corpus and queries.
extern "C" __global__ void to_f16(const float* src, unsigned short* dst, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(src[i]));
        dst[i] = h;
    }
}
