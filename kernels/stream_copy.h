// The host backend's copy of an offload or a reload: a copy whose destination bypasses the caches
// (non-temporal stores) from kStreamCopyMin bytes on. On the host backend the simulated device
// and the pinned pool share the CPU's memory: a plain memcpy reads every destination line into
// the caches before writing it (twice the traffic of the copy) and evicts the model's working
// set; a GPU's copy engines do neither. Below the threshold, and off x86-64, it is memcpy.
// Thread-safe (no state).
#pragma once

#include <cstddef>

namespace bgl::kern {

// Copies of fewer bytes are plain memcpy (their destination lines are few and likely cached).
constexpr std::size_t kStreamCopyMin = 16 << 10;

// Copies n bytes from src to dst (not overlapping); any alignment, any n.
void stream_copy_host(void* dst, const void* src, std::size_t n);

}  // namespace bgl::kern
