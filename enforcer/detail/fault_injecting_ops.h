// FaultInjectingOps: DeviceOps that fails or stalls the operation fault injection names
// (allocator/detail/fault.h, docs/operations.md "Fault injection"): a pinned host allocation
// returns null, a copy or FP8 cast returns kBackendError before queuing anything, a stalled copy
// is queued behind a work item that holds its stream in alloc::detail::stall() (on a host stream:
// only the stream's worker runs it, so a bounded wait on the stream times out; without a stream
// the calling thread sleeps). Everything else, and everything while injection is off, is the
// upstream's. The C ABI's enforcers always carry one (bgl_enf_create).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "allocator/detail/fault.h"
#include "allocator/host_stream.h"
#include "enforcer/detail/forwarding_ops.h"

namespace bgl::enf::detail {

// See file comment. Thread safe as the upstream is (the counters are atomics; the last error is
// per thread).
class FaultInjectingOps final : public ForwardingOps {
 public:
  explicit FaultInjectingOps(std::unique_ptr<DeviceOps> upstream)
      : ForwardingOps(std::move(upstream)) {}

  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    if (Status st = before_copy(s, "copy"); st != Status::kOk) return st;
    return upstream_result(upstream().copy(dst, src, n, s));
  }
  Status cast_to_fp8(const void* src, kern::DType t, std::size_t n, std::uint8_t* dst,
                     float* scales, std::size_t block, Stream s) override {
    if (Status st = before_copy(s, "FP8 cast"); st != Status::kOk) return st;
    return upstream_result(upstream().cast_to_fp8(src, t, n, dst, scales, block, s));
  }
  Status cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n,
                       std::size_t block, kern::DType t, void* dst, Stream s) override {
    if (Status st = before_copy(s, "FP8 uncast"); st != Status::kOk) return st;
    return upstream_result(upstream().cast_from_fp8(src, scales, n, block, t, dst, s));
  }
  // The upstream's calls that can fail: their error is the thread's latest, not an injected
  // failure that was absorbed (a retried pinned allocation) and never read.
  Status create_stream(Stream* out) override {
    return upstream_result(upstream().create_stream(out));
  }
  Status synchronize(Stream s) override { return upstream_result(upstream().synchronize(s)); }
  Status wait(const Event& e) override { return upstream_result(upstream().wait(e)); }
  Status stream_wait(Stream s, const Event& e) override {
    return upstream_result(upstream().stream_wait(s, e));
  }
  void* host_alloc(std::size_t bytes) override {
    if (alloc::detail::fault_point(alloc::detail::FaultKind::kPinned) ==
        alloc::detail::FaultAction::kFail) {
      injected() =
          "fault injection: pinned host allocation #" +
          std::to_string(alloc::detail::fault_operations(alloc::detail::FaultKind::kPinned)) +
          " of " + std::to_string(bytes) + " bytes failed";
      return nullptr;
    }
    void* p = upstream().host_alloc(bytes);
    if (p != nullptr) {
      alloc::detail::count_pinned_blocks(1);
    } else {
      injected().clear();
    }
    return p;
  }
  void host_free(void* p) override {
    if (p != nullptr) alloc::detail::count_pinned_blocks(-1);
    upstream().host_free(p);
  }
  std::string last_error() const override {
    std::string& e = injected();
    if (e.empty()) return ForwardingOps::last_error();
    std::string out;
    out.swap(e);  // reported once; the next failure may be the upstream's
    return out;
  }

 private:
  static std::string& injected() {
    thread_local std::string e;
    return e;
  }
  static Status upstream_result(Status st) {
    if (st != Status::kOk) injected().clear();
    return st;
  }

  Status before_copy(Stream s, const char* what) {
    switch (alloc::detail::fault_point(alloc::detail::FaultKind::kCopy)) {
      case alloc::detail::FaultAction::kNone:
        return Status::kOk;
      case alloc::detail::FaultAction::kFail:
        injected() =
            std::string("fault injection: ") + what + " (copy operation #" +
            std::to_string(alloc::detail::fault_operations(alloc::detail::FaultKind::kCopy)) +
            ") failed";
        return Status::kBackendError;
      case alloc::detail::FaultAction::kStall: {
        if (alloc::HostStream::is_live(s)) {
          static_cast<alloc::HostStream*>(s)->enqueue_on_worker([] { alloc::detail::stall(); });
        } else {
          alloc::detail::stall();
        }
        return Status::kOk;
      }
    }
    return Status::kOk;
  }
};

}  // namespace bgl::enf::detail
