// The memory bar of one GPU: cells for bytes in use, reserved but unused, and free capacity,
// with a marker where the planner's budget ends.
#pragma once

#include <cstdint>

#include "tools/bgl-top/glyphs.h"
#include "tools/bgl-top/screen.h"

namespace bgl::top {

// Byte figures of one GPU (GpuState's, copied so the bar is testable without protobuf).
struct BarFigures {
  int64_t capacity = 0;
  int64_t in_use = 0;
  int64_t reserved = 0;
  int64_t budget = 0;
};

// `width` cells; an empty-capacity GPU draws all free. Appends the spans to `line`.
void AppendGpuBar(const BarFigures& figures, int width, const Glyphs& glyphs, Line& line);

}  // namespace bgl::top
