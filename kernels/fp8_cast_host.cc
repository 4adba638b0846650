#include "kernels/fp8_cast.h"

namespace bgl::kern {

void cast_to_fp8_host(const void* src, DType t, std::size_t n, std::uint8_t* dst, float* scales,
                      std::size_t block) {
  if (block == 0) return;
  for (std::size_t b0 = 0, k = 0; b0 < n; b0 += block, ++k) {
    const std::size_t end = b0 + block < n ? b0 + block : n;
    float amax = 0.0f;
    for (std::size_t i = b0; i < end; ++i) amax = amax_step(amax, load_elem(src, t, i));
    const BlockScale s = block_scale(amax);
    scales[k] = s.scale;
    for (std::size_t i = b0; i < end; ++i) dst[i] = float_to_e4m3(load_elem(src, t, i) * s.inv);
  }
}

void cast_from_fp8_host(const std::uint8_t* src, const float* scales, std::size_t n,
                        std::size_t block, DType t, void* dst) {
  if (block == 0) return;
  for (std::size_t i = 0; i < n; ++i)
    store_elem(dst, t, i, e4m3_to_float(src[i]) * scales[i / block]);
}

}  // namespace bgl::kern
