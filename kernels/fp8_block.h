// Per-block FP8 e4m3 quantisation of one scale block, as host-and-device functions: the CUDA
// kernels and the host twin both call these, so their results are bit-identical.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/fp8_convert.h"

namespace bgl::kern {

// Element type of the full-precision side of a cast.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

BGL_HD std::size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

// Element i of `src` (raw bits of `t`) as FP32.
BGL_HD float load_elem(const void* src, DType t, std::size_t i) {
  if (t == DType::kF32) return static_cast<const float*>(src)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return t == DType::kBF16 ? bf16_to_float(h) : half_to_float(h);
}

// Stores `v` as element i of `dst` (raw bits of `t`, rounded to nearest even).
BGL_HD void store_elem(void* dst, DType t, std::size_t i, float v) {
  if (t == DType::kF32) {
    static_cast<float*>(dst)[i] = v;
  } else {
    static_cast<std::uint16_t*>(dst)[i] = t == DType::kBF16 ? float_to_bf16(v) : float_to_half(v);
  }
}

// Absolute value that ignores the sign bit only (NaN stays NaN).
BGL_HD float abs_bits(float v) { return bits_float(float_bits(v) & 0x7fffffffu); }

// The larger of a running amax and |v|; NaN inputs are ignored.
BGL_HD float amax_step(float amax, float v) {
  const float a = abs_bits(v);
  return a > amax ? a : amax;
}

// Scale of a block with the given amax: stored value = e4m3(x * inv), x' = e4m3 * scale. Blocks
// whose amax is zero, infinite or too small for 448/amax to be finite use scale 1.
struct BlockScale {
  float scale;
  float inv;
};

BGL_HD BlockScale block_scale(float amax) {
  if (!(amax > 0.0f) || amax > 3.0e38f) return {1.0f, 1.0f};
  const float inv = kE4m3Max / amax;
  if (inv > 3.0e38f) return {1.0f, 1.0f};
  return {amax / kE4m3Max, inv};
}

}  // namespace bgl::kern
