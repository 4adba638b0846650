#include "governor/planner/cost_model.h"

#include <map>
#include <utility>

namespace bgl::plan {

IterationCurve BuildIterationCurve(const std::vector<Step>& steps,
                                   const std::function<UnitCost(const Step&)>& cost) {
  IterationCurve curve;
  std::map<std::pair<int, int>, double> live;
  double bytes = 0, time = 0;
  curve.points.push_back({0, 0, -1});
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    const UnitCost c = cost(s);
    if (s.forward) {
      live[{s.micro_batch, s.chunk}] = c.retained_bytes;
      bytes += c.retained_bytes;
      time += c.forward_s;
    } else {
      auto it = live.find({s.micro_batch, s.chunk});
      if (it != live.end()) {
        bytes -= it->second;
        live.erase(it);
      }
      time += c.backward_s;
    }
    curve.points.push_back({time, bytes, static_cast<int>(i)});
    if (bytes > curve.peak_bytes) {
      curve.peak_bytes = bytes;
      curve.peak_step = static_cast<int>(i);
    }
  }
  curve.time_s = time;
  return curve;
}

}  // namespace bgl::plan
