// A one-line progress bar on stderr for long runs; silent unless enabled.
#pragma once

#include <cstdio>
#include <string>

namespace bgl::sim {

// Redraws "label [####....] done/total" at most once per percent.
class ProgressBar {
 public:
  ProgressBar(bool enabled, long total) : enabled_(enabled), total_(total > 0 ? total : 1) {}
  void Update(long done, const std::string& label);
  void Finish();

 private:
  bool enabled_;
  long total_;
  int last_percent_ = -1;
  std::string last_label_;
};

// True when stderr is a terminal.
bool StderrIsTerminal();

}  // namespace bgl::sim
