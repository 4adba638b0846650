// DeviceOps on HostStreams: every operation is a work item on the stream's worker thread, so
// stream order, cross-stream waits and event completion behave as on a GPU.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "allocator/detail/fault.h"
#include "allocator/host_stream.h"
#include "enforcer/device_ops.h"
#include "kernels/fp8_cast.h"
#include "kernels/stream_copy.h"

namespace bgl::enf {
namespace {

using alloc::HostStream;

constexpr std::size_t kHostPage = 4096;

HostStream* live(Stream s) {
  return HostStream::is_live(s) ? static_cast<HostStream*>(s) : nullptr;
}

class HostDeviceOps final : public DeviceOps {
 public:
  const char* name() const override { return "host"; }

  Status create_stream(Stream* out) override {
    *out = new HostStream();
    return Status::kOk;
  }
  void destroy_stream(Stream s) override {
    if (HostStream* h = live(s)) delete h;
  }
  Status synchronize(Stream s) override {
    HostStream* h = live(s);
    if (h == nullptr || h->synchronize_for(alloc::detail::wait_timeout())) return Status::kOk;
    return timed_out("the stream's work");
  }

  Event record(Stream s) override {
    HostStream* h = live(s);
    if (h == nullptr) return Event{};
    return Event{h, h->enqueued()};
  }
  bool query(const Event& e) override {
    return e.handle == nullptr || static_cast<HostStream*>(e.handle)->done(e.value);
  }
  Status wait(const Event& e) override {
    if (e.handle == nullptr ||
        static_cast<HostStream*>(e.handle)->wait_for(e.value, alloc::detail::wait_timeout())) {
      return Status::kOk;
    }
    return timed_out("the stream work before an event");
  }
  Status stream_wait(Stream s, const Event& e) override {
    if (e.handle == nullptr || e.handle == s) return Status::kOk;  // complete / same stream
    HostStream* h = live(s);
    if (h == nullptr) return wait(e);
    auto* src = static_cast<HostStream*>(e.handle);
    const std::uint64_t ticket = e.value;
    if (src->done(ticket)) return Status::kOk;
    // On the worker only: a thread whose wait on `h` is bounded must not block in here (a
    // device-side wait: the work after it may not start before `src` got there).
    h->enqueue_on_worker([src, ticket] { src->wait(ticket); });
    return Status::kOk;
  }

  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    // Offloads and reloads: their destination is read later, not now (stream_copy.h).
    run(s, [dst, src, n] { kern::stream_copy_host(dst, src, n); });
    return Status::kOk;
  }
  Status cast_to_fp8(const void* src, kern::DType t, std::size_t n, std::uint8_t* dst,
                     float* scales, std::size_t block, Stream s) override {
    run(s, [=] { kern::cast_to_fp8_host(src, t, n, dst, scales, block); });
    return Status::kOk;
  }
  Status cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n,
                       std::size_t block, kern::DType t, void* dst, Stream s) override {
    run(s, [=] { kern::cast_from_fp8_host(src, scales, n, block, t, dst); });
    return Status::kOk;
  }

  void* host_alloc(std::size_t bytes) override {
    const std::size_t rounded = (bytes + kHostPage - 1) / kHostPage * kHostPage;
    return std::aligned_alloc(kHostPage, rounded == 0 ? kHostPage : rounded);
  }
  void host_free(void* p) override { std::free(p); }

  std::string last_error() const override { return error(); }

 private:
  // The calling thread's last failure (DeviceOps is shared by threads).
  static std::string& error() {
    thread_local std::string e;
    return e;
  }
  static Status timed_out(const char* what) {
    error() = alloc::detail::wait_timeout_message(what);
    return Status::kBackendError;
  }

  template <typename F>
  static void run(Stream s, F&& f) {
    if (HostStream* h = live(s)) {
      h->enqueue(std::forward<F>(f));
    } else {
      f();
    }
  }
};

}  // namespace

std::unique_ptr<DeviceOps> make_host_device_ops() { return std::make_unique<HostDeviceOps>(); }

std::unique_ptr<DeviceOps> make_device_ops(const std::string& backend_name, int device,
                                           std::string* error) {
  if (backend_name == "host") return make_host_device_ops();
#if BGL_ALLOC_HAVE_CUDA
  if (backend_name == "cuda-vmm" || backend_name == "cuda-async") {
    return make_cuda_device_ops(device);
  }
#else
  (void)device;
#endif
  *error = "no enforcer device operations for backend '" + backend_name + "' in this build";
  return nullptr;
}

}  // namespace bgl::enf
