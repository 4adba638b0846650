// Helpers shared by the libFuzzer targets (fuzz/README in docs/operations.md, section "Fuzzing").
// The parsers a user feeds through a path (model files, calibration files, traces) are driven
// through that path, the way bgl-plan, the daemon and bgl-replay call them: each input is written
// to one scratch file per process and the real loader reads it.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace bgl::fuzz {

// A scratch file `<dir>/bgl-fuzz-<pid><suffix>`: <dir> is $BGL_FUZZ_SCRATCH when set (scripts/
// fuzz.sh points it at its scratch folder, removed at the end, so a target that dies leaves
// nothing behind), else /dev/shm when it exists (no disk writes per execution), else $TMPDIR or
// /tmp. The same file is rewritten for every input.
inline const std::string& ScratchPath(const char* suffix) {
  static const std::string path = [suffix] {
    std::string dir = "/tmp";
    if (const char* s = std::getenv("BGL_FUZZ_SCRATCH"); s && *s) {
      dir = s;
    } else if (access("/dev/shm", W_OK) == 0) {
      dir = "/dev/shm";
    } else if (const char* t = std::getenv("TMPDIR"); t && *t) {
      dir = t;
    }
    return dir + "/bgl-fuzz-" + std::to_string(getpid()) + suffix;
  }();
  return path;
}

// Writes the input to `path` (truncating it); aborts when it cannot, since a failed write would
// silently fuzz nothing.
inline void WriteInput(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(("bgl fuzz: cannot write " + path).c_str());
    std::abort();
  }
}

// Removes the scratch file when the fuzzer exits normally.
struct ScratchRemover {
  explicit ScratchRemover(std::string p) : path(std::move(p)) {}
  ~ScratchRemover() { unlink(path.c_str()); }
  std::string path;
};

// Reads the fuzzer's bytes as the choices of a call sequence (the C ABI targets): each read
// takes the next bytes, and zeros once the input is used up (so every input is a whole
// sequence). Not thread-safe: one per input.
class Choices {
 public:
  Choices(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool more() const { return at_ < size_; }
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 8) | Byte();
    return v;
  }
  // A value in [lo, hi] (lo <= hi, a span below 2^32).
  int64_t In(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>((span > 0xff ? U32() : Byte()) % span);
  }
  // Mostly a small valid value in [lo, hi], sometimes one of the edges a caller might pass.
  int64_t Mostly(int64_t lo, int64_t hi) {
    static constexpr int64_t kEdges[] = {-1, 0, 1, INT32_MAX, INT64_MIN, INT64_MAX};
    const uint8_t b = Byte();
    return b < 240 ? In(lo, hi) : kEdges[b % 6];
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

}  // namespace bgl::fuzz
