#include "tools/bgl-top/frame_layout.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "base/units.h"
#include "tools/bgl-top/gpu_bar.h"
#include "tools/bgl-top/strategy_text.h"

namespace bgl::top {
namespace {

std::string Bytes(int64_t bytes) { return FormatBytes(static_cast<double>(bytes)); }

std::string Clock(int64_t unix_ms) {
  const std::time_t t = static_cast<std::time_t>(unix_ms / 1000);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", &tm);
  return buf;
}

std::string Fixed(double value, int decimals) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

size_t LineWidth(const Line& line) {
  size_t width = 0;
  for (const Span& span : line) width += DisplayWidth(span.text);
  return width;
}

std::string Plural(size_t n, const std::string& word) {
  if (n == 1) return "1 " + word;
  const bool es = word.ends_with("s") || word.ends_with("ch");
  return std::to_string(n) + " " + word + (es ? "es" : "s");
}

// Appends `groups` separated by two spaces, starting a new (indented) line whenever the next
// group would pass `width`.
void PackGroups(const std::vector<Line>& groups, int width, Screen& screen) {
  Line* line = &screen.Add();
  for (const Line& group : groups) {
    if (!line->empty() && LineWidth(*line) + 2 + LineWidth(group) > static_cast<size_t>(width)) {
      line = &screen.Add();
      line->push_back({"     "});
    }
    if (!line->empty()) line->push_back({"  "});
    line->insert(line->end(), group.begin(), group.end());
  }
}

void AddTitle(const bagualu::v1::WatchResponse& frame, const LayoutOptions& o, Screen& screen) {
  size_t processes = 0;
  for (const auto& gpu : frame.gpus()) processes += static_cast<size_t>(gpu.processes_size());
  PackGroups({{{"bgl-top", Style::kTitle}},
              {{o.address}},
              {{Plural(static_cast<size_t>(frame.gpus_size()), "GPU") + ", " +
                Plural(processes, "process")}},
              {{Clock(frame.unix_ms())}},
              {{"sort: " + std::string(SortKeyName(o.sort)) + (o.reverse ? " (reversed)" : "")}}},
             o.width, screen);
}

void AddGpu(const bagualu::v1::GpuState& gpu, const History& history, const LayoutOptions& o,
            Screen& screen) {
  const Glyphs& glyphs = o.ascii ? AsciiGlyphs() : UnicodeGlyphs();
  // The figures come in groups, packed onto as few lines as the width allows.
  std::vector<Line> groups;
  groups.push_back(
      {{"GPU " + std::to_string(gpu.gpu_index()), Style::kHeader}, {" " + gpu.gpu_uuid()}});
  groups.push_back({{"in use " + Bytes(gpu.in_use_bytes()), Style::kInUse}});
  groups.push_back({{"reserved " + Bytes(gpu.reserved_bytes()), Style::kReserved}});
  groups.push_back({{"budget " + Bytes(gpu.budget_bytes()), Style::kBudget}});
  groups.push_back({{"capacity " + Bytes(gpu.capacity_bytes())}});
  groups.push_back({{"load " + Fixed(gpu.load_factor(), 2),
                     gpu.load_factor() > kSpikeLoadFactor ? Style::kSpike : Style::kNormal}});
  const uint64_t lookups = gpu.plan_cache_hits() + gpu.plan_cache_misses();
  groups.push_back(
      {{"cache " + std::to_string(gpu.plan_cache_hits()) + "/" + std::to_string(lookups)}});
  groups.push_back({{"OOMs avoided " + std::to_string(gpu.ooms_avoided())}});
  PackGroups(groups, o.width, screen);

  // " mem  [" + bar + "] " + a 12-cell suffix.
  const int bar_width = std::max(10, o.width - 21);
  Line& bar = screen.Add();
  bar.push_back({" mem  ["});
  AppendGpuBar({gpu.capacity_bytes(), gpu.in_use_bytes(), gpu.reserved_bytes(), gpu.budget_bytes()},
               bar_width, glyphs, bar);
  const double percent = gpu.capacity_bytes() > 0
                             ? 100.0 * static_cast<double>(gpu.in_use_bytes()) /
                                   static_cast<double>(gpu.capacity_bytes())
                             : 0.0;
  bar.push_back({"] " + Fixed(percent, 0) + "% used"});

  const auto& samples = history.Of(gpu.gpu_uuid());
  Line& spark = screen.Add();
  Line& markers = screen.Add();
  spark.push_back({" hist ["});
  markers.push_back({"       "});
  AppendSparkline(samples, bar_width, glyphs, spark, markers);
  const int spikes = CountSpikes(samples, bar_width);
  spark.push_back({"] " + Plural(static_cast<size_t>(spikes), "spike"),
                   spikes > 0 ? Style::kSpike : Style::kDim});
  markers.push_back({"  " + glyphs.spike + " r > " + Fixed(kSpikeLoadFactor, 1), Style::kDim});
}

// Column layout of the process table; the last column takes the rest of the width.
struct Column {
  const char* title;
  size_t width;
  bool right;
};
// PLANNED and ACTUAL: the activation bytes on the device of the micro-batches in flight, as
// their plans predict and as they are; STRATEGIES: the mix those plans give (issue 44). A size
// takes at most 8 cells (FormatBytes: at most three integer digits).
constexpr Column kColumns[] = {{"GPU", 3, true},   {"PID", 7, true},     {"USER", 8, false},
                               {"JOB", 10, false}, {"RANK", 4, true},    {"IN USE", 8, true},
                               {"PEAK", 8, true},  {"PLANNED", 8, true}, {"ACTUAL", 8, true},
                               {"LOAD", 5, true},  {"OOMS-AV", 7, true}, {"STRATEGIES", 0, false}};

std::string Row(const std::vector<std::string>& cells, int width) {
  std::string text;
  size_t used = 0;
  for (size_t i = 0; i < cells.size(); ++i) {
    const Column& c = kColumns[i];
    size_t w = c.width;
    if (w == 0) w = static_cast<size_t>(std::max<int>(10, width - static_cast<int>(used)));
    text += Fit(cells[i], w, c.right);
    used += w;
    if (i + 1 < cells.size()) {
      text += ' ';
      ++used;
    }
  }
  return text;
}

void AddProcesses(const bagualu::v1::WatchResponse& frame, const LayoutOptions& o, Screen& screen) {
  std::vector<std::string> titles;
  for (const Column& c : kColumns) titles.push_back(c.title);
  screen.Add().push_back({Row(titles, o.width), Style::kHeader});
  const auto rows = SortedProcesses(frame, o.sort, o.reverse);
  if (rows.empty()) {
    screen.Add().push_back({"(no sessions)", Style::kDim});
    return;
  }
  for (const ProcessRef& ref : rows) {
    const auto& r = *ref.row;
    const auto& s = r.session();
    const auto& e = r.in_effect();
    const bool reported = r.has_in_effect();
    const std::string user = s.user().empty() ? std::to_string(s.uid()) : s.user();
    Line& line = screen.Add();
    line.push_back(
        {Row({std::to_string(ref.gpu->gpu_index()), std::to_string(s.pid()), user,
              s.job_id().empty() ? "-" : s.job_id(), std::to_string(s.pipeline_rank()),
              Bytes(r.in_use_bytes()), Bytes(r.peak_bytes()),
              reported ? Bytes(e.planned_bytes()) : "-", reported ? Bytes(e.actual_bytes()) : "-",
              Fixed(r.load_factor(), 2), std::to_string(r.ooms_avoided()),
              // What the process serves; the latest plan's when it reports nothing.
              StrategyText(reported ? e.strategy_counts() : r.strategy_counts())},
             o.width),
         r.load_factor() > kSpikeLoadFactor ? Style::kSpike : Style::kNormal});
    // Host bytes: the plans' in effect against what the micro-batches hold there, and under a
    // node grant (issue 14) the pinned bytes in use against it, the link and the bandwidth
    // share of its last plan.
    std::vector<Line> groups;
    if (reported) {
      groups.push_back(
          {{"    in flight " + Plural(static_cast<size_t>(e.micro_batches()), "micro-batch")}});
      groups.push_back({{"on host planned " + Bytes(e.planned_host_bytes()) + " actual " +
                         Bytes(e.actual_host_bytes())}});
    }
    const bool over = s.host_used_bytes() > s.host_grant_bytes();
    if (s.host_grant_bytes() > 0) {
      groups.push_back(
          {{(groups.empty() ? "    " : "") + std::string("pinned ") + Bytes(s.host_used_bytes()) +
                " of grant " + Bytes(s.host_grant_bytes()),
            over ? Style::kSpike : Style::kDim}});
      groups.push_back(
          {{"link " + std::to_string(s.link()) + "  share " + Fixed(r.bandwidth_share(), 2)}});
    }
    if (r.offloading() || e.planned_host_bytes() > 0) groups.push_back({{"offloading"}});
    if (!groups.empty()) {
      for (Line& g : groups) {
        for (Span& span : g) {
          if (span.style == Style::kNormal) span.style = Style::kDim;
        }
      }
      PackGroups(groups, o.width, screen);
    }
  }
}

// The node's host budget and, per host link, its sessions, how many offload now, grants and use.
void AddLinks(const bagualu::v1::WatchResponse& frame, const LayoutOptions& o, Screen& screen) {
  if (frame.links().empty() && frame.host_budget_bytes() == 0) return;
  int64_t granted = 0;
  for (const auto& l : frame.links()) granted += l.host_grant_bytes();
  PackGroups({{{"node", Style::kHeader}},
              {{"host budget " + Bytes(frame.host_budget_bytes())}},
              {{"granted " + Bytes(granted)}}},
             o.width, screen);
  for (const auto& l : frame.links()) {
    std::string gpus;
    for (int g : l.gpus()) gpus += (gpus.empty() ? "" : ",") + std::to_string(g);
    const bool shared = l.offloading_sessions() > 1;
    PackGroups({{{" link " + (l.link() >= 0 ? std::to_string(l.link()) : std::string("-")) +
                  " [GPU " + gpus + "]"}},
                {{Plural(static_cast<size_t>(l.sessions()), "session")}},
                {{std::to_string(l.offloading_sessions()) + " offloading",
                  shared ? Style::kSpike : Style::kNormal}},
                {{"host " + Bytes(l.host_used_bytes()) + "/" + Bytes(l.host_grant_bytes())}}},
               o.width, screen);
  }
  screen.Add();
}

}  // namespace

Screen LayoutFrame(const bagualu::v1::WatchResponse& frame, const History& history,
                   const LayoutOptions& options) {
  Screen screen;
  AddTitle(frame, options, screen);
  screen.Add();
  if (frame.gpus().empty()) {
    screen.Add().push_back({"(no GPUs: no training process has registered)", Style::kDim});
    screen.Add();
  }
  for (const auto& gpu : frame.gpus()) {
    AddGpu(gpu, history, options, screen);
    screen.Add();
  }
  AddLinks(frame, options, screen);
  AddProcesses(frame, options, screen);
  if (!options.status_line.empty()) {
    screen.Add();
    screen.Add().push_back({options.status_line, Style::kWarn});
  }
  if (options.show_keys) {
    screen.Add();
    screen.Add().push_back(
        {"q quit  sort: m memory  e peak  p pid  u user  j job  r rank  "
         "o ooms  g gpu  R reverse",
         Style::kDim});
  }
  for (Line& line : screen.lines) line = TruncateLine(line, static_cast<size_t>(options.width));
  return screen;
}

}  // namespace bgl::top
