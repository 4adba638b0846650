// LoadTrace: the MoE load factor of every micro-batch on every simulated pipeline rank for every
// iteration, drawn from a seeded distribution matching the paper (II-A) or read from a router log.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace bgl::sim {

// The load distribution. The load factor of a micro-batch is that of the worst GPU of the stage
// (tokens routed to its experts over the balanced count): the worst GPU sets the stage's memory.
struct LoadSpec {
  double spike_prob = 0.029;  // fraction of iterations with a spike (paper: 2.9%)
  double normal_max = 1.2;    // normal iterations stay below this (paper: 97.1% below 1.2x)
  double spike_max = 2.6;     // the largest spike (paper: 2.6x)
  int gpus_per_stage = 64;    // GPUs whose maximum is the stage's load factor
  uint64_t seed = 1;
  bool synchronized = true;  // a spike hits every rank at the same micro-batches (else: each
                             // rank draws its own spike stretch in the same iteration)
};

// loads[iteration][rank][micro_batch], plus which iterations carry a spike.
struct LoadTrace {
  std::vector<std::vector<std::vector<double>>> loads;
  std::vector<char> spike;

  int iterations() const { return static_cast<int>(loads.size()); }
  // The largest load factor of an iteration over ranks and micro-batches.
  double MaxLoad(int iteration) const;
};

// Draws `iterations` iterations for `ranks` ranks of `micro_batches` each. Per GPU, a normal
// micro-batch's load is 1 + |N(0, s)| with s chosen so that the stage maximum stays below
// normal_max; in a spike iteration a few consecutive micro-batches concentrate tokens on one GPU
// with a factor up to spike_max, on every rank (the skew comes from the data); with
// `synchronized` false each rank gets its own stretch and peak.
Result<LoadTrace> GenerateLoads(const LoadSpec& spec, int iterations, int ranks, int micro_batches);

// Parses a router log: one iteration per line, its micro-batches' load factors separated by
// commas or blanks; '#' starts a comment. Every rank sees the same loads. A line with a number of
// values other than `micro_batches`, or a factor outside (0, 64], is an error naming the line.
Result<LoadTrace> ParseLoadLog(const std::string& text, const std::string& source, int ranks,
                               int micro_batches, double normal_max);
Result<LoadTrace> ReadLoadLog(const std::string& path, int ranks, int micro_batches,
                              double normal_max);

}  // namespace bgl::sim
