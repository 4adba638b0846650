#include "kernels/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define BGL_KERN_STREAM_STORES 1
#else
#define BGL_KERN_STREAM_STORES 0
#endif

namespace bgl::kern {

void stream_copy_host(void* dst, const void* src, std::size_t n) {
  if (n == 0) return;  // nothing to copy (and memcpy must not see a null pointer)
#if BGL_KERN_STREAM_STORES
  if (n >= kStreamCopyMin) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    // Head: up to the destination's first 16-byte boundary (stores must be aligned).
    const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    // Body: 64 bytes (a cache line) per step, unaligned loads, streaming stores.
    const std::size_t lines = n / 64;
    for (std::size_t i = 0; i < lines; ++i, d += 64, s += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
    }
    // Streaming stores are weakly ordered: fence before another thread (or the caller's next
    // load through another pointer) may read the destination.
    _mm_sfence();
    std::memcpy(d, s, n % 64);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace bgl::kern
