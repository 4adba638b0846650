// Test fixture pieces: a host-backend pool, host streams and an enforcer over them.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <vector>

#include "allocator/host_backend.h"
#include "allocator/host_stream.h"
#include "enforcer/enforcer.h"

namespace bgl::enf::testing {

// The allocator the enforcer runs on in these tests.
using alloc::HostBackend;
using alloc::HostBackendOptions;
using alloc::HostStream;
using alloc::PoolOptions;

struct Env {
  // `ops` null: the host backend's.
  explicit Env(std::size_t capacity = std::size_t{256} << 20, std::size_t pinned = 64 << 20,
               int max_inflight = 4, bool pressure = true,
               std::unique_ptr<DeviceOps> ops = nullptr) {
    HostBackendOptions bo;
    bo.capacity = capacity;
    bo.page_size = 64 << 10;
    PoolOptions po;
    po.log = false;
    pool = std::make_unique<Pool>(std::make_unique<HostBackend>(bo), po);
    EnforcerOptions eo;
    eo.pinned_capacity = pinned;
    eo.max_inflight = max_inflight;
    eo.d2h = &d2h;
    eo.h2d = &h2d;
    eo.pressure_eviction = pressure;
    std::string error;
    enf = Enforcer::create(pool.get(), ops != nullptr ? std::move(ops) : make_host_device_ops(),
                           eo, &error);
    EXPECT_NE(enf, nullptr) << error;
  }
  ~Env() {
    enf.reset();
    compute.synchronize();
  }

  // An owned tensor of `bytes` random bytes allocated on the compute stream.
  std::uint64_t make(std::size_t bytes, std::vector<std::uint8_t>* data, int producer = 0,
                     int micro_batch = 0, int graph_tensor = -1,
                     ElemType dtype = ElemType::kBytes) {
    void* p = pool->allocate(bytes, &compute);
    EXPECT_NE(p, nullptr);
    data->resize(bytes);
    for (auto& b : *data) b = static_cast<std::uint8_t>(rng());
    std::memcpy(p, data->data(), bytes);
    TensorDesc d;
    d.ptr = p;
    d.bytes = bytes;
    d.dtype = dtype;
    d.producer_op = producer;
    d.graph_tensor = graph_tensor;
    d.micro_batch = micro_batch;
    d.stream = &compute;
    d.owned = true;
    std::uint64_t h = 0;
    EXPECT_EQ(enf->register_tensor(d, &h), Status::kOk) << last_error();
    return h;
  }

  // Acquires for `consumer`, waits for the compute stream and compares with `want`.
  void expect_data(std::uint64_t h, const std::vector<std::uint8_t>& want, int consumer = -1) {
    void* p = nullptr;
    ASSERT_EQ(enf->acquire(h, consumer, &compute, &p), Status::kOk) << last_error();
    compute.synchronize();
    ASSERT_EQ(std::memcmp(p, want.data(), want.size()), 0) << "bytes differ, size " << want.size();
  }

  bgl_enf_tensor_info info(std::uint64_t h) {
    bgl_enf_tensor_info i{};
    EXPECT_EQ(enf->info(h, &i), Status::kOk);
    return i;
  }

  HostStream compute, d2h, h2d;
  std::unique_ptr<Pool> pool;
  std::unique_ptr<Enforcer> enf;
  std::mt19937 rng{12345};
};

// Blocks a host stream until open() (to hold a copy in flight).
struct Gate {
  explicit Gate(HostStream& s) {
    auto f = p.get_future().share();
    s.enqueue([f] { f.wait(); });
  }
  void open() { p.set_value(); }
  std::promise<void> p;
};

}  // namespace bgl::enf::testing
