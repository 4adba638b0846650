// The MoE load-factor distribution the paper measured (II-A): 97.1% of iterations stay below
// 1.2x, 2.9% spike, up to 2.6x. Used by benchmarks, tests and the simulator.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace bgl::plan {

// Parameters of the distribution; the defaults are the paper's.
struct LoadDistribution {
  double spike_probability = 0.029;  // per iteration
  double normal_min = 0.95;
  double normal_max = 1.2;
  double spike_min = 1.2;
  double spike_max = 2.6;
  double spiking_fraction = 0.25;  // micro-batches of a spike iteration that spike
};

// Draws per-micro-batch load factors, iteration by iteration, reproducibly from a seed.
class LoadSampler {
 public:
  explicit LoadSampler(uint64_t seed, LoadDistribution d = {}) : rng_(seed), d_(d) {}

  // Load factors of one iteration's micro-batches; `spike` tells whether it is a spike iteration.
  std::vector<double> Iteration(int micro_batches, bool* spike = nullptr) {
    std::uniform_real_distribution<double> normal(d_.normal_min, d_.normal_max);
    std::uniform_real_distribution<double> spiked(d_.spike_min, d_.spike_max);
    std::bernoulli_distribution is_spike(d_.spike_probability);
    std::bernoulli_distribution member(d_.spiking_fraction);
    const bool spiking = is_spike(rng_);
    std::vector<double> loads(static_cast<size_t>(micro_batches));
    bool any = false;
    for (double& r : loads) {
      const bool up = spiking && member(rng_);
      r = up ? spiked(rng_) : normal(rng_);
      any |= up;
    }
    if (spiking && !any && !loads.empty()) {
      std::uniform_int_distribution<int> pick(0, micro_batches - 1);
      loads[static_cast<size_t>(pick(rng_))] = d_.spike_max;
    }
    if (spike) *spike = spiking;
    return loads;
  }

 private:
  std::mt19937_64 rng_;
  LoadDistribution d_;
};

}  // namespace bgl::plan
