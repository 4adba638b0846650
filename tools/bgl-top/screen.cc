#include "tools/bgl-top/screen.h"

namespace bgl::top {
namespace {

bool IsContinuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

}  // namespace

size_t DisplayWidth(std::string_view utf8) {
  size_t cells = 0;
  for (char c : utf8) cells += IsContinuation(c) ? 0 : 1;
  return cells;
}

std::string TruncateCells(std::string_view utf8, size_t width) {
  size_t cells = 0;
  for (size_t i = 0; i < utf8.size(); ++i) {
    if (!IsContinuation(utf8[i])) {
      if (cells == width) return std::string(utf8.substr(0, i));
      ++cells;
    }
  }
  return std::string(utf8);
}

std::string Fit(std::string_view text, size_t width, bool right) {
  std::string cut = TruncateCells(text, width);
  const std::string pad(width - DisplayWidth(cut), ' ');
  return right ? pad + cut : cut + pad;
}

Line TruncateLine(const Line& line, size_t width) {
  Line out;
  size_t used = 0;
  for (const Span& span : line) {
    if (used >= width) break;
    const size_t w = DisplayWidth(span.text);
    if (used + w <= width) {
      out.push_back(span);
      used += w;
    } else {
      out.push_back({TruncateCells(span.text, width - used), span.style});
      used = width;
    }
  }
  return out;
}

std::string ToPlainText(const Screen& screen) {
  std::string text;
  for (const Line& line : screen.lines) {
    std::string row;
    for (const Span& span : line) row += span.text;
    while (!row.empty() && row.back() == ' ') row.pop_back();
    text += row;
    text += '\n';
  }
  return text;
}

}  // namespace bgl::top
