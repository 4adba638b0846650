// ModelConfig: the hyperparameters and parallel layout of a fine-grained MoE model, read from a
// JSON or YAML file, from which the planner builds the operator graph of one pipeline stage.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "base/status.h"
#include "governor/planner/json_limits.h"

namespace bgl::plan {

// Element types of saved activations.
enum class DType { kBF16, kFP16, kFP32, kFP8 };
int DTypeBytes(DType dtype);
const char* DTypeName(DType dtype);
Result<DType> ParseDType(const std::string& name, const std::string& field);

// The model, its parallel layout and its training setup.
struct ModelConfig {
  std::string name;
  // Architecture (Table II columns plus what the paper fixes in the text).
  int64_t layers = 0;
  int64_t hidden = 0;
  int64_t moe_hidden = 0;  // per-expert FFN hidden size
  int64_t experts = 0;
  int64_t top_k = 0;
  int64_t heads = 0;  // 0: hidden / head_dim
  int64_t head_dim = 0;
  int64_t shared_experts = 1;
  int64_t shared_expert_hidden = 0;  // 0: moe_hidden
  int64_t seq_len = 4096;
  int64_t micro_batch_size = 1;
  DType dtype = DType::kBF16;
  // Parallelism. vp_layers = layers per virtual pipeline stage (0: plain 1F1B).
  int64_t gpus = 0;
  int64_t dp = 1, tp = 1, ep = 1, pp = 1, vp_layers = 0;
  bool sequence_parallel = true;
  int64_t micro_batches = 0;  // per iteration and pipeline; 0: 4 * pp
  // Memory outside activations, per GPU.
  double param_bytes = 2;                      // BF16 weights
  double grad_bytes = 4;                       // FP32 gradient accumulation
  double optimizer_bytes = 12;                 // FP32 master copy and two Adam moments
  bool distributed_optimizer = true;           // optimizer state sharded over DP
  int64_t workspace_bytes = int64_t{3} << 30;  // cuBLAS/NCCL workspaces, fragmentation slack
  double safety_margin = 0.03;                 // fraction of device memory never planned
  std::string gpu = "h200";                    // hardware profile name
  // Optional explicit layer graph (see docs/planner.md); replaces the generated one.
  std::optional<nlohmann::json> layer_graph;

  // Derived values.
  int64_t LayersPerRank() const { return layers / pp; }
  int64_t Chunks() const { return vp_layers > 0 ? LayersPerRank() / vp_layers : 1; }
  int64_t LayersPerChunk() const { return LayersPerRank() / Chunks(); }
  int64_t Heads() const { return heads > 0 ? heads : hidden / head_dim; }
  int64_t SharedHidden() const {
    return shared_expert_hidden > 0 ? shared_expert_hidden : moe_hidden;
  }
  int64_t MicroBatches() const { return micro_batches > 0 ? micro_batches : 4 * pp; }
  bool Interleaved() const { return Chunks() > 1; }
  // Parameters held by one GPU of a pipeline stage.
  double ParamsPerGpu() const;
  // Bytes of weights, gradients and optimizer state on one GPU.
  double StaticBytesPerGpu() const;

  // Checks every field and the parallel layout; errors name the field.
  Status Validate() const;
};

// Parses a model document (JSON object). `source` names the file in errors. Documents nested
// deeper than `max_depth` are refused before anything copies them (json_limits.h).
Result<ModelConfig> ModelConfigFromJson(const nlohmann::json& doc, const std::string& source,
                                        int max_depth = kDefaultMaxJsonDepth);
// Reads a .json, .yaml or .yml model file; the nesting is checked on the text before parsing.
Result<ModelConfig> LoadModelConfig(const std::string& path, int max_depth = kDefaultMaxJsonDepth);
// A JSON or YAML file (by its extension) as JSON, nesting checked; NotFound when it cannot be
// opened ("<what> '<path>' cannot be opened").
Result<nlohmann::json> LoadJsonOrYaml(const std::string& path, const std::string& what,
                                      int max_depth = kDefaultMaxJsonDepth);
// Converts YAML text to the equivalent JSON document (nesting checked first).
Result<nlohmann::json> YamlToJson(const std::string& text, const std::string& source,
                                  int max_depth = kDefaultMaxJsonDepth);

}  // namespace bgl::plan
