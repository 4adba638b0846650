// Allocator: the per-process set of device pools built from a Config (what the C ABI, the
// LD_PRELOAD shim and bgl-replay drive).
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "allocator/config.h"
#include "allocator/export.h"
#include "allocator/pool.h"

namespace bgl::alloc {

// Creates the backend `config.backend` names for `device`; null with `error` set on failure.
std::unique_ptr<Backend> make_backend(const Config& config, int device, std::string* error);

// One Pool per device, created on first use. Thread safe.
class BGL_ALLOC_INTERNAL Allocator {
 public:
  static constexpr int kMaxDevices = 64;

  // Resolves backend "auto" (cuda-vmm when a CUDA device exists, else host) and checks that
  // the backend can be built; false with `error` set otherwise.
  static std::unique_ptr<Allocator> create(const Config& config, std::string* error);
  ~Allocator();

  // Null (and last_error set) when `device` is out of range or its backend fails.
  Pool* pool(int device);
  // Pool of `device` if it already exists.
  Pool* existing_pool(int device) const;
  int device_count() const { return devices_; }
  const Config& config() const { return config_; }

  void* allocate(std::size_t bytes, int device, Stream stream);
  // Frees through the pool of `device`; a pointer of another device's pool is counted as a
  // wrong-device free there and freed by its owner.
  Status deallocate(void* ptr, std::size_t bytes, int device, Stream stream);
  // Snapshot of every pool in PyTorch's memory-snapshot layout, as JSON text.
  std::string snapshot_json() const;

 private:
  Allocator(const Config& config, int devices) : config_(config), devices_(devices) {}

  Config config_;
  int devices_;
  mutable std::mutex mu_;  // pool creation
  std::array<std::atomic<Pool*>, kMaxDevices> pools_{};
};

}  // namespace bgl::alloc
