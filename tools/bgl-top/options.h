// Command line of bgl-top. Errors name the flag (exit status 2).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"
#include "tools/bgl-top/process_sort.h"

namespace bgl::top {

// What one bgl-top run was asked to do.
struct TopOptions {
  std::string governor;     // empty: $BGL_GOVERNOR, else the default socket
  bool once = false;        // one plain-text frame on stdout, no curses
  bool json = false;        // one frame as JSON on stdout
  double interval_s = 1.0;  // -d: refresh (Watch interval)
  SortKey sort = SortKey::kMemory;
  bool reverse = false;
  bool ascii = false;      // ASCII bars and sparklines
  int width = 0;           // 0: the terminal's, or $COLUMNS, or 120
  double timeout_s = 5.0;  // connect and first-frame deadline
  bool help = false;
};

// Parses argv without the program name.
Result<TopOptions> ParseTopOptions(const std::vector<std::string>& args);

extern const char* const kTopUsage;

}  // namespace bgl::top
