#include "enforcer/tracker.h"

#include <cstdio>

namespace bgl::enf {

const char* placement_name(Placement p) {
  switch (p) {
    case Placement::kDevice:
      return "device";
    case Placement::kHost:
      return "host";
    case Placement::kFp8:
      return "fp8";
    case Placement::kDropped:
      return "dropped";
  }
  return "?";
}

const char* elem_type_name(ElemType t) {
  switch (t) {
    case ElemType::kF32:
      return "f32";
    case ElemType::kF16:
      return "f16";
    case ElemType::kBF16:
      return "bf16";
    case ElemType::kBytes:
      return "bytes";
  }
  return "?";
}

std::size_t TrackedTensor::num_released() const {
  std::size_t n = 0;
  for (const auto& c : consumers) n += c.released ? 1 : 0;
  return n;
}

Status ActivationTracker::add(const TensorDesc& desc, std::uint64_t* handle, std::string* error) {
  if (std::uint64_t other = lookup(desc.ptr)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%p", desc.ptr);
    *error = std::string("pointer ") + buf + " is already tracked as tensor " +
             std::to_string(other) + " (a storage saved twice: add a consumer instead)";
    return Status::kDuplicate;
  }
  const std::uint64_t h = next_++;
  TrackedTensor& t = tensors_[h];
  t.handle = h;
  t.desc = desc;
  t.owned = desc.owned;
  t.alloc_stream = desc.stream;
  t.need_order = static_cast<std::int64_t>(desc.micro_batch) * (std::int64_t{1} << 32) +
                 (std::int64_t{0x7fffffff} - desc.producer_op);
  set_ptr(t, desc.ptr);
  *handle = h;
  return Status::kOk;
}

TrackedTensor* ActivationTracker::find(std::uint64_t handle) {
  auto it = tensors_.find(handle);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::uint64_t ActivationTracker::lookup(const void* ptr) const {
  auto it = by_ptr_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it == by_ptr_.end() ? 0 : it->second;
}

void ActivationTracker::set_ptr(TrackedTensor& t, void* ptr) {
  if (t.ptr != nullptr) {
    auto it = by_ptr_.find(reinterpret_cast<std::uintptr_t>(t.ptr));
    if (it != by_ptr_.end() && it->second == t.handle) by_ptr_.erase(it);
  }
  t.ptr = ptr;
  if (ptr != nullptr) by_ptr_[reinterpret_cast<std::uintptr_t>(ptr)] = t.handle;
}

void ActivationTracker::remove(std::uint64_t handle) {
  auto it = tensors_.find(handle);
  if (it == tensors_.end()) return;
  set_ptr(it->second, nullptr);
  tensors_.erase(it);
}

}  // namespace bgl::enf
