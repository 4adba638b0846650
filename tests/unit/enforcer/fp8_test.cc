// FP8 host twin: bit equality with cuda_fp8.h / cuda_bf16.h / cuda_fp16.h host conversions and
// the per-block round-trip error bound.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/fp8_cast.h"

namespace bgl::kern {
namespace {

std::uint8_t cuda_e4m3(float f) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
}

float cuda_e4m3_to_float(std::uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return static_cast<float>(v);
}

std::uint32_t bits(float f) { return float_bits(f); }

TEST(Fp8Convert, EveryE4m3CodeDecodesLikeCuda) {
  for (int b = 0; b < 256; ++b) {
    const float mine = e4m3_to_float(static_cast<std::uint8_t>(b));
    const float ref = cuda_e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(mine)) << b;
    } else {
      EXPECT_EQ(bits(mine), bits(ref)) << "code " << b;
    }
  }
}

TEST(Fp8Convert, EveryE4m3ValueAndNeighbourEncodesLikeCuda) {
  // Each representable value, the midpoints between neighbours, and one float ulp either side.
  for (int b = 0; b < 256; ++b) {
    const float v = e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(v)) continue;
    const float next = e4m3_to_float(static_cast<std::uint8_t>(b + 1 < 256 ? b + 1 : b));
    const float mid = std::isnan(next) ? v * 1.03125f : (v + next) / 2;
    for (float x :
         {v, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f),
          std::nextafter(mid, -1e30f), std::nextafter(v, 1e30f), std::nextafter(v, -1e30f)}) {
      EXPECT_EQ(float_to_e4m3(x), cuda_e4m3(x)) << "x=" << x << " bits=" << std::hex << bits(x);
    }
  }
}

TEST(Fp8Convert, EveryBf16AndFp16InputEncodesLikeCuda) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float fb = bf16_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(float_to_e4m3(fb), cuda_e4m3(fb)) << "bf16 " << std::hex << h;
    const float fh = half_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(float_to_e4m3(fh), cuda_e4m3(fh)) << "fp16 " << std::hex << h;
  }
}

TEST(Fp8Convert, Fp32SweepEncodesLikeCuda) {
  // Every 251st float pattern (17 million inputs covering every exponent and sign); set
  // BGL_FP8_EXHAUSTIVE=1 to check all 2^32.
  const bool all = std::getenv("BGL_FP8_EXHAUSTIVE") != nullptr;
  const std::uint64_t step = all ? 1 : 251;
  std::uint64_t mismatches = 0;
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += step) {
    const float f = bits_float(static_cast<std::uint32_t>(u));
    if (float_to_e4m3(f) != cuda_e4m3(f) && ++mismatches < 5) {
      ADD_FAILURE() << "bits " << std::hex << u << " mine " << int(float_to_e4m3(f)) << " cuda "
                    << int(cuda_e4m3(f));
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST(Fp8Convert, Bf16AndFp16DecodeAndEncodeLikeCuda) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    __nv_bfloat16_raw rb;
    rb.x = static_cast<unsigned short>(h);
    const float fb = __bfloat162float(__nv_bfloat16(rb));
    const float mine_b = bf16_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(fb)) {
      ASSERT_TRUE(std::isnan(mine_b));
    } else {
      ASSERT_EQ(bits(mine_b), bits(fb)) << std::hex << h;
    }
    __half_raw rh;
    rh.x = static_cast<unsigned short>(h);
    const float fh = __half2float(__half(rh));
    const float mine_h = half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(fh)) {
      ASSERT_TRUE(std::isnan(mine_h));
    } else {
      ASSERT_EQ(bits(mine_h), bits(fh)) << std::hex << h;
    }
  }
  // FP32 -> BF16/FP16 rounding on a sweep of float patterns (non-NaN).
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 4099) {
    const float f = bits_float(static_cast<std::uint32_t>(u));
    if (std::isnan(f)) continue;
    const __nv_bfloat16_raw rb = __float2bfloat16_rn(f);
    ASSERT_EQ(float_to_bf16(f), rb.x) << std::hex << u;
    const __half_raw rh = __float2half_rn(f);
    ASSERT_EQ(float_to_half(f), rh.x) << std::hex << u;
  }
}

template <typename Fill>
void round_trip(DType t, std::size_t n, std::size_t block, Fill fill) {
  std::vector<std::uint8_t> src(n * dtype_size(t));
  for (std::size_t i = 0; i < n; ++i) store_elem(src.data(), t, i, fill(i));
  std::vector<std::uint8_t> q(n);
  std::vector<float> scales(fp8_num_blocks(n, block));
  cast_to_fp8_host(src.data(), t, n, q.data(), scales.data(), block);
  std::vector<std::uint8_t> back(src.size());
  cast_from_fp8_host(q.data(), scales.data(), n, block, t, back.data());
  for (std::size_t b0 = 0; b0 < n; b0 += block) {
    const std::size_t end = std::min(n, b0 + block);
    float amax = 0;
    for (std::size_t i = b0; i < end; ++i)
      amax = std::max(amax, std::fabs(load_elem(src.data(), t, i)));
    // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 of the
    // scale below 2^-6 (subnormals); plus one rounding of the output type.
    const float out_eps = t == DType::kF32 ? 0.0f : (t == DType::kBF16 ? 1.0f / 256 : 1.0f / 2048);
    for (std::size_t i = b0; i < end; ++i) {
      const float x = load_elem(src.data(), t, i);
      const float y = load_elem(back.data(), t, i);
      const float bound =
          std::max(std::fabs(x) * 0.0625f, amax / 448.0f * 0.0009765625f) * 1.0001f +
          std::fabs(x) * 1.0625f * out_eps + 1e-30f;
      ASSERT_LE(std::fabs(x - y), bound)
          << "i=" << i << " x=" << x << " y=" << y << " amax=" << amax;
    }
  }
}

TEST(Fp8Cast, RoundTripWithinE4m3BoundPerBlock) {
  std::mt19937 rng(7);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (std::size_t block : {std::size_t{128}, std::size_t{32}, std::size_t{100}}) {
      for (std::size_t n : {std::size_t{1}, std::size_t{127}, std::size_t{128}, std::size_t{1000},
                            std::size_t{4099}}) {
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> scale_of_block(n / block + 1);
        for (auto& s : scale_of_block) s = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
        round_trip(t, n, block,
                   [&](std::size_t i) { return normal(rng) * scale_of_block[i / block]; });
        round_trip(t, n, block, [](std::size_t) { return 0.0f; });
        round_trip(t, n, block, [](std::size_t i) { return i % 2 ? 3.5f : -3.5f; });
      }
    }
  }
}

TEST(Fp8Cast, ScalesAreAmaxOver448AndZeroBlocksUseOne) {
  std::vector<float> src(256, 0.0f);
  for (int i = 0; i < 128; ++i) src[i] = static_cast<float>(i) - 100.0f;  // amax 100
  std::vector<std::uint8_t> q(256);
  float scales[2];
  cast_to_fp8_host(src.data(), DType::kF32, 256, q.data(), scales, 128);
  EXPECT_EQ(scales[0], 100.0f / 448.0f);
  EXPECT_EQ(scales[1], 1.0f);
  EXPECT_EQ(q[0], 0xfe);  // -100 -> -448 saturated code
}

}  // namespace
}  // namespace bgl::kern
