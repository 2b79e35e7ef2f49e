// What both kernels share, put before each source by appliance/kernels/kv_move.py (NVRTC
// compiles them without any header: no include path, nothing from the CUDA toolkit).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct alignas(16) Vec16 {  // 16 bytes moved by one load and one store
  u32 x, y, z, w;
};

// The three dtypes a KV block is kept in; bf16 and f16 as their bits.
struct bf16 {
  u16 bits;
};
struct f16 {
  u16 bits;
};

union FloatBits {
  float f;
  u32 u;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) {
  FloatBits c;
  c.u = static_cast<u32>(x.bits) << 16;
  return c.f;
}
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) { return f; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float f) {  // round to nearest even, as MLX does
  FloatBits c;
  c.f = f;
  if ((c.u & 0x7fffffffu) > 0x7f800000u) {
    return bf16{0x7fc0};  // NaN
  }
  c.u += 0x7fffu + ((c.u >> 16) & 1u);
  return bf16{static_cast<u16>(c.u >> 16)};
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return f16{h};
}
