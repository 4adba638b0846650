// CUDA kernels of fp8_cast.h. One group of G lanes (a power of two <= 32) per scale block:
// 16-byte vector loads, amax reduced with sub-warp shuffles, then a second pass (L1/L2 hits)
// that scales, converts and stores. The per-element arithmetic is fp8_block.h's, except that
// Ada and Hopper convert to e4m3 in hardware and the uncast reads a 256-entry table: both give
// the host twin's bits (checked bit for bit in the GPU suite) at a fraction of the instructions.
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/fp8_cast.h"

namespace bgl::kern {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 8192;
constexpr int kHeld = 4;  // 16-byte vectors a lane keeps in registers across the two passes

template <DType T>
constexpr int kElemSize = T == DType::kF32 ? 4 : 2;

__device__ __forceinline__ float amax_combine(float a, float b) { return a > b ? a : b; }

// Two values to e4m3 (low byte first). cvt.rn.satfinite.e4m3x2 rounds and saturates as
// float_to_e4m3 does; a NaN gets the twin's 0x7f whatever its sign.
__device__ __forceinline__ void to_e4m3x2(float a, float b, std::uint8_t* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __nv_fp8x2_storage_t p =
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  out[0] = a != a ? std::uint8_t{0x7f} : static_cast<std::uint8_t>(p & 0xffu);
  out[1] = b != b ? std::uint8_t{0x7f} : static_cast<std::uint8_t>(p >> 8);
#else
  out[0] = float_to_e4m3(a);
  out[1] = float_to_e4m3(b);
#endif
}

// Bytes of `per` FP8 values, stored with one access.
template <int Per>
struct Packed;
template <>
struct Packed<4> {
  using type = std::uint32_t;
};
template <>
struct Packed<8> {
  using type = uint2;
};

template <DType T>
__global__ void cast_to_fp8_kernel(const void* __restrict__ src, std::size_t n,
                                   std::uint8_t* __restrict__ dst, float* __restrict__ scales,
                                   std::size_t block, std::size_t nblocks, int g, bool vec) {
  constexpr int kPer = 16 / kElemSize<T>;  // elements per 16-byte vector
  const unsigned tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = static_cast<int>(threadIdx.x) % g;
  const unsigned warp_lane = threadIdx.x % 32u;
  const unsigned mask = (g == 32 ? 0xffffffffu : ((1u << g) - 1u))
                        << (warp_lane / static_cast<unsigned>(g) * g);
  const std::size_t groups = static_cast<std::size_t>(gridDim.x) * blockDim.x / g;
  for (std::size_t k = tid / g; k < nblocks; k += groups) {
    const std::size_t b0 = k * block;
    const std::size_t end = b0 + block < n ? b0 + block : n;
    const bool full = vec && end - b0 == block;
    float amax = 0.0f;
    const std::size_t nv = block / kPer;
    if (full && nv <= static_cast<std::size_t>(g) * kHeld) {
      // The common case (128-element blocks): each lane's vectors stay in registers between
      // the amax and the conversion, so the block is read from memory once.
      const uint4* v =
          reinterpret_cast<const uint4*>(static_cast<const char*>(src) + b0 * kElemSize<T>);
      uint4 held[kHeld];
#pragma unroll
      for (int r = 0; r < kHeld; ++r) {
        const std::size_t j = lane + static_cast<std::size_t>(r) * g;
        if (j < nv) {
          held[r] = v[j];
#pragma unroll
          for (int e = 0; e < kPer; ++e) amax = amax_step(amax, load_elem(&held[r], T, e));
        }
      }
      for (int off = g / 2; off > 0; off /= 2) {
        amax = amax_combine(amax, __shfl_xor_sync(mask, amax, off, g));
      }
      const BlockScale s = block_scale(amax);
      if (lane == 0) scales[k] = s.scale;
      using P = typename Packed<kPer>::type;
      P* out = reinterpret_cast<P*>(dst + b0);
#pragma unroll
      for (int r = 0; r < kHeld; ++r) {
        const std::size_t j = lane + static_cast<std::size_t>(r) * g;
        if (j < nv) {
          std::uint8_t bytes[kPer];
#pragma unroll
          for (int e = 0; e < kPer; e += 2) {
            to_e4m3x2(load_elem(&held[r], T, e) * s.inv, load_elem(&held[r], T, e + 1) * s.inv,
                      bytes + e);
          }
          P p;
          memcpy(&p, bytes, sizeof p);
          out[j] = p;
        }
      }
      continue;
    }
    if (full) {
      const uint4* v =
          reinterpret_cast<const uint4*>(static_cast<const char*>(src) + b0 * kElemSize<T>);
      for (std::size_t j = lane; j < nv; j += g) {
        const uint4 x = v[j];
#pragma unroll
        for (int e = 0; e < kPer; ++e) amax = amax_step(amax, load_elem(&x, T, e));
      }
    } else {
      for (std::size_t i = b0 + lane; i < end; i += g) amax = amax_step(amax, load_elem(src, T, i));
    }
    for (int off = g / 2; off > 0; off /= 2) {
      amax = amax_combine(amax, __shfl_xor_sync(mask, amax, off, g));
    }
    const BlockScale s = block_scale(amax);
    if (lane == 0) scales[k] = s.scale;
    if (full) {
      const uint4* v =
          reinterpret_cast<const uint4*>(static_cast<const char*>(src) + b0 * kElemSize<T>);
      using P = typename Packed<kPer>::type;
      P* out = reinterpret_cast<P*>(dst + b0);
      for (std::size_t j = lane; j < nv; j += g) {
        const uint4 x = v[j];
        std::uint8_t bytes[kPer];
#pragma unroll
        for (int e = 0; e < kPer; e += 2) {
          to_e4m3x2(load_elem(&x, T, e) * s.inv, load_elem(&x, T, e + 1) * s.inv, bytes + e);
        }
        P p;
        memcpy(&p, bytes, sizeof p);
        out[j] = p;
      }
    } else {
      for (std::size_t i = b0 + lane; i < end; i += g) {
        dst[i] = float_to_e4m3(load_elem(src, T, i) * s.inv);
      }
    }
  }
}

template <DType T>
__global__ void cast_from_fp8_kernel(const std::uint8_t* __restrict__ src,
                                     const float* __restrict__ scales, std::size_t n,
                                     std::size_t block, void* __restrict__ dst, bool vec) {
  constexpr int kPer = 16 / kElemSize<T>;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  __shared__ float table[256];  // e4m3 -> FP32, exact
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) {
    table[i] = e4m3_to_float(static_cast<std::uint8_t>(i));
  }
  __syncthreads();
  if (vec) {
    using P = typename Packed<kPer>::type;
    const std::size_t nv = n / kPer;
    for (std::size_t j = tid; j < nv; j += stride) {
      const P p = reinterpret_cast<const P*>(src)[j];
      std::uint8_t bytes[kPer];
      memcpy(bytes, &p, sizeof p);
      const float scale = scales[j * kPer / block];  // a vector never spans two blocks
      uint4 out;
#pragma unroll
      for (int e = 0; e < kPer; ++e) store_elem(&out, T, e, table[bytes[e]] * scale);
      reinterpret_cast<uint4*>(dst)[j] = out;
    }
    for (std::size_t i = nv * kPer + tid; i < n; i += stride) {
      store_elem(dst, T, i, table[src[i]] * scales[i / block]);
    }
  } else {
    for (std::size_t i = tid; i < n; i += stride) {
      store_elem(dst, T, i, table[src[i]] * scales[i / block]);
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

unsigned grid_for(std::size_t threads_needed) {
  const std::size_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min<std::size_t>(blocks, kMaxGrid)));
}

template <DType T>
int launch_cast(const void* src, std::size_t n, std::uint8_t* dst, float* scales, std::size_t block,
                cudaStream_t stream) {
  constexpr int kPer = 16 / kElemSize<T>;
  const bool vec = block % kPer == 0 && aligned16(src) && aligned16(dst);
  // Lanes per scale block: few enough that each lane keeps kHeld vectors in flight (memory-level
  // parallelism), enough that a block never needs more than kHeld per lane.
  const std::size_t lanes_wanted = vec ? (block / kPer + kHeld - 1) / kHeld : block;
  int g = 1;
  while (g < 32 && static_cast<std::size_t>(g) < lanes_wanted) g *= 2;
  const std::size_t nblocks = fp8_num_blocks(n, block);
  cast_to_fp8_kernel<T>
      <<<grid_for(nblocks * g), kThreads, 0, stream>>>(src, n, dst, scales, block, nblocks, g, vec);
  return static_cast<int>(cudaGetLastError());
}

template <DType T>
int launch_uncast(const std::uint8_t* src, const float* scales, std::size_t n, std::size_t block,
                  void* dst, cudaStream_t stream) {
  constexpr int kPer = 16 / kElemSize<T>;
  const bool vec = block % kPer == 0 && aligned16(src) && aligned16(dst);
  cast_from_fp8_kernel<T>
      <<<grid_for(vec ? n / kPer + 1 : n), kThreads, 0, stream>>>(src, scales, n, block, dst, vec);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool cuda_kernels_available() { return true; }

int cast_to_fp8(const void* src, DType t, std::size_t n, std::uint8_t* dst, float* scales,
                std::size_t block, void* stream) {
  if (n == 0) return 0;
  if (block == 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DType::kF32:
      return launch_cast<DType::kF32>(src, n, dst, scales, block, s);
    case DType::kF16:
      return launch_cast<DType::kF16>(src, n, dst, scales, block, s);
    case DType::kBF16:
      return launch_cast<DType::kBF16>(src, n, dst, scales, block, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n, std::size_t block,
                  DType t, void* dst, void* stream) {
  if (n == 0) return 0;
  if (block == 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (t) {
    case DType::kF32:
      return launch_uncast<DType::kF32>(src, scales, n, block, dst, s);
    case DType::kF16:
      return launch_uncast<DType::kF16>(src, scales, n, block, dst, s);
    case DType::kBF16:
      return launch_uncast<DType::kBF16>(src, scales, n, block, dst, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace bgl::kern
