// Gather to host: copies a block's payload (made on the device by kernels/kv_quant.py's
// `pack`: at 8 or 4 bits it is quantized there) into pinned host memory at `addr`, over
// the host link, without MLX's own device-to-host path. Loaded by
// appliance/kernels/kv_move.py through mx.fast.cuda_kernel.
//
// Inputs:  payload  uint8  [n]  the block's bytes
//          addr     uint64 [1]  device address of the destination, 16-byte aligned
// Output:  done     uint8  [1]  evaluated to wait for the copy
const int64_t n = payload_shape[0];
const uint4* src = reinterpret_cast<const uint4*>(payload);
uint8_t* dst = reinterpret_cast<uint8_t*>(addr[0]);
const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
for (int64_t i = first; i < n / 16; i += (int64_t)gridDim.x * blockDim.x) {
  reinterpret_cast<uint4*>(dst)[i] = src[i];
}
if (first == 0) {
  for (int64_t i = n / 16 * 16; i < n; ++i) {
    dst[i] = payload[i];
  }
  done[0] = 1;
}
