// Lays out one dashboard frame: a title, per GPU a figures line, a memory bar and a history
// sparkline with spike markers, then the sorted process table.
#pragma once

#include <string>

#include "bagualu/v1/governor.pb.h"
#include "tools/bgl-top/history.h"
#include "tools/bgl-top/process_sort.h"
#include "tools/bgl-top/screen.h"

namespace bgl::top {

// How to lay a frame out.
struct LayoutOptions {
  int width = 120;  // terminal columns
  SortKey sort = SortKey::kMemory;
  bool reverse = false;
  bool ascii = false;
  std::string address;      // shown in the title
  std::string status_line;  // shown (as a warning) under the table when not empty
  bool show_keys = false;   // the interactive key help line
};

Screen LayoutFrame(const bagualu::v1::WatchResponse& frame, const History& history,
                   const LayoutOptions& options);

}  // namespace bgl::top
