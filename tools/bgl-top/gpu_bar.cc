#include "tools/bgl-top/gpu_bar.h"

#include <algorithm>
#include <cmath>

namespace bgl::top {
namespace {

// Cells covering `bytes` of `capacity` over `width` cells, rounded to nearest.
int Cells(int64_t bytes, int64_t capacity, int width) {
  if (capacity <= 0 || bytes <= 0) return 0;
  const double cells = static_cast<double>(bytes) / static_cast<double>(capacity) * width;
  return std::clamp(static_cast<int>(std::lround(cells)), 0, width);
}

}  // namespace

void AppendGpuBar(const BarFigures& f, int width, const Glyphs& glyphs, Line& line) {
  width = std::max(width, 1);
  const int used = Cells(f.in_use, f.capacity, width);
  const int reserved = std::max(used, Cells(std::max(f.reserved, f.in_use), f.capacity, width));
  // The budget marker sits on the cell holding the budget's last byte.
  int budget_cell = -1;
  if (f.capacity > 0 && f.budget > 0) {
    const double pos = static_cast<double>(f.budget) / static_cast<double>(f.capacity) * width;
    budget_cell = std::clamp(static_cast<int>(std::ceil(pos)) - 1, 0, width - 1);
  }
  Style current = Style::kNormal;
  std::string run;
  auto flush = [&] {
    if (!run.empty()) line.push_back({run, current});
    run.clear();
  };
  for (int i = 0; i < width; ++i) {
    Style style = Style::kFree;
    const std::string* glyph = &glyphs.free;
    if (i == budget_cell) {
      style = Style::kBudget;
      glyph = &glyphs.budget;
    } else if (i < used) {
      style = Style::kInUse;
      glyph = &glyphs.in_use;
    } else if (i < reserved) {
      style = Style::kReserved;
      glyph = &glyphs.reserved;
    }
    if (style != current) {
      flush();
      current = style;
    }
    run += *glyph;
  }
  flush();
}

}  // namespace bgl::top
