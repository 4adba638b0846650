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
  by_micro_batch_[desc.micro_batch].all[h] = &t;
  *handle = h;
  return Status::kOk;
}

const ActivationTracker::MicroBatch* ActivationTracker::micro_batch(int micro_batch) const {
  auto it = by_micro_batch_.find(micro_batch);
  return it == by_micro_batch_.end() ? nullptr : &it->second;
}

const std::map<std::uint64_t, TrackedTensor*>& ActivationTracker::of_micro_batch(
    int micro_batch) const {
  static const std::map<std::uint64_t, TrackedTensor*> kNone;
  const MicroBatch* mb = this->micro_batch(micro_batch);
  return mb == nullptr ? kNone : mb->all;
}

void ActivationTracker::set_placement(TrackedTensor& t, Placement p) {
  if (t.placement == p) return;
  MicroBatch& mb = by_micro_batch_[t.desc.micro_batch];
  if (t.placement == Placement::kHost) mb.host.erase({t.need_order, t.handle});
  if (p == Placement::kHost) mb.host[{t.need_order, t.handle}] = &t;
  t.placement = p;
}

void ActivationTracker::set_reload_unused(TrackedTensor& t, bool unused) {
  if (t.reload_unused == unused) return;
  MicroBatch& mb = by_micro_batch_[t.desc.micro_batch];
  mb.reload_unused += unused ? 1 : std::size_t(-1);
  t.reload_unused = unused;
}

void ActivationTracker::set_need_order(TrackedTensor& t, std::int64_t order) {
  if (t.need_order == order) return;
  if (t.placement == Placement::kHost) {
    MicroBatch& mb = by_micro_batch_[t.desc.micro_batch];
    mb.host.erase({t.need_order, t.handle});
    mb.host[{order, t.handle}] = &t;
  }
  t.need_order = order;
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
  TrackedTensor& t = it->second;
  auto mb = by_micro_batch_.find(t.desc.micro_batch);
  if (mb != by_micro_batch_.end()) {
    if (t.placement == Placement::kHost) mb->second.host.erase({t.need_order, t.handle});
    if (t.reload_unused) --mb->second.reload_unused;
    mb->second.all.erase(handle);
    if (mb->second.all.empty()) by_micro_batch_.erase(mb);
  }
  tensors_.erase(it);
}

}  // namespace bgl::enf
