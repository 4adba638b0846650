#include "tools/bgl-top/curses_ui.h"

#include <curses.h>

#include <clocale>

namespace bgl::top {
namespace {

// Colour pair numbers, one per Style.
short PairOf(Style style) { return static_cast<short>(static_cast<int>(style) + 1); }

void InitColours() {
  if (!has_colors()) return;
  start_color();
  use_default_colors();
  struct Def {
    Style style;
    short fg;
  };
  const Def defs[] = {{Style::kNormal, -1},
                      {Style::kTitle, COLOR_CYAN},
                      {Style::kHeader, COLOR_CYAN},
                      {Style::kInUse, COLOR_GREEN},
                      {Style::kReserved, COLOR_YELLOW},
                      {Style::kFree, -1},
                      {Style::kBudget, COLOR_MAGENTA},
                      {Style::kSpike, COLOR_RED},
                      {Style::kDim, -1},
                      {Style::kWarn, COLOR_RED}};
  for (const Def& d : defs) init_pair(PairOf(d.style), d.fg, -1);
}

attr_t AttrOf(Style style) {
  attr_t attr = has_colors() ? COLOR_PAIR(PairOf(style)) : A_NORMAL;
  switch (style) {
    case Style::kTitle:
    case Style::kHeader:
    case Style::kSpike:
    case Style::kWarn:
      return attr | A_BOLD;
    case Style::kDim:
    case Style::kFree:
      return attr | A_DIM;
    default:
      return attr;
  }
}

void Draw(const Screen& screen) {
  erase();
  const int rows = LINES;
  const size_t cols = static_cast<size_t>(COLS > 1 ? COLS - 1 : 1);
  for (int y = 0; y < rows && y < static_cast<int>(screen.lines.size()); ++y) {
    move(y, 0);
    for (const Span& span : TruncateLine(screen.lines[static_cast<size_t>(y)], cols)) {
      const attr_t attr = AttrOf(span.style);
      attron(attr);
      addstr(span.text.c_str());
      attroff(attr);
    }
  }
  refresh();
}

// Puts the terminal back however the loop ends.
struct CursesSession {
  CursesSession() {
    std::setlocale(LC_ALL, "");
    initscr();
    cbreak();
    noecho();
    curs_set(0);
    keypad(stdscr, TRUE);
    timeout(100);
    InitColours();
  }
  ~CursesSession() { endwin(); }
};

}  // namespace

int RunCursesUi(WatchFeed& feed, History& history, bagualu::v1::WatchResponse latest,
                LayoutOptions options) {
  CursesSession session;
  options.show_keys = true;
  bool dirty = true;
  while (true) {
    for (auto& frame : feed.Drain()) {
      history.Add(frame);
      latest = std::move(frame);
      dirty = true;
    }
    const std::string problem = feed.Problem();
    if (problem != options.status_line) {
      options.status_line = problem;
      dirty = true;
    }
    if (dirty) {
      options.width = COLS > 1 ? COLS - 1 : 1;
      Draw(LayoutFrame(latest, history, options));
      dirty = false;
    }
    const int ch = getch();
    if (ch == ERR) continue;
    if (ch == 'q' || ch == 'Q' || ch == 27) return 0;
    if (ch == 'R') {
      options.reverse = !options.reverse;
    } else if (auto key = SortKeyForPress(ch)) {
      options.sort = *key;
    }
    dirty = true;  // also covers KEY_RESIZE
  }
}

}  // namespace bgl::top
