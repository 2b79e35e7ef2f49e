// Dequantize from host: one region of a KV block's payload (its keys or its values, in
// kernels/kv_quant.py's layout) read straight from pinned host memory over the host link
// into a device array [L, H, tokens, D] of T. Compiled by NVRTC after prelude.cuh
// (kernels/cubins.py), one instance per (T, D, BITS, GROUP): kernels/kv_move.py appends
// the extern "C" kernel that instantiates the template, and runs it through
// mx.fast.precompiled_cuda_kernel (inputs, outputs, then scalars).
//
// Inputs:  addr  uint64 [1]  device address of the region (16-byte aligned)
// Output:  out   T [L, H, tokens, D]
// Scalar:  rows  int         L * H * tokens
// Template: T, D, BITS (16: as computed; 8, 4: group-wise affine), GROUP (values per
//           scale and bias; 1 at 16 bits).
// At 16 bits the region is the array itself; at 8 or 4 it is the packed uint32
// [rows, D*BITS/32], then scales and biases, each [rows, D/GROUP] of T.
// Each thread writes 16 bytes of the output per iteration.
template <typename T, int D, int BITS, int GROUP>
__device__ __forceinline__ void kv_to_block(const u64* addr, T* out, int rows) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNKS = D / VEC;
  const i64 num_rows = rows;
  const i64 total = num_rows * CHUNKS;
  const u8* base = reinterpret_cast<const u8*>(addr[0]);
  Vec16* dst = reinterpret_cast<Vec16*>(out);
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    if constexpr (BITS == 16) {
      dst[i] = reinterpret_cast<const Vec16*>(base)[i];
    } else {
      constexpr int WORDS = D * BITS / 32;
      constexpr int PER_WORD = 32 / BITS;
      constexpr int GROUPS = D / GROUP;
      const i64 row = i / CHUNKS;
      const int first = (i - row * CHUNKS) * VEC;
      const u32* packed = reinterpret_cast<const u32*>(base) + row * WORDS;
      const T* scales = reinterpret_cast<const T*>(base + num_rows * WORDS * 4);
      const T* biases = scales + num_rows * GROUPS;
      const float s = to_float(scales[row * GROUPS + first / GROUP]);
      const float b = to_float(biases[row * GROUPS + first / GROUP]);
      union {
        T vals[VEC];
        Vec16 vec;
      } chunk;
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const int idx = first + k;
        const u32 q = (packed[idx / PER_WORD] >> ((idx % PER_WORD) * BITS)) & ((1u << BITS) - 1u);
        chunk.vals[k] = from_float<T>(s * static_cast<float>(q) + b);
      }
      dst[i] = chunk.vec;
    }
  }
}
