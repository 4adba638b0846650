// bgl-top: a live terminal dashboard of bgl-governord's per-GPU state and decisions.
#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "tools/bgl-top/curses_ui.h"
#include "tools/bgl-top/frame_json.h"
#include "tools/bgl-top/frame_layout.h"
#include "tools/bgl-top/options.h"
#include "tools/bgl-top/watch_feed.h"
#include "tools/bglctl/governor_address.h"

namespace {

// Columns for plain-text output: --width, the terminal's, $COLUMNS, or 120.
int TextWidth(int requested) {
  if (requested > 0) return requested;
  winsize ws{};
  if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 40) {
    return ws.ws_col;
  }
  if (const char* env = std::getenv("COLUMNS")) {
    const int cols = std::atoi(env);
    if (cols >= 40) return cols;
  }
  return 120;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace bgl::top;
  auto options = ParseTopOptions(std::vector<std::string>(argv + 1, argv + argc));
  if (!options.ok()) {
    std::cerr << "bgl-top: " << options.status().message() << "\n\n" << kTopUsage;
    return 2;
  }
  if (options->help) {
    std::cout << kTopUsage;
    return 0;
  }
  const std::string address =
      options->governor.empty() ? bgl::tools::DefaultGovernorAddress() : options->governor;
  if (auto st = bgl::tools::CheckGovernorAddress(address); !st.ok()) {
    std::cerr << "bgl-top: " << st.message() << "\n";
    return 2;
  }
  if (!options->once && !options->json && !isatty(STDOUT_FILENO)) {
    std::cerr << "bgl-top: stdout is not a terminal; use --once or --json\n";
    return 2;
  }
  auto channel = bgl::tools::OpenGovernorChannel(address);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options->timeout_s * 1000));
  auto first = ReadOneFrame(channel, address, timeout);
  if (!first.ok()) {
    std::cerr << "bgl-top: " << first.status().message() << "\n";
    return 1;
  }
  History history;
  history.Add(*first);
  LayoutOptions layout;
  layout.sort = options->sort;
  layout.reverse = options->reverse;
  layout.ascii = options->ascii;
  layout.address = address;
  if (options->json) {
    std::cout << FrameToJson(*first, history, options->sort, options->reverse, address).dump(2)
              << "\n";
    return 0;
  }
  if (options->once) {
    layout.width = TextWidth(options->width);
    std::cout << ToPlainText(LayoutFrame(*first, history, layout));
    return 0;
  }
  WatchFeed feed(channel, address, static_cast<int>(options->interval_s * 1000));
  return RunCursesUi(feed, history, std::move(*first), layout);
}
