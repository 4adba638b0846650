#include "tools/bgl-top/glyphs.h"

namespace bgl::top {

const Glyphs& UnicodeGlyphs() {
  static const Glyphs glyphs{"█", "▒", "·", "│", "▲", {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"}};
  return glyphs;
}

const Glyphs& AsciiGlyphs() {
  static const Glyphs glyphs{"#", "=", ".", "|", "^", {"_", ".", "-", "-", "=", "=", "#", "#"}};
  return glyphs;
}

}  // namespace bgl::top
