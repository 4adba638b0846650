// The process-wide Allocator behind the C ABI and the LD_PRELOAD shim.
#pragma once

#include "allocator/allocator.h"
#include "allocator/export.h"

namespace bgl::alloc {

// The allocator configured by bgl_alloc_configure or, on first use, from BGL_ALLOC_CONF; null
// (with the thread's last error set) when the configuration is invalid. Never destroyed: CUDA
// may be torn down before static destructors run.
BGL_ALLOC_INTERNAL Allocator* global_allocator();
// Replaces the configuration; refused while allocations are live.
Status configure_global(const char* conf);
// True when `ptr` is a live allocation of the global allocator (any device); sets `*device`.
bool global_owns(const void* ptr, int* device);

}  // namespace bgl::alloc
