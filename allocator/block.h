// Block: a contiguous piece of an arena's address range, allocated, free, pending or unmapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/backend.h"

namespace bgl::alloc {

struct Arena;

enum class BlockState : std::uint8_t {
  kAllocated,    // handed out
  kPendingFree,  // freed, waiting for events on streams recorded with record_stream
  kFree,         // cached: mapped memory ready for reuse
  kUnmapped,     // address range with no memory behind it (expandable arenas only)
  kDead,         // recycled Block object (internal)
};

// Blocks of one region form a doubly linked list in address order. A free block is either
// "ready" (its last use has completed; any stream may take it) or owned by `stream` (reusable
// on that stream at once, on others after an event recorded on it after `free_seq`).
struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;  // allocated: bytes asked for
  BlockState state = BlockState::kFree;
  bool ready = false;
  Stream stream = nullptr;  // allocated: allocation stream; free && !ready: owner
  std::uint64_t free_seq = 0;
  int pending_events = 0;
  Block* prev = nullptr;
  Block* next = nullptr;
  Arena* arena = nullptr;
  std::vector<Stream> uses;  // extra streams from record_stream

  std::uintptr_t end() const { return addr + size; }
};

// Order of the free index: ready blocks first, then by owner stream, then best fit by size.
struct FreeOrder {
  bool operator()(const Block* a, const Block* b) const {
    if (a->ready != b->ready) return a->ready;
    if (!a->ready && a->stream != b->stream) {
      return reinterpret_cast<std::uintptr_t>(a->stream) <
             reinterpret_cast<std::uintptr_t>(b->stream);
    }
    if (a->size != b->size) return a->size < b->size;
    return a->addr < b->addr;
  }
};

// Address order.
struct AddrOrder {
  bool operator()(const Block* a, const Block* b) const { return a->addr < b->addr; }
};

}  // namespace bgl::alloc
