// A rendered dashboard frame: lines of styled text spans. The same Screen is printed as plain
// text (--once) or drawn with curses colours, so both views always show the same layout.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace bgl::top {

// What a span shows; curses maps each to a colour, plain text ignores it.
enum class Style {
  kNormal,
  kTitle,
  kHeader,
  kInUse,
  kReserved,
  kFree,
  kBudget,
  kSpike,
  kDim,
  kWarn
};

// A run of text in one style.
struct Span {
  std::string text;
  Style style = Style::kNormal;
};

// One screen line.
using Line = std::vector<Span>;

// A whole frame, top to bottom.
struct Screen {
  std::vector<Line> lines;
  Line& Add() { return lines.emplace_back(); }
};

// Terminal cells a UTF-8 string takes (one per code point; the dashboard uses no wide glyphs).
size_t DisplayWidth(std::string_view utf8);
// The first `width` cells of a UTF-8 string.
std::string TruncateCells(std::string_view utf8, size_t width);
// `text` cut or space-padded to exactly `width` cells; right-aligned when `right`.
std::string Fit(std::string_view text, size_t width, bool right = false);
// A line cut to at most `width` cells.
Line TruncateLine(const Line& line, size_t width);
// The frame as plain text, one '\n'-terminated line per Line, trailing spaces removed.
std::string ToPlainText(const Screen& screen);

}  // namespace bgl::top
