// ForwardingOps: DeviceOps that hands every call to an upstream DeviceOps; adaptors derive from
// it and override what they change (EmulatedLinkOps: the copies; the tests' recording ops).
#pragma once

#include <memory>
#include <string>
#include <utility>

#include "enforcer/device_ops.h"

namespace bgl::enf::detail {

// See file comment. Thread safe as the upstream is.
class ForwardingOps : public DeviceOps {
 public:
  explicit ForwardingOps(std::unique_ptr<DeviceOps> upstream) : up_(std::move(upstream)) {}

  const char* name() const override { return up_->name(); }
  Status create_stream(Stream* out) override { return up_->create_stream(out); }
  void destroy_stream(Stream s) override { up_->destroy_stream(s); }
  Status synchronize(Stream s) override { return up_->synchronize(s); }
  Event record(Stream s) override { return up_->record(s); }
  bool query(const Event& e) override { return up_->query(e); }
  Status wait(const Event& e) override { return up_->wait(e); }
  void release(const Event& e) override { up_->release(e); }
  Status stream_wait(Stream s, const Event& e) override { return up_->stream_wait(s, e); }
  Status copy(void* dst, const void* src, std::size_t n, Stream s) override {
    return up_->copy(dst, src, n, s);
  }
  Status cast_to_fp8(const void* src, kern::DType t, std::size_t n, std::uint8_t* dst,
                     float* scales, std::size_t block, Stream s) override {
    return up_->cast_to_fp8(src, t, n, dst, scales, block, s);
  }
  Status cast_from_fp8(const std::uint8_t* src, const float* scales, std::size_t n,
                       std::size_t block, kern::DType t, void* dst, Stream s) override {
    return up_->cast_from_fp8(src, scales, n, block, t, dst, s);
  }
  void* host_alloc(std::size_t bytes) override { return up_->host_alloc(bytes); }
  void host_free(void* p) override { up_->host_free(p); }
  std::string last_error() const override { return up_->last_error(); }

 protected:
  DeviceOps& upstream() { return *up_; }

 private:
  std::unique_ptr<DeviceOps> up_;
};

}  // namespace bgl::enf::detail
