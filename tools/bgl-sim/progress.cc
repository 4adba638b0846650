#include "tools/bgl-sim/progress.h"

#include <unistd.h>

namespace bgl::sim {

bool StderrIsTerminal() { return isatty(STDERR_FILENO) == 1; }

void ProgressBar::Update(long done, const std::string& label) {
  if (!enabled_) return;
  const int percent = static_cast<int>(100 * done / total_);
  if (percent == last_percent_ && label == last_label_) return;
  last_percent_ = percent;
  last_label_ = label;
  constexpr int kWidth = 30;
  const int filled = percent * kWidth / 100;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kWidth - filled), '.');
  std::fprintf(stderr, "\r%-13s [%s] %3d%% (%ld/%ld)", label.c_str(), bar.c_str(), percent, done,
               total_);
  std::fflush(stderr);
}

void ProgressBar::Finish() {
  if (!enabled_) return;
  std::fputc('\n', stderr);
}

}  // namespace bgl::sim
