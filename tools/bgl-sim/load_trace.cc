#include "tools/bgl-sim/load_trace.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

namespace bgl::sim {

double LoadTrace::MaxLoad(int iteration) const {
  double m = 0;
  for (const auto& rank : loads[iteration]) {
    for (double r : rank) m = std::max(m, r);
  }
  return m;
}

Result<LoadTrace> GenerateLoads(const LoadSpec& spec, int iterations, int ranks,
                                int micro_batches) {
  if (iterations < 1) return InvalidArgument("--iterations: must be positive");
  if (!(spec.spike_prob >= 0 && spec.spike_prob <= 1)) {
    return InvalidArgument("--spike-prob: must be in [0, 1]");
  }
  if (!(spec.normal_max > 1) || spec.normal_max > 64) {
    return InvalidArgument("--normal-max: must be in (1, 64]");
  }
  if (!(spec.spike_max >= spec.normal_max) || spec.spike_max > 64) {
    return InvalidArgument("--spike-max: must be in [normal-max, 64]");
  }
  if (spec.gpus_per_stage < 1) return InvalidArgument("gpus per stage must be positive");
  std::mt19937_64 rng(spec.seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  // The expected maximum of n half-normals is about s * sqrt(2 ln n); aim it at 60% of the
  // headroom below normal_max and clip the tail, so normal iterations stay below it.
  const double n = static_cast<double>(spec.gpus_per_stage);
  const double headroom = spec.normal_max - 1.0;
  const double sigma = 0.6 * headroom / std::max(1.0, std::sqrt(2.0 * std::log(n + 1.0)));
  const double normal_cap = 1.0 + 0.995 * headroom;
  LoadTrace trace;
  trace.loads.assign(
      iterations, std::vector<std::vector<double>>(ranks, std::vector<double>(micro_batches, 1.0)));
  trace.spike.assign(iterations, 0);
  for (int it = 0; it < iterations; ++it) {
    for (int rank = 0; rank < ranks; ++rank) {
      for (int mb = 0; mb < micro_batches; ++mb) {
        double worst = 1.0;
        for (int g = 0; g < spec.gpus_per_stage; ++g) {
          worst = std::max(worst, 1.0 + std::abs(normal(rng)) * sigma);
        }
        trace.loads[it][rank][mb] = std::min(worst, normal_cap);
      }
    }
    if (uniform(rng) >= spec.spike_prob) continue;
    trace.spike[it] = 1;
    // One skewed stretch of data: 1 to micro_batches/4 consecutive micro-batches, the first at
    // the iteration's peak factor, the rest between normal_max and the peak. Synchronized: the
    // same stretch on every rank; otherwise one stretch drawn per rank.
    for (int from = 0; from < ranks; from = spec.synchronized ? ranks : from + 1) {
      const int to = spec.synchronized ? ranks : from + 1;
      const double peak =
          spec.normal_max + (spec.spike_max - spec.normal_max) * std::sqrt(uniform(rng));
      const int span = 1 + static_cast<int>(uniform(rng) * std::max(1, micro_batches / 4));
      const int first = static_cast<int>(uniform(rng) * micro_batches);
      for (int i = 0; i < span && first + i < micro_batches; ++i) {
        const double factor =
            i == 0 ? peak : spec.normal_max + (peak - spec.normal_max) * uniform(rng);
        for (int rank = from; rank < to; ++rank) trace.loads[it][rank][first + i] = factor;
      }
    }
  }
  return trace;
}

Result<LoadTrace> ParseLoadLog(const std::string& text, const std::string& source, int ranks,
                               int micro_batches, double normal_max) {
  LoadTrace trace;
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    const auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    std::replace(line.begin(), line.end(), ',', ' ');
    std::istringstream fields(line);
    std::vector<double> values;
    std::string field;
    while (fields >> field) {
      char* end = nullptr;
      const double v = std::strtod(field.c_str(), &end);
      if (*end || !std::isfinite(v) || v <= 0 || v > 64) {
        return InvalidArgument(source + ":" + std::to_string(line_no) + ": load factor '" + field +
                               "' must be a number in (0, 64]");
      }
      values.push_back(v);
    }
    if (values.empty()) continue;
    if (static_cast<int>(values.size()) != micro_batches) {
      return InvalidArgument(source + ":" + std::to_string(line_no) + ": expected " +
                             std::to_string(micro_batches) + " load factors (one per micro-batch)" +
                             ", got " + std::to_string(values.size()));
    }
    const double worst = *std::max_element(values.begin(), values.end());
    trace.loads.emplace_back(ranks, values);
    trace.spike.push_back(worst >= normal_max ? 1 : 0);
  }
  if (trace.loads.empty()) return InvalidArgument(source + ": no load factors found");
  return trace;
}

Result<LoadTrace> ReadLoadLog(const std::string& path, int ranks, int micro_batches,
                              double normal_max) {
  std::ifstream in(path);
  if (!in) return NotFound("--loads: cannot read '" + path + "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseLoadLog(buffer.str(), path, ranks, micro_batches, normal_max);
}

}  // namespace bgl::sim
