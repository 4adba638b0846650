// Per-GPU history of Watch samples, and the sparkline that shows it with spike markers
// (samples whose load factor exceeds kSpikeLoadFactor, the MoE imbalance the planner absorbs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>

#include "bagualu/v1/governor.pb.h"
#include "tools/bgl-top/glyphs.h"
#include "tools/bgl-top/screen.h"

namespace bgl::top {

inline constexpr double kSpikeLoadFactor = 1.2;

// One GPU at one Watch sample.
struct Sample {
  int64_t unix_ms = 0;
  int64_t in_use_bytes = 0;
  int64_t capacity_bytes = 0;
  double load_factor = 0;
  bool spike() const { return load_factor > kSpikeLoadFactor; }
};

// The last `depth` samples of every GPU seen, keyed by GPU uuid.
class History {
 public:
  explicit History(size_t depth = 512) : depth_(depth) {}

  void Add(const bagualu::v1::WatchResponse& frame);
  // Samples of one GPU, oldest first; empty when never seen.
  const std::deque<Sample>& Of(const std::string& gpu_uuid) const;

 private:
  size_t depth_;
  std::map<std::string, std::deque<Sample>> samples_;
};

// The last `width` samples as sparkline cells (height = in use over capacity), spike samples
// in Style::kSpike, onto `spark`; `markers` gets the spike glyph under each spike and spaces
// elsewhere. Both lines take exactly `width` cells (left-padded when there are fewer samples).
void AppendSparkline(const std::deque<Sample>& samples, int width, const Glyphs& glyphs,
                     Line& spark, Line& markers);

// How many of the last `width` samples are spikes.
int CountSpikes(const std::deque<Sample>& samples, int width);

}  // namespace bgl::top
