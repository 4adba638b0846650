// The characters bars and sparklines are drawn with: Unicode blocks, or ASCII (--ascii) for
// terminals and logs that cannot show them.
#pragma once

#include <array>
#include <string>

namespace bgl::top {

// One glyph set.
struct Glyphs {
  std::string in_use;                 // bar cell: bytes in use
  std::string reserved;               // bar cell: reserved by the allocator but not in use
  std::string free;                   // bar cell: free capacity
  std::string budget;                 // bar cell: where the planner's budget ends
  std::string spike;                  // under a sparkline sample whose load factor is a spike
  std::array<std::string, 8> levels;  // sparkline levels, lowest first
};

const Glyphs& UnicodeGlyphs();
const Glyphs& AsciiGlyphs();

}  // namespace bgl::top
