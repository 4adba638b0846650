#include "bench/enforcer/busy_kernel.h"

namespace {
__global__ void busy(float* out, int iterations) {
  float a = threadIdx.x * 1e-3f, b = 1.0001f;
  for (int i = 0; i < iterations; ++i) a = a * b + 1e-7f;
  if (a == 12345.0f) out[0] = a;  // keep the loop
}
}  // namespace

void launch_busy_kernel(cudaStream_t stream, int iterations) {
  busy<<<132 * 4, 256, 0, stream>>>(nullptr, iterations / 1000);
}
