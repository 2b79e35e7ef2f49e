// Gather to host: copies a block's payload (made on the device by kernels/kv_quant.py's
// `pack`: at 8 or 4 bits it is quantized there) into pinned host memory at `addr`, over
// the host link, without MLX's own device-to-host path. Compiled by NVRTC after
// prelude.cuh (kernels/cubins.py) and run by kernels/kv_move.py through
// mx.fast.precompiled_cuda_kernel, which passes the inputs, the outputs, then the scalars.
//
// Inputs:  payload  uint8  [n]  the block's bytes
//          addr     uint64 [1]  device address of the destination, 16-byte aligned
// Output:  done     uint8  [1]  evaluated to wait for the copy
// Scalar:  n        int         bytes in the payload
extern "C" __global__ void omlx_kv_to_host(const u8* payload, const u64* addr, u8* done, int n) {
  const Vec16* src = reinterpret_cast<const Vec16*>(payload);
  u8* dst = reinterpret_cast<u8*>(addr[0]);
  const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x;
  for (i64 i = first; i < n / 16; i += (i64)gridDim.x * blockDim.x) {
    reinterpret_cast<Vec16*>(dst)[i] = src[i];
  }
  if (first == 0) {
    for (i64 i = n / 16 * 16; i < n; ++i) {
      dst[i] = payload[i];
    }
    done[0] = 1;
  }
}
