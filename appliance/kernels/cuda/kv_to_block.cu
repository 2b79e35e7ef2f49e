// Dequantize from host: one region of a KV block's payload (its keys or its values, in
// kernels/kv_quant.py's layout) read straight from pinned host memory over the host link
// into a device array [L, H, tokens, D] of T. Loaded by appliance/kernels/kv_move.py
// through mx.fast.cuda_kernel, which generates the signature.
//
// Inputs:  addr  uint64 [1]  device address of the region (16-byte aligned)
//          rows  int64  [1]  L * H * tokens
// Output:  out   T [L, H, tokens, D]
// Template: T, D, BITS (16: as computed; 8, 4: group-wise affine), GROUP (values per
//           scale and bias; 1 at 16 bits).
// At 16 bits the region is the array itself; at 8 or 4 it is the packed uint32
// [rows, D*BITS/32], then scales and biases, each [rows, D/GROUP] of T.
// Each thread writes 16 bytes of the output per iteration.
constexpr int VEC = 16 / sizeof(T);
constexpr int CHUNKS = D / VEC;
const int64_t num_rows = rows[0];
const int64_t total = num_rows * CHUNKS;
const uint8_t* base = reinterpret_cast<const uint8_t*>(addr[0]);
uint4* dst = reinterpret_cast<uint4*>(out);
for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
     i += (int64_t)gridDim.x * blockDim.x) {
  if constexpr (BITS == 16) {
    dst[i] = reinterpret_cast<const uint4*>(base)[i];
  } else {
    constexpr int WORDS = D * BITS / 32;
    constexpr int PER_WORD = 32 / BITS;
    constexpr int GROUPS = D / GROUP;
    const int64_t row = i / CHUNKS;
    const int first = (i - row * CHUNKS) * VEC;
    const uint32_t* packed = reinterpret_cast<const uint32_t*>(base) + row * WORDS;
    const T* scales = reinterpret_cast<const T*>(base + num_rows * WORDS * 4);
    const T* biases = scales + num_rows * GROUPS;
    const float s = static_cast<float>(scales[row * GROUPS + first / GROUP]);
    const float b = static_cast<float>(biases[row * GROUPS + first / GROUP]);
    T vals[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int idx = first + k;
      const uint32_t q = (packed[idx / PER_WORD] >> ((idx % PER_WORD) * BITS)) & ((1u << BITS) - 1u);
      vals[k] = static_cast<T>(s * static_cast<float>(q) + b);
    }
    dst[i] = *reinterpret_cast<const uint4*>(vals);
  }
}
