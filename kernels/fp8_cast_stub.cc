// Builds without nvcc (sanitizer builds): the launchers report cudaErrorNotSupported.
#include "kernels/fp8_cast.h"

namespace bgl::kern {

constexpr int kNotSupported = 801;  // cudaErrorNotSupported

bool cuda_kernels_available() { return false; }

int cast_to_fp8(const void*, DType, std::size_t, std::uint8_t*, float*, std::size_t, void*) {
  return kNotSupported;
}
int cast_from_fp8(const std::uint8_t*, const float*, std::size_t, std::size_t, DType, void*,
                  void*) {
  return kNotSupported;
}

}  // namespace bgl::kern
