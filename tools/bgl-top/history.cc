#include "tools/bgl-top/history.h"

#include <algorithm>
#include <cmath>

namespace bgl::top {

void History::Add(const bagualu::v1::WatchResponse& frame) {
  for (const auto& gpu : frame.gpus()) {
    auto& series = samples_[gpu.gpu_uuid()];
    series.push_back(
        {frame.unix_ms(), gpu.in_use_bytes(), gpu.capacity_bytes(), gpu.load_factor()});
    while (series.size() > depth_) series.pop_front();
  }
}

const std::deque<Sample>& History::Of(const std::string& gpu_uuid) const {
  static const std::deque<Sample> kEmpty;
  auto it = samples_.find(gpu_uuid);
  return it == samples_.end() ? kEmpty : it->second;
}

void AppendSparkline(const std::deque<Sample>& samples, int width, const Glyphs& glyphs,
                     Line& spark, Line& markers) {
  width = std::max(width, 1);
  const size_t shown = std::min(samples.size(), static_cast<size_t>(width));
  const size_t pad = static_cast<size_t>(width) - shown;
  if (pad > 0) {
    spark.push_back({std::string(pad, ' '), Style::kDim});
    markers.push_back({std::string(pad, ' '), Style::kNormal});
  }
  for (size_t i = samples.size() - shown; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    double fraction = 0;
    if (s.capacity_bytes > 0) {
      fraction = static_cast<double>(s.in_use_bytes) / static_cast<double>(s.capacity_bytes);
    }
    const int level = std::clamp(static_cast<int>(std::floor(fraction * 8)), 0, 7);
    spark.push_back({glyphs.levels[level], s.spike() ? Style::kSpike : Style::kInUse});
    markers.push_back(s.spike() ? Span{glyphs.spike, Style::kSpike} : Span{" ", Style::kNormal});
  }
}

int CountSpikes(const std::deque<Sample>& samples, int width) {
  const size_t shown = std::min(samples.size(), static_cast<size_t>(std::max(width, 1)));
  return static_cast<int>(std::count_if(samples.end() - static_cast<std::ptrdiff_t>(shown),
                                        samples.end(), [](const Sample& s) { return s.spike(); }));
}

}  // namespace bgl::top
