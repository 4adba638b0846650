// BGL_ALLOC_INTERNAL: the C++ surface of bgl_alloc_core that libbgl_alloc.so (and the preload
// shim) export for libbgl_enforce.so only, so that a process holds one global pool, one
// HostStream registry and one last-error slot per thread. Not an API: no ABI promise, it changes
// with the code; programs use the C ABI of bgl/alloc.h.
#pragma once

#define BGL_ALLOC_INTERNAL __attribute__((visibility("default")))
