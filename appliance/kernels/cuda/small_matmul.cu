// A matmul of a few rows, y = x @ w.T, as a decode pass makes them (one row per sequence),
// on tensor cores. Compiled by NVRTC after prelude.cuh (kernels/cubins.py), one instance
// per (T, TILES, WARPS): kernels/small_matmul.py appends the extern "C" kernel that
// instantiates the template and runs it through mx.fast.precompiled_cuda_kernel (inputs,
// outputs, then scalars). It exists for the host's sake: MLX runs such a matmul through
// cuBLASLt, which costs the host 11-15 µs a call on an H100 (19-29 on a slower host:
// descriptors and a heuristic made anew each time, and a stream capture), about the GPU's
// own time for most of a decode pass's matmuls.
//
// Inputs:  x  T [M, K]  row-major
//          w  T [N, K]  row-major (a Linear's weight)
// Output:  y  T [M, N]
// Scalars: M, N, K  with M <= 8 * TILES, N % 16 == 0, K % 32 == 0, x and w 16-byte aligned
// Template: T (bf16 | f16), TILES (8-row tiles of x), WARPS (warps that split K).
//
// Each block computes 16 columns of y (16 rows of w) for every row of x: its warps take
// 32-value chunks of K in turn, each with one mma.m16n8k16 per 16 values and 8-row tile,
// and add their partial sums through shared memory. The k order inside a chunk is a
// permutation the A (w) and B (x) fragments share: each thread loads 16 contiguous bytes
// of a row of w (two rows: g and g + 8) and of a row of x, so every load is a full vector.

// c += a (16 x 16, row-major) x b (16 x 8, column-major), a and b of T, c of float
#define OMLX_MMA16816(PTX_TYPE)                                                                        \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "   \
               "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                             \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

template <typename T>
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1);
template <>
__device__ __forceinline__ void mma16816<bf16>(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  OMLX_MMA16816("bf16");
}
template <>
__device__ __forceinline__ void mma16816<f16>(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  OMLX_MMA16816("f16");
}

__device__ __forceinline__ Vec16 load_streaming(const Vec16* p) {  // read once: keep it out of L1
  Vec16 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <typename T, int TILES, int WARPS>
__device__ __forceinline__ void small_matmul(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                             int M, int N, int K) {
  constexpr int UNROLL = TILES >= 4 ? 1 : 4 / TILES;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;    // the mma's group: a row of w (and g + 8), a row of x per tile
  const int tig = lane % 4;  // the thread in its group: which 16 bytes of a chunk
  const int n0 = blockIdx.x * 16;
  const int chunks = K / 32;
  const i64 row_vecs = K / 8;  // 16-byte vectors in a row
  const Vec16* w_lo = reinterpret_cast<const Vec16*>(w) + (n0 + g) * row_vecs + tig;
  const Vec16* w_hi = w_lo + 8 * row_vecs;
  const Vec16* xs = reinterpret_cast<const Vec16*>(x) + tig;
  float acc[TILES][4];
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
    acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  }
  const Vec16 zero = {0u, 0u, 0u, 0u};
  for (int c = warp; c < chunks; c += WARPS * UNROLL) {
    Vec16 lo[UNROLL], hi[UNROLL], xv[UNROLL][TILES];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int cc = c + u * WARPS;
      const bool in = cc < chunks;
      lo[u] = in ? load_streaming(w_lo + cc * 4) : zero;
      hi[u] = in ? load_streaming(w_hi + cc * 4) : zero;
#pragma unroll
      for (int t = 0; t < TILES; ++t) {
        const int m = t * 8 + g;
        xv[u][t] = in && m < M ? xs[m * row_vecs + cc * 4] : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int t = 0; t < TILES; ++t) {
        mma16816<T>(acc[t], lo[u].x, hi[u].x, lo[u].y, hi[u].y, xv[u][t].x, xv[u][t].y);
        mma16816<T>(acc[t], lo[u].z, hi[u].z, lo[u].w, hi[u].w, xv[u][t].z, xv[u][t].w);
      }
    }
  }
  // acc[t]: {0, 1} are (n0 + g, rows t*8 + 2*tig + {0, 1}) of y, {2, 3} the same at n0 + g + 8
  __shared__ float partial[WARPS][8 * TILES][16];
#pragma unroll
  for (int t = 0; t < TILES; ++t) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      partial[warp][t * 8 + 2 * tig + e][g] = acc[t][e];
      partial[warp][t * 8 + 2 * tig + e][g + 8] = acc[t][2 + e];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * 16; i += WARPS * 32) {
    const int m = i / 16;
    const int n = i % 16;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < WARPS; ++v) {
      sum += partial[v][m][n];
    }
    y[(i64)m * N + n0 + n] = from_float<T>(sum);
  }
}
