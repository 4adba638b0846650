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

}  // namespace bgl::fuzz
