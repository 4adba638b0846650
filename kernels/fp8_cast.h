// FP8 e4m3 storage of activations: cast BF16/FP16/FP32 to e4m3 with one FP32 scale per block of
// `block` elements (amax scaling), and cast back. CUDA launchers run on a given stream; the host
// twins run the same per-element arithmetic (fp8_block.h) on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/fp8_block.h"

namespace bgl::kern {

constexpr std::size_t kDefaultFp8Block = 128;

// Number of scales for n elements in blocks of `block`.
inline std::size_t fp8_num_blocks(std::size_t n, std::size_t block) {
  return block == 0 ? 0 : (n + block - 1) / block;
}

// Host twin of cast_to_fp8: dst gets n e4m3 bytes, scales gets fp8_num_blocks(n, block) floats.
void cast_to_fp8_host(const void* src, DType t, std::size_t n, std::uint8_t* dst, float* scales,
                      std::size_t block);
// Host twin of cast_from_fp8: dst gets n elements of type t.
void cast_from_fp8_host(const std::uint8_t* src, const float* scales, std::size_t n,
                        std::size_t block, DType t, void* dst);

// True when this build has the CUDA kernels (nvcc found, not a sanitizer build).
bool cuda_kernels_available();

// CUDA launchers (device pointers; `stream` is a cudaStream_t). Return 0 or a cudaError_t value;
// in builds without the kernels they return cudaErrorNotSupported (801). 16-byte vector loads
// are used when `src`/`dst` are 16-byte aligned and a block is a whole number of vectors.
int cast_to_fp8(const void* src, DType t, std::size_t n, std::uint8_t* dst, float* scales,
                std::size_t block, void* stream);
int cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n, std::size_t block,
                  DType t, void* dst, void* stream);

}  // namespace bgl::kern
