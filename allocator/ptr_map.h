// PtrMap: an open-addressing hash map from block address to Block*, with no allocation per
// insert (the pool's live-allocation index on the hot path).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace bgl::alloc {

struct Block;

// Linear probing with tombstones; keys are non-zero addresses (0 and 1 are reserved).
class PtrMap {
 public:
  PtrMap() { slots_.resize(1024); }

  Block* find(std::uintptr_t key) const {
    for (std::size_t i = hash(key);; i = (i + 1) & mask()) {
      const Slot& s = slots_[i];
      if (s.key == key) return s.value;
      if (s.key == kEmpty) return nullptr;
    }
  }

  void insert(std::uintptr_t key, Block* value) {
    if ((size_ + tombstones_ + 1) * 2 > slots_.size()) rehash();
    std::size_t i = hash(key);
    while (slots_[i].key != kEmpty && slots_[i].key != kTomb) i = (i + 1) & mask();
    if (slots_[i].key == kTomb) --tombstones_;
    slots_[i] = Slot{key, value};
    ++size_;
  }

  bool erase(std::uintptr_t key) {
    for (std::size_t i = hash(key);; i = (i + 1) & mask()) {
      Slot& s = slots_[i];
      if (s.key == key) {
        s.key = kTomb;
        s.value = nullptr;
        --size_;
        ++tombstones_;
        return true;
      }
      if (s.key == kEmpty) return false;
    }
  }

  std::size_t size() const { return size_; }

 private:
  static constexpr std::uintptr_t kEmpty = 0;
  static constexpr std::uintptr_t kTomb = 1;
  struct Slot {
    std::uintptr_t key = kEmpty;
    Block* value = nullptr;
  };

  std::size_t mask() const { return slots_.size() - 1; }
  std::size_t hash(std::uintptr_t k) const {
    return static_cast<std::size_t>((k >> 9) * 0x9E3779B97F4A7C15ull >> 20) & mask();
  }
  void rehash() {
    std::vector<Slot> old;
    old.swap(slots_);
    std::size_t cap = old.size();
    if ((size_ + 1) * 4 > cap) cap *= 2;  // grow when mostly live, else just drop tombstones
    slots_.assign(cap, Slot{});
    size_ = tombstones_ = 0;
    for (const Slot& s : old) {
      if (s.key != kEmpty && s.key != kTomb) insert(s.key, s.value);
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  std::size_t tombstones_ = 0;
};

}  // namespace bgl::alloc
