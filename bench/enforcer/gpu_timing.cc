// GPU timing table for tests/gpu/run.sh: enforcer offload/reload bandwidth against
// cudaMemcpyAsync of pinned memory, FP8 cast/uncast against a device-to-device copy of the same
// bytes, and the overlap of offload with a compute kernel. Prints a table; exits 0 without a GPU.
// With --calibration-out FILE it also writes the planner's calibration (docs/planner.md): each
// roofline's launch floor from a 64 KiB piece and its peak from the 256 MiB one.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>

#include "allocator/allocator.h"
#include "bench/enforcer/busy_kernel.h"
#include "enforcer/enforcer.h"
#include "kernels/fp8_cast.h"

namespace bgl::enf {
namespace {

using alloc::Config;
using alloc::make_backend;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename F>
double time_it(int reps, cudaStream_t s, F&& f) {
  f();
  cudaStreamSynchronize(s);
  cudaDeviceSynchronize();
  const double t0 = now_s();
  for (int i = 0; i < reps; ++i) f();
  cudaDeviceSynchronize();
  return (now_s() - t0) / reps;
}

// Mean seconds of an enforcer offload and of the reload that follows, `bytes` each.
struct MoveTimes {
  double offload_s = 0, reload_s = 0;
};
MoveTimes time_moves(Pool& pool, Enforcer& enf, cudaStream_t compute, std::size_t bytes, int reps) {
  MoveTimes t;
  for (int i = 0; i <= reps; ++i) {
    void* p = pool.allocate(bytes, compute);
    cudaMemsetAsync(p, 2, bytes, compute);
    TensorDesc d{p, bytes, ElemType::kBytes, 0, 0, 0, compute, true};
    std::uint64_t h = 0;
    enf.register_tensor(d, &h);
    cudaDeviceSynchronize();
    const double t0 = now_s();
    enf.offload(h);
    enf.wait_tensor(h);
    const double t1 = now_s();
    enf.reload(h);
    enf.wait_tensor(h);
    const double t2 = now_s();
    if (i > 0) {  // the first round warms the pinned pool and the page maps
      t.offload_s += t1 - t0;
      t.reload_s += t2 - t1;
    }
    enf.release(h, -1, compute);
  }
  t.offload_s /= reps;
  t.reload_s /= reps;
  return t;
}

// A roofline from a small and a large piece: time = max(floor, bytes / peak).
std::string roofline_json(double small_s, double large_s, std::size_t large_bytes) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "{\"launch_floor_us\": %.2f, \"peak_GBps\": %.1f}", small_s * 1e6,
                static_cast<double>(large_bytes) / large_s / 1e9);
  return buf;
}

int run(const char* calibration_out) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || !kern::cuda_kernels_available()) {
    std::printf("no CUDA device: timing table skipped\n");
    return 0;
  }
  Config c;
  c.backend = "cuda-vmm";
  std::string error;
  auto pool = std::make_unique<Pool>(make_backend(c, 0, &error), c.pool);
  EnforcerOptions eo;
  eo.pinned_capacity = std::size_t{8} << 30;
  eo.pressure_eviction = false;
  auto enf = Enforcer::create(pool.get(), make_cuda_device_ops(0), eo, &error);
  if (!enf) {
    std::printf("enforcer: %s\n", error.c_str());
    return 1;
  }
  cudaStream_t compute;
  cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking);
  const std::size_t bytes = std::size_t{256} << 20;
  const int reps = 10;
  auto d2h = static_cast<cudaStream_t>(enf->d2h_stream());
  auto h2d = static_cast<cudaStream_t>(enf->h2d_stream());

  // Baselines: cudaMemcpyAsync between a device buffer and pinned memory.
  void *dev, *host, *dev2;
  cudaMalloc(&dev, bytes);
  cudaMalloc(&dev2, bytes);
  cudaHostAlloc(&host, bytes, cudaHostAllocPortable);
  cudaMemset(dev, 1, bytes);
  const double base_d2h =
      time_it(reps, d2h, [&] { cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, d2h); });
  const double base_h2d =
      time_it(reps, h2d, [&] { cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, h2d); });
  const double base_d2d = time_it(
      reps, compute, [&] { cudaMemcpyAsync(dev2, dev, bytes, cudaMemcpyDeviceToDevice, compute); });

  // Enforcer offload (D2H) and reload (H2D) of the same bytes.
  const MoveTimes large = time_moves(*pool, *enf, compute, bytes, reps);
  const double off_s = large.offload_s, rel_s = large.reload_s;

  // FP8 cast/uncast (BF16) against a D2D copy of the same (BF16) bytes.
  const std::size_t elems = bytes / 2;
  void *q, *sc;
  cudaMalloc(&q, elems);
  cudaMalloc(&sc, kern::fp8_num_blocks(elems, 128) * 4);
  const double cast_s = time_it(reps, compute, [&] {
    kern::cast_to_fp8(dev, kern::DType::kBF16, elems, static_cast<std::uint8_t*>(q),
                      static_cast<float*>(sc), 128, compute);
  });
  const double uncast_s = time_it(reps, compute, [&] {
    kern::cast_from_fp8(static_cast<std::uint8_t*>(q), static_cast<float*>(sc), elems, 128,
                        kern::DType::kBF16, dev2, compute);
  });

  // Overlap: a compute kernel alone, offload alone, both together.
  const double kernel_s = time_it(3, compute, [&] { launch_busy_kernel(compute, 20000000); });
  const double both_s = time_it(3, compute, [&] {
    launch_busy_kernel(compute, 20000000);
    cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, d2h);
  });
  const double overlap = (kernel_s + base_d2h - both_s) / std::min(kernel_s, base_d2h);

  auto gbs = [&](double s) { return static_cast<double>(bytes) / s / 1e9; };
  std::printf("| measurement | GB/s | baseline GB/s | ratio | target |\n|---|---|---|---|---|\n");
  std::printf(
      "| offload (D2H, 256 MiB) vs cudaMemcpyAsync D2H pinned | %.1f | %.1f | %.2f | >= 0.90 |\n",
      gbs(off_s), gbs(base_d2h), base_d2h / off_s);
  std::printf(
      "| reload (H2D, 256 MiB) vs cudaMemcpyAsync H2D pinned | %.1f | %.1f | %.2f | >= 0.90 |\n",
      gbs(rel_s), gbs(base_h2d), base_h2d / rel_s);
  std::printf(
      "| FP8 cast BF16->e4m3 (bytes read+written) vs D2D copy | %.1f | %.1f | %.2f | >= 0.70 |\n",
      (bytes * 1.5) / cast_s / 1e9, 2.0 * bytes / base_d2d / 1e9,
      (bytes * 1.5 / cast_s) / (2.0 * bytes / base_d2d));
  std::printf(
      "| FP8 uncast e4m3->BF16 (bytes read+written) vs D2D copy | %.1f | %.1f | %.2f | >= 0.70 |\n",
      (bytes * 1.5) / uncast_s / 1e9, 2.0 * bytes / base_d2d / 1e9,
      (bytes * 1.5 / uncast_s) / (2.0 * bytes / base_d2d));
  std::printf(
      "| overlap: kernel %.2f ms, D2H %.2f ms, together %.2f ms | | | %.2f | 1.0 = fully hidden "
      "|\n",
      kernel_s * 1e3, base_d2h * 1e3, both_s * 1e3, overlap);
  if (calibration_out != nullptr) {
    const std::size_t small_bytes = std::size_t{64} << 10;
    const MoveTimes small = time_moves(*pool, *enf, compute, small_bytes, 20);
    const std::size_t small_elems = small_bytes / 2;
    const double small_cast_s =
        std::max(time_it(20, compute,
                         [&] {
                           kern::cast_to_fp8(dev, kern::DType::kBF16, small_elems,
                                             static_cast<std::uint8_t*>(q), static_cast<float*>(sc),
                                             128, compute);
                         }),
                 time_it(20, compute, [&] {
                   kern::cast_from_fp8(static_cast<std::uint8_t*>(q), static_cast<float*>(sc),
                                       small_elems, 128, kern::DType::kBF16, dev2, compute);
                 }));
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    const std::string name = prop.name;
    const char* gpu = name.find("H200") != std::string::npos   ? "h200"
                      : name.find("H100") != std::string::npos ? "h100"
                                                               : nullptr;
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    std::ofstream out(calibration_out);
    out << "{\n";
    if (gpu != nullptr) out << "  \"gpu\": \"" << gpu << "\",\n";
    out << "  \"source\": \"bgl_enforcer_gpu_timing on " << name << ", " << date << "\",\n"
        << "  \"comment\": \"launch floors from 64 KiB pieces, peaks from 256 MiB; fp8_cast "
           "counts source bytes, the slower of cast and uncast\",\n"
        << "  \"rooflines\": {\n"
        << "    \"offload\": " << roofline_json(small.offload_s, off_s, bytes) << ",\n"
        << "    \"reload\": " << roofline_json(small.reload_s, rel_s, bytes) << ",\n"
        << "    \"fp8_cast\": " << roofline_json(small_cast_s, std::max(cast_s, uncast_s), bytes)
        << "\n  }\n}\n";
    if (!out) {
      std::printf("cannot write %s\n", calibration_out);
      return 1;
    }
    std::printf("calibration written to %s\n", calibration_out);
  }
  cudaFree(dev);
  cudaFree(dev2);
  cudaFree(q);
  cudaFree(sc);
  cudaFreeHost(host);
  cudaStreamDestroy(compute);
  return 0;
}

}  // namespace
}  // namespace bgl::enf

int main(int argc, char** argv) {
  const char* calibration_out = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--calibration-out") == 0 && i + 1 < argc) {
      calibration_out = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--calibration-out FILE]\n", argv[0]);
      return 2;
    }
  }
  return bgl::enf::run(calibration_out);
}
