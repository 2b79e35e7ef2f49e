// Copy from host: a tensor's bytes, staged in pinned host memory, read over the host link
// straight into a new device array, where MLX's own loader copies from pageable memory.
// Compiled by NVRTC after prelude.cuh (kernels/cubins.py) and run by models/weights.py
// through mx.fast.precompiled_cuda_kernel, which passes the inputs, then the outputs.
//
// Input:  src  uint64 [2]  device address of the bytes in pinned memory (16-byte aligned),
//                          then how many bytes (any number: the tail is copied byte by byte)
// Output: out  any dtype   the tensor, as many bytes as src[1]
extern "C" __global__ void omlx_copy_from_host(const u64* src, u8* out) {
  const u8* base = reinterpret_cast<const u8*>(src[0]);
  const i64 n = static_cast<i64>(src[1]);
  const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  for (i64 i = first; i < n / 16; i += (i64)gridDim.x * blockDim.x) {
    reinterpret_cast<Vec16*>(out)[i] = reinterpret_cast<const Vec16*>(base)[i];
  }
  if (first == 0) {  // the last n % 16 bytes
    for (i64 i = n / 16 * 16; i < n; ++i) {
      out[i] = base[i];
    }
  }
}
