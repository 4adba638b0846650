// Scalar conversions between FP32/FP16/BF16 bit patterns and FP8 e4m3, written once as
// host-and-device functions so the CUDA kernels and their host twins run the same arithmetic.
// Integer arithmetic only (no rounding-mode or fast-math dependence).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define BGL_HD __host__ __device__ __forceinline__
#else
#define BGL_HD inline
#endif

namespace bgl::kern {

// Largest finite e4m3 magnitude.
constexpr float kE4m3Max = 448.0f;

BGL_HD std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

BGL_HD float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Rounds `sig >> shift` to nearest, ties to even (shift in 1..31).
BGL_HD std::uint32_t shift_rne(std::uint32_t sig, int shift) {
  const std::uint32_t q = sig >> shift;
  const std::uint32_t rem = sig & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
}

// FP32 -> e4m3, round to nearest even, saturating to +-448 (cuda_fp8.h's __NV_SATFINITE);
// NaN -> 0x7f.
BGL_HD std::uint8_t float_to_e4m3(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 24) & 0x80u;
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0x7f;               // NaN
  if (mag >= 0x43e00000u) return sign | 0x7eu;      // >= 448 (and inf): saturate
  const int e = static_cast<int>(mag >> 23) - 127;  // unbiased exponent
  if (e < -10) return sign;                         // < 2^-10: rounds to zero
  const std::uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
  std::uint32_t code;
  if (e < -6) {
    // Subnormal: units of 2^-9; q = sig * 2^(e - 23 + 9). q == 8 encodes 2^-6 (0x08).
    code = shift_rne(sig, 14 - e);
  } else {
    const std::uint32_t q = shift_rne(sig, 20);  // 8..16 with the implicit bit
    code = (static_cast<std::uint32_t>(e + 7) << 3) + q - 8u;
  }
  if (code > 0x7eu) code = 0x7eu;
  return static_cast<std::uint8_t>(sign | code);
}

// e4m3 -> FP32 (exact).
BGL_HD float e4m3_to_float(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t exp = (b >> 3) & 0xfu;
  const std::uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {
    // man * 2^-9, exactly representable.
    const float v = static_cast<float>(man) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// BF16 bits -> FP32 (exact).
BGL_HD float bf16_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

// FP32 -> BF16 bits, round to nearest even; NaN stays NaN (quiet).
BGL_HD std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

// FP16 bits -> FP32 (exact).
BGL_HD float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// FP32 -> FP16 bits, round to nearest even, overflow to infinity; NaN stays NaN (quiet).
BGL_HD std::uint16_t float_to_half(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
  if (mag >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  const int e = static_cast<int>(mag >> 23) - 127;
  if (e < -25) return static_cast<std::uint16_t>(sign);  // < 2^-25: rounds to zero
  const std::uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
  std::uint32_t code;
  if (e < -14) {
    code = shift_rne(sig, -1 - e);  // units of 2^-24: shift = 23 - (e + 24)
  } else {
    const std::uint32_t q = shift_rne(sig, 13);  // 1024..2048 with the implicit bit
    code = (static_cast<std::uint32_t>(e + 15) << 10) + q - 1024u;
  }
  return static_cast<std::uint16_t>(sign | code);
}

}  // namespace bgl::kern
