// StageGraph: the operators of one model chunk on one pipeline stage, in forward order, and the
// activation tensors they save for backward (paper IV-A). Expert operators scale with the load
// factor r: tokens routed to this GPU's experts over the balanced count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "governor/planner/hardware.h"
#include "governor/planner/model_config.h"

namespace bgl::plan {

// What an operator is; decides which mitigations apply and where stages split.
enum class OpKind {
  kNorm,
  kLinear,
  kAttention,
  kRouter,
  kDispatch,
  kCombine,
  kExpertLinear,
  kExpertActivation,
  kSharedLinear,
  kSharedActivation,
  kComm,
  kOther
};
const char* OpKindName(OpKind kind);
Result<OpKind> ParseOpKind(const std::string& name, const std::string& field);
bool IsCommunication(OpKind kind);
bool IsMoeBlock(OpKind kind);  // runs after the gate: dispatch, experts, combine, shared expert

// One kernel-level operator of the forward pass.
struct Operator {
  std::string name;
  OpKind kind = OpKind::kOther;
  int layer = 0;
  double forward_s = 0;   // at load factor 1
  double backward_s = 0;  // at load factor 1
  double flops = 0;       // forward FLOPs at load 1 (for MFU)
  bool scales_with_load = false;
  bool fp8_allowed = true;  // precision-sensitive operators (the router) never store FP8
  // False where the operator cannot be rerun alone (inside a compiled block, whose graph
  // reruns whole): its tensors are kept, offloaded or stored in FP8 only.
  bool recompute_allowed = true;
  std::vector<int> inputs;  // tensors read in forward (needed to recompute it)
  std::vector<int> saves;   // tensors it saves for backward

  double ForwardTime(double r) const { return scales_with_load ? forward_s * r : forward_s; }
  double BackwardTime(double r) const { return scales_with_load ? backward_s * r : backward_s; }
  bool IsComm() const { return IsCommunication(kind); }
};

// One activation tensor. A tensor saved by several operators is stored once.
struct SavedTensor {
  std::string name;
  int64_t bytes = 0;  // at load factor 1
  DType dtype = DType::kBF16;
  int producer = -1;  // operator index; -1: produced outside this chunk
  std::vector<int> savers;
  bool scales_with_load = false;
  // Always retained on device (counted in M0): a layer's input (the checkpoint), or in an
  // explicit layer graph a tensor made outside the layer, which recompute cannot regenerate.
  bool block_input = false;

  double Bytes(double r) const {
    return scales_with_load ? static_cast<double>(bytes) * r : static_cast<double>(bytes);
  }
};

// The most bytes a chunk's saved tensors may add up to (64 PiB): times the largest load factor
// (64) this stays below 2^62, so no byte count of a plan overflows int64_t.
inline constexpr int64_t kMaxChunkBytes = int64_t{1} << 56;

// The operator graph of one chunk (layers_per_chunk transformer layers).
class StageGraph {
 public:
  std::vector<Operator> ops;
  std::vector<SavedTensor> tensors;
  int layers = 0;
  // The chunk's compute time over the sum of its operators' times, where those overlap: an
  // explicit layer graph's operators may be nested (a module and the modules it calls, each
  // timed whole, as the PyTorch capture times them: what rerunning it costs), so their sum
  // counts the inner ones more than once. ForwardTime (the forward copy window, the issue
  // order's forward chain) is the operators' sum times forward_window_scale, BackwardTime (the
  // backward window, the backward chain) times backward_window_scale; a recompute still costs
  // the rerun operator's own time. The layer graph's "forward_ms" sets both (its operators'
  // backward times stay in proportion to their forward times, twice them as the capture
  // states them); its "backward_ms", the layer's own measured backward, sets the backward one
  // alone. 1: the operators' times add up (generated graphs).
  double forward_window_scale = 1;
  double backward_window_scale = 1;

  // Memory retained under full recompute (block inputs only): the paper's M0.
  double M0(double r) const;
  // Memory with every saved tensor kept on device.
  double KeepAllBytes(double r) const;
  double ForwardTime(double r) const;   // the chunk's forward: forward_window_scale x the ops'
  double BackwardTime(double r) const;  // likewise, backward_window_scale x the operators'
  double ForwardFlops(double r) const;
  int FindOp(const std::string& name) const;

  // Checks indices, the producer-before-consumer order and fills savers from saves.
  Status Finalize();
};

// Builds the chunk graph of a fine-grained MoE transformer (norms, QKV, core attention, output
// projection, router, dispatch/combine all-to-all, expert FC1/activation/FC2, shared expert), or
// the graph given in config.layer_graph, replicated over the chunk's layers.
Result<StageGraph> BuildStageGraph(const ModelConfig& config, const HardwareProfile& hw);

}  // namespace bgl::plan
