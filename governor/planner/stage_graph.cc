#include "governor/planner/stage_graph.h"

#include <map>

namespace bgl::plan {

namespace {

struct KindName {
  OpKind kind;
  const char* name;
};
constexpr KindName kKindNames[] = {
    {OpKind::kNorm, "norm"},
    {OpKind::kLinear, "linear"},
    {OpKind::kAttention, "attention"},
    {OpKind::kRouter, "router"},
    {OpKind::kDispatch, "dispatch"},
    {OpKind::kCombine, "combine"},
    {OpKind::kExpertLinear, "expert_linear"},
    {OpKind::kExpertActivation, "expert_activation"},
    {OpKind::kSharedLinear, "shared_linear"},
    {OpKind::kSharedActivation, "shared_activation"},
    {OpKind::kComm, "comm"},
    {OpKind::kOther, "other"},
};

}  // namespace

const char* OpKindName(OpKind kind) {
  for (const auto& k : kKindNames) {
    if (k.kind == kind) return k.name;
  }
  return "?";
}

Result<OpKind> ParseOpKind(const std::string& name, const std::string& field) {
  for (const auto& k : kKindNames) {
    if (name == k.name) return k.kind;
  }
  std::string known;
  for (const auto& k : kKindNames) known += std::string(known.empty() ? "" : ", ") + k.name;
  return InvalidArgument(field + ": unknown operator kind '" + name + "' (known: " + known + ")");
}

bool IsCommunication(OpKind kind) {
  return kind == OpKind::kDispatch || kind == OpKind::kCombine || kind == OpKind::kComm;
}

bool IsMoeBlock(OpKind kind) {
  return kind == OpKind::kDispatch || kind == OpKind::kCombine || kind == OpKind::kExpertLinear ||
         kind == OpKind::kExpertActivation || kind == OpKind::kSharedLinear ||
         kind == OpKind::kSharedActivation;
}

double StageGraph::M0(double r) const {
  double total = 0;
  for (const auto& t : tensors) {
    if (t.block_input) total += t.Bytes(r);
  }
  return total;
}

double StageGraph::KeepAllBytes(double r) const {
  double total = 0;
  for (const auto& t : tensors) {
    if (!t.savers.empty() || t.block_input) total += t.Bytes(r);
  }
  return total;
}

double StageGraph::ForwardTime(double r) const {
  double total = 0;
  for (const auto& o : ops) total += o.ForwardTime(r);
  return total;
}

double StageGraph::BackwardTime(double r) const {
  double total = 0;
  for (const auto& o : ops) total += o.BackwardTime(r);
  return total;
}

double StageGraph::ForwardFlops(double r) const {
  double total = 0;
  for (const auto& o : ops) total += o.scales_with_load ? o.flops * r : o.flops;
  return total;
}

int StageGraph::FindOp(const std::string& name) const {
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

Status StageGraph::Finalize() {
  const int n_ops = static_cast<int>(ops.size());
  const int n_tensors = static_cast<int>(tensors.size());
  for (auto& t : tensors) t.savers.clear();
  for (int o = 0; o < n_ops; ++o) {
    for (int t : ops[o].inputs) {
      if (t < 0 || t >= n_tensors) {
        return InvalidArgument("operator '" + ops[o].name + "': input index out of range");
      }
    }
    for (int t : ops[o].saves) {
      if (t < 0 || t >= n_tensors) {
        return InvalidArgument("operator '" + ops[o].name + "': saved tensor index out of range");
      }
      tensors[t].savers.push_back(o);
    }
  }
  for (const auto& t : tensors) {
    if (t.bytes < 0) {
      return InvalidArgument("tensor '" + t.name + "': bytes must be non-negative");
    }
    if (t.producer >= n_ops) {
      return InvalidArgument("tensor '" + t.name + "': producer index out of range");
    }
    for (int s : t.savers) {
      if (t.producer >= 0 && s < t.producer) {
        return InvalidArgument("tensor '" + t.name + "': cyclic consumer list: '" + ops[s].name +
                               "' consumes it but runs before its producer '" +
                               ops[t.producer].name + "'");
      }
    }
  }
  for (const auto& o : ops) {
    if (o.forward_s < 0 || o.backward_s < 0) {
      return InvalidArgument("operator '" + o.name + "': times must be non-negative");
    }
  }
  return OkStatus();
}

namespace {

// Appends operators and tensors for one generated MoE transformer layer.
class LayerBuilder {
 public:
  LayerBuilder(const ModelConfig& c, const HardwareProfile& hw, StageGraph& g)
      : c_(c), hw_(hw), g_(g) {}

  int Tensor(const std::string& name, double bytes, DType dtype, bool scales, bool block_input) {
    SavedTensor t;
    t.name = Prefix() + name;
    t.bytes = static_cast<int64_t>(bytes);
    t.dtype = dtype;
    t.scales_with_load = scales;
    t.block_input = block_input;
    g_.tensors.push_back(std::move(t));
    return static_cast<int>(g_.tensors.size()) - 1;
  }

  // forward_s is computed by the caller; backward_s = factor * forward_s.
  int Op(const std::string& name, OpKind kind, double forward_s, double backward_factor,
         double flops, bool scales, std::vector<int> inputs, std::vector<int> saves,
         std::vector<int> outputs) {
    Operator o;
    o.name = Prefix() + name;
    o.kind = kind;
    o.layer = layer_;
    o.forward_s = forward_s;
    o.backward_s = forward_s * backward_factor;
    o.flops = flops;
    o.scales_with_load = scales;
    o.fp8_allowed = kind != OpKind::kRouter && kind != OpKind::kNorm;
    o.inputs = std::move(inputs);
    o.saves = std::move(saves);
    g_.ops.push_back(std::move(o));
    const int index = static_cast<int>(g_.ops.size()) - 1;
    for (int t : outputs) g_.tensors[t].producer = index;
    return index;
  }

  // Builds layer `layer`; `block_input` is the tensor holding its input. Returns the tensor
  // that carries its output (the next layer's block input).
  int Build(int layer, int block_input) {
    layer_ = layer;
    const double e = DTypeBytes(c_.dtype);
    const double t = static_cast<double>(c_.tp);
    const double h = static_cast<double>(c_.hidden);
    const double tokens = static_cast<double>(c_.seq_len * c_.micro_batch_size);
    const double local = c_.sequence_parallel ? tokens / t : tokens;  // tokens held by this GPU
    const double routed = local * static_cast<double>(c_.top_k);      // expert rows at r = 1
    const double mh = static_cast<double>(c_.moe_hidden);
    const double sh = static_cast<double>(c_.SharedHidden() * c_.shared_experts);
    const double heads = static_cast<double>(c_.Heads());
    const double ep = static_cast<double>(c_.ep);
    auto gemm = [&](double m, double k, double n) {
      return std::pair{2 * m * k * n, (m * k + k * n + m * n) * e};
    };
    auto kernel = [&](std::pair<double, double> fb) { return hw_.KernelTime(fb.first, fb.second); };
    // TP all-gather / reduce-scatter around the attention block (sequence parallel).
    const double tp_comm = c_.tp > 1 ? hw_.AllToAllTime(tokens * h * e, c_.tp) : 0;

    const int ln1 = Tensor("ln1_out", local * h * e, c_.dtype, false, false);
    const int qkv = Tensor("qkv", tokens * 3 * h / t * e, c_.dtype, false, false);
    const int attn = Tensor("attn_out", tokens * h / t * e, c_.dtype, false, false);
    const int lse = Tensor("softmax_lse", tokens * heads / t * 4, DType::kFP32, false, false);
    const int mid = Tensor("attn_residual", local * h * e, c_.dtype, false, false);
    const int moe_in = Tensor("moe_in", local * h * e, c_.dtype, false, false);
    const int probs = Tensor("router_probs", local * static_cast<double>(c_.experts) * 4,
                             DType::kFP32, false, false);
    const int disp = Tensor("dispatched", routed * h * e, c_.dtype, true, false);
    const int fc1 = Tensor("expert_fc1_out", routed * 2 * mh * e, c_.dtype, true, false);
    const int act = Tensor("expert_act_out", routed * mh * e, c_.dtype, true, false);
    const int fc2 = Tensor("expert_fc2_out", routed * h * e, c_.dtype, true, false);
    const int sfc1 =
        sh > 0 ? Tensor("shared_fc1_out", local * 2 * sh * e, c_.dtype, false, false) : -1;
    const int sact = sh > 0 ? Tensor("shared_act_out", local * sh * e, c_.dtype, false, false) : -1;
    const int out = Tensor("output", local * h * e, c_.dtype, false, true);

    const double norm_bytes = 2 * local * h * e;
    Op("attn_norm", OpKind::kNorm, hw_.KernelTime(0, norm_bytes), 2, 0, false, {block_input},
       {block_input}, {ln1});
    auto q = gemm(tokens, h, 3 * h / t);
    Op("qkv_proj", OpKind::kLinear, kernel(q) + tp_comm, 2, q.first, false, {ln1}, {ln1}, {qkv});
    const double attn_flops = 2.0 * tokens * tokens * h / t;  // causal: half of 4 s^2 h
    Op("core_attn", OpKind::kAttention, hw_.KernelTime(attn_flops, tokens * 4 * h / t * e), 2.5,
       attn_flops, false, {qkv}, {qkv, attn, lse}, {attn, lse});
    auto o = gemm(tokens, h / t, h);
    Op("out_proj", OpKind::kLinear, kernel(o) + tp_comm, 2, o.first, false, {attn}, {attn}, {mid});
    Op("moe_norm", OpKind::kNorm, hw_.KernelTime(0, norm_bytes), 2, 0, false, {mid}, {mid},
       {moe_in});
    auto rt = gemm(local, h, static_cast<double>(c_.experts));
    Op("router", OpKind::kRouter, kernel(rt), 2, rt.first, false, {moe_in}, {moe_in, probs},
       {probs});
    if (sh > 0) {
      auto s1 = gemm(local, h, 2 * sh);
      Op("shared_fc1", OpKind::kSharedLinear, kernel(s1), 2, s1.first, false, {moe_in}, {moe_in},
         {sfc1});
      Op("shared_act", OpKind::kSharedActivation, hw_.KernelTime(0, local * 3 * sh * e), 2, 0,
         false, {sfc1}, {sfc1}, {sact});
    }
    const double a2a = hw_.AllToAllTime(routed * h * e, c_.ep);
    Op("dispatch", OpKind::kDispatch, a2a, 1, 0, true, {moe_in, probs}, {}, {disp});
    // Grouped GEMM over the local experts' rows; weights read once per expert.
    const double local_experts = static_cast<double>(c_.experts) / ep;
    auto f1 = gemm(routed, h, 2 * mh);
    f1.second = (routed * h + routed * 2 * mh) * e + local_experts * h * 2 * mh * e;
    Op("expert_fc1", OpKind::kExpertLinear, kernel(f1), 2, f1.first, true, {disp}, {disp}, {fc1});
    Op("expert_act", OpKind::kExpertActivation, hw_.KernelTime(0, routed * 3 * mh * e), 2, 0, true,
       {fc1}, {fc1}, {act});
    auto f2 = gemm(routed, mh, h);
    f2.second = (routed * mh + routed * h) * e + local_experts * h * mh * e;
    Op("expert_fc2", OpKind::kExpertLinear, kernel(f2), 2, f2.first, true, {act}, {act}, {fc2});
    if (sh > 0) {
      auto s2 = gemm(local, sh, h);
      Op("shared_fc2", OpKind::kSharedLinear, kernel(s2), 2, s2.first, false, {sact}, {sact}, {});
    }
    Op("combine", OpKind::kCombine, a2a, 1, 0, true, {fc2, probs}, {fc2}, {out});
    return out;
  }

 private:
  std::string Prefix() const { return "L" + std::to_string(layer_) + "."; }

  const ModelConfig& c_;
  const HardwareProfile& hw_;
  StageGraph& g_;
  int layer_ = 0;
};

Result<StageGraph> BuildCustomGraph(const ModelConfig& config, const nlohmann::json& doc) {
  const std::string where = "model '" + config.name + "': layer_graph";
  if (!doc.is_object() || !doc.contains("operators") || !doc["operators"].is_array() ||
      !doc.contains("tensors") || !doc["tensors"].is_array()) {
    return InvalidArgument(where + " must have 'operators' and 'tensors' arrays");
  }
  StageGraph g;
  g.layers = static_cast<int>(config.LayersPerChunk());
  int output_tensor = -1;
  int block_input_template = -1;
  for (int layer = 0; layer < g.layers; ++layer) {
    const std::string prefix = "L" + std::to_string(layer) + ".";
    std::map<std::string, int> op_index;
    const int op_base = static_cast<int>(g.ops.size());
    const int tensor_base = static_cast<int>(g.tensors.size());
    for (const auto& od : doc["operators"]) {
      const std::string field =
          where + ".operators[" + std::to_string(g.ops.size() - op_base) + "]";
      if (!od.is_object() || !od.contains("name") || !od["name"].is_string()) {
        return InvalidArgument(field + ": missing field 'name'");
      }
      Operator o;
      const std::string name = od["name"].get<std::string>();
      o.name = prefix + name;
      o.layer = layer;
      if (!od.contains("kind") || !od["kind"].is_string()) {
        return InvalidArgument(field + " ('" + name + "'): missing field 'kind'");
      }
      auto kind = ParseOpKind(od["kind"].get<std::string>(), field + ".kind");
      if (!kind.ok()) return kind.status();
      o.kind = *kind;
      for (const char* key : {"forward_ms", "backward_ms"}) {
        if (!od.contains(key) || !od[key].is_number() || od[key].get<double>() < 0) {
          return InvalidArgument(field + " ('" + name + "'): field '" + key +
                                 "' must be a non-negative number");
        }
      }
      o.forward_s = od["forward_ms"].get<double>() * 1e-3;
      o.backward_s = od["backward_ms"].get<double>() * 1e-3;
      o.flops = od.value("flops", 0.0);
      o.scales_with_load = od.value("scales_with_load", false);
      o.fp8_allowed = od.value("fp8_allowed", o.kind != OpKind::kRouter);
      if (op_index.count(name))
        return InvalidArgument(field + ": duplicate operator '" + name + "'");
      op_index[name] = static_cast<int>(g.ops.size());
      g.ops.push_back(std::move(o));
    }
    for (const auto& td : doc["tensors"]) {
      const std::string field =
          where + ".tensors[" + std::to_string(g.tensors.size() - tensor_base) + "]";
      if (!td.is_object() || !td.contains("name") || !td["name"].is_string()) {
        return InvalidArgument(field + ": missing field 'name'");
      }
      SavedTensor t;
      const std::string name = td["name"].get<std::string>();
      t.name = prefix + name;
      if (!td.contains("bytes") || !td["bytes"].is_number_integer()) {
        return InvalidArgument(field + " ('" + name + "'): missing field 'bytes'");
      }
      t.bytes = td["bytes"].get<int64_t>();
      if (t.bytes < 0) {
        return InvalidArgument(field + " ('" + name +
                               "'): field 'bytes' must be non-negative, got " +
                               std::to_string(t.bytes));
      }
      auto dtype = ParseDType(td.value("dtype", std::string("bf16")), field + ".dtype");
      if (!dtype.ok()) return dtype.status();
      t.dtype = *dtype;
      t.scales_with_load = td.value("scales_with_load", false);
      t.block_input = td.value("block_input", false);
      const int index = static_cast<int>(g.tensors.size());
      const std::string producer = td.value("producer", std::string());
      if (!producer.empty()) {
        if (!op_index.count(producer)) {
          return InvalidArgument(field + " ('" + name + "'): producer '" + producer +
                                 "' is not an operator of the layer (unknown operator)");
        }
        t.producer = op_index[producer];
      }
      auto link = [&](const char* key, bool saves) -> Status {
        if (!td.contains(key)) return OkStatus();
        if (!td[key].is_array()) return InvalidArgument(field + "." + key + " must be a list");
        for (const auto& c : td[key]) {
          const std::string op = c.is_string() ? c.get<std::string>() : c.dump();
          if (!op_index.count(op)) {
            return InvalidArgument(field + " ('" + name + "'): " + key + " names '" + op +
                                   "', which is not an operator of the layer (unknown operator)");
          }
          auto& target = g.ops[op_index[op]];
          target.inputs.push_back(index);
          if (saves) target.saves.push_back(index);
        }
        return OkStatus();
      };
      BGL_RETURN_IF_ERROR(link("consumers", true));
      BGL_RETURN_IF_ERROR(link("readers", false));
      if (t.block_input) {
        if (block_input_template >= 0 && layer == 0) {
          return InvalidArgument(where + ": more than one tensor has block_input: true");
        }
        if (layer == 0) block_input_template = index - tensor_base;
        if (output_tensor >= 0) t.producer = g.tensors[output_tensor].producer;
      }
      g.tensors.push_back(std::move(t));
    }
    if (block_input_template < 0) {
      return InvalidArgument(where +
                             ": no tensor has block_input: true (the layer's input, which "
                             "full recompute keeps)");
    }
    // The layer's output: produced by the last operator; becomes the next layer's block input.
    SavedTensor out;
    out.name = prefix + "output";
    out.producer = static_cast<int>(g.ops.size()) - 1;
    out.dtype = g.tensors[tensor_base + block_input_template].dtype;
    out.bytes = g.tensors[tensor_base + block_input_template].bytes;
    g.tensors.push_back(out);
    output_tensor = static_cast<int>(g.tensors.size()) - 1;
    // Tensors of this layer must not be read by later layers' ops before Finalize checks order.
  }
  // Replace each layer's block input (after the first) by the previous layer's output tensor.
  std::vector<int> remap(g.tensors.size());
  for (size_t i = 0; i < remap.size(); ++i) remap[i] = static_cast<int>(i);
  const int per_layer = static_cast<int>(doc["tensors"].size()) + 1;
  for (int layer = 1; layer < g.layers; ++layer) {
    const int bi = layer * per_layer + block_input_template;
    const int prev_out = layer * per_layer - 1;
    remap[bi] = prev_out;
    g.tensors[prev_out].block_input = true;
  }
  for (auto& o : g.ops) {
    for (int& t : o.inputs) t = remap[t];
    for (int& t : o.saves) t = remap[t];
  }
  // Drop the now-unused duplicated block inputs by zeroing them (keeps indices stable).
  for (int layer = 1; layer < g.layers; ++layer) {
    auto& t = g.tensors[layer * per_layer + block_input_template];
    t.bytes = 0;
    t.block_input = false;
    t.producer = -1;
  }
  // The chunk output leaves for the next stage: not retained here.
  g.tensors.back().block_input = false;
  BGL_RETURN_IF_ERROR(g.Finalize());
  return g;
}

}  // namespace

Result<StageGraph> BuildStageGraph(const ModelConfig& config, const HardwareProfile& hw) {
  BGL_RETURN_IF_ERROR(config.Validate());
  BGL_RETURN_IF_ERROR(hw.Validate());
  if (config.layer_graph) {
    auto g = BuildCustomGraph(config, *config.layer_graph);
    if (!g.ok()) return g.status();
    for (auto& op : g->ops) op.backward_s = std::max(op.backward_s, 0.0);
    return g;
  }
  StageGraph g;
  g.layers = static_cast<int>(config.LayersPerChunk());
  LayerBuilder builder(config, hw, g);
  // The chunk input: received from the previous stage (or the embedding), always retained.
  SavedTensor input;
  input.name = "L0.input";
  input.bytes =
      static_cast<int64_t>(static_cast<double>(config.seq_len * config.micro_batch_size) /
                           (config.sequence_parallel ? static_cast<double>(config.tp) : 1.0) *
                           static_cast<double>(config.hidden) * DTypeBytes(config.dtype));
  input.dtype = config.dtype;
  input.block_input = true;
  g.tensors.push_back(input);
  int block_input = 0;
  for (int layer = 0; layer < g.layers; ++layer) block_input = builder.Build(layer, block_input);
  // The last layer's output is sent to the next stage, not retained.
  g.tensors[block_input].block_input = false;
  BGL_RETURN_IF_ERROR(g.Finalize());
  return g;
}

}  // namespace bgl::plan
