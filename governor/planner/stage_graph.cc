#include "governor/planner/stage_graph.h"

#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <map>
#include <tuple>

#include "base/units.h"

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
  return forward_window_scale * total;
}

double StageGraph::BackwardTime(double r) const {
  double total = 0;
  for (const auto& o : ops) total += o.BackwardTime(r);
  return backward_window_scale * total;
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
    if (!(o.forward_s >= 0) || !(o.backward_s >= 0) || !std::isfinite(o.forward_s) ||
        !std::isfinite(o.backward_s)) {
      return InvalidArgument("operator '" + o.name + "': times must be finite and non-negative");
    }
  }
  // Keep-all bytes at the largest load factor (64) must stay far inside int64_t.
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (__builtin_add_overflow(total, t.bytes, &total) || total > kMaxChunkBytes) {
      return InvalidArgument("tensor '" + t.name + "': the chunk's saved tensors add up to more " +
                             "than 2^56 bytes (64 PiB); check the sizes");
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
    // Absurd shapes saturate here and fail Finalize's sum check instead of overflowing.
    t.bytes = bytes < 0x1p62 ? static_cast<int64_t>(bytes) : int64_t{1} << 62;
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

// One layer of an explicit layer_graph, checked field by field (docs/planner.md).
struct OpSpec {
  std::string name;
  OpKind kind = OpKind::kOther;
  double forward_s = 0, backward_s = 0, flops = 0;
  bool scales_with_load = false;
  bool fp8_allowed = true;
  bool recompute_allowed = true;
};
struct TensorSpec {
  std::string name;
  int64_t bytes = 0;
  DType dtype = DType::kBF16;
  int producer = -1;  // index into the layer's operators
  std::vector<int> consumers, readers;
  bool block_input = false;
  bool scales_with_load = false;
};
struct LayerSpec {
  std::vector<OpSpec> ops;
  std::vector<TensorSpec> tensors;
  int block_input = -1;
  double forward_s = -1;   // the layer's own forward time ("forward_ms"); -1: its operators' sum
  double backward_s = -1;  // its own backward time ("backward_ms"); -1: as its forward scales
};

// The largest tensor the format accepts (1 PiB): large enough for any real activation, small
// enough that a chunk's sums times the largest load factor stay far from int64 overflow.
constexpr int64_t kMaxTensorBytes = int64_t{1} << 50;
constexpr double kMaxOperatorMs = 1e7;  // about three hours
constexpr double kMaxOperatorFlops = 1e24;

std::string FormatNumber(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// Refuses keys of `obj` not in `known`, so a misspelt key never silently keeps a default.
Status RejectUnknownKeys(const nlohmann::json& obj, std::initializer_list<const char*> known,
                         const std::string& field) {
  for (const auto& item : obj.items()) {
    bool found = false;
    for (const char* k : known) found |= item.key() == k;
    if (!found) {
      std::string list;
      for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
      return InvalidArgument(field + ": unknown field '" + item.key() + "' (known: " + list + ")");
    }
  }
  return OkStatus();
}

Status ReadBool(const nlohmann::json& obj, const char* key, bool& out, const std::string& field) {
  if (!obj.contains(key)) return OkStatus();
  if (!obj[key].is_boolean()) {
    return InvalidArgument(field + ": field '" + key + "' must be true or false, got a " +
                           obj[key].type_name());
  }
  out = obj[key].get<bool>();
  return OkStatus();
}

Status ReadMs(const nlohmann::json& obj, const char* key, bool required, double max, double& out,
              const std::string& field) {
  if (!obj.contains(key)) {
    return required ? InvalidArgument(field + ": missing field '" + key + "'") : OkStatus();
  }
  const auto& v = obj[key];
  if (!v.is_number() || !(v.get<double>() >= 0) || v.get<double>() > max) {
    return InvalidArgument(field + ": field '" + key + "' must be a number in [0, " +
                           FormatNumber(max) + "], got " +
                           (v.is_number() ? FormatNumber(v.get<double>()) : v.type_name()));
  }
  out = v.get<double>();
  return OkStatus();
}

// Bytes: a whole number in [0, 2^50] or a size string ("64MiB"); errors say which.
Result<int64_t> ReadTensorBytes(const nlohmann::json& v, const std::string& field) {
  const std::string want = field + " must be a whole number of bytes in [0, 2^50] or a size " +
                           "string such as \"64MiB\", got ";
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kMaxTensorBytes))
      return InvalidArgument(want + std::to_string(u));
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i < 0 || i > kMaxTensorBytes) return InvalidArgument(want + std::to_string(i));
    return i;
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!(d >= 0) || d > static_cast<double>(kMaxTensorBytes) || d != std::floor(d)) {
      return InvalidArgument(want + FormatNumber(d));
    }
    return static_cast<int64_t>(d);
  }
  if (v.is_string()) {
    auto bytes = ParseBytes(v.get<std::string>(), field);
    if (!bytes.ok()) return bytes.status();
    if (*bytes > kMaxTensorBytes) return InvalidArgument(want + v.get<std::string>());
    return *bytes;
  }
  return InvalidArgument(want + "a " + v.type_name());
}

Result<LayerSpec> ParseLayerGraph(const nlohmann::json& doc, const std::string& where) {
  if (!doc.is_object()) return InvalidArgument(where + " must be an object");
  BGL_RETURN_IF_ERROR(RejectUnknownKeys(
      doc, {"operators", "tensors", "forward_ms", "backward_ms", "comment"}, where));
  if (!doc.contains("operators") || !doc["operators"].is_array() || !doc.contains("tensors") ||
      !doc["tensors"].is_array()) {
    return InvalidArgument(where + " must have 'operators' and 'tensors' arrays");
  }
  if (doc["operators"].empty()) {
    return InvalidArgument(where + ".operators: empty; a layer needs at least one operator");
  }
  LayerSpec spec;
  // The layer's own times (nested operators counted once): each must be above 0.
  for (const auto& [key, what, out] :
       {std::tuple<const char*, const char*, double*>{"forward_ms", "forward", &spec.forward_s},
        {"backward_ms", "backward", &spec.backward_s}}) {
    if (!doc.contains(key)) continue;
    double ms = 0;
    BGL_RETURN_IF_ERROR(ReadMs(doc, key, true, kMaxOperatorMs, ms, where));
    if (!(ms > 0)) {
      return InvalidArgument(where + ": field '" + key + "' must be above 0 (the layer's own " +
                             what + " time), got 0");
    }
    *out = ms * 1e-3;
  }
  std::map<std::string, int> op_index;
  for (const auto& od : doc["operators"]) {
    std::string field = where + ".operators[" + std::to_string(spec.ops.size()) + "]";
    if (!od.is_object() || !od.contains("name") || !od["name"].is_string() ||
        od["name"].get<std::string>().empty()) {
      return InvalidArgument(field + ": missing field 'name'");
    }
    OpSpec o;
    o.name = od["name"].get<std::string>();
    field += " ('" + o.name + "')";
    BGL_RETURN_IF_ERROR(
        RejectUnknownKeys(od,
                          {"name", "kind", "forward_ms", "backward_ms", "flops", "scales_with_load",
                           "fp8_allowed", "recompute_allowed", "comment"},
                          field));
    if (!od.contains("kind") || !od["kind"].is_string()) {
      return InvalidArgument(field + ": missing field 'kind'");
    }
    auto kind = ParseOpKind(od["kind"].get<std::string>(), field + ".kind");
    if (!kind.ok()) return kind.status();
    o.kind = *kind;
    double forward_ms = 0, backward_ms = 0;
    BGL_RETURN_IF_ERROR(ReadMs(od, "forward_ms", true, kMaxOperatorMs, forward_ms, field));
    BGL_RETURN_IF_ERROR(ReadMs(od, "backward_ms", true, kMaxOperatorMs, backward_ms, field));
    BGL_RETURN_IF_ERROR(ReadMs(od, "flops", false, kMaxOperatorFlops, o.flops, field));
    o.forward_s = forward_ms * 1e-3;
    o.backward_s = backward_ms * 1e-3;
    BGL_RETURN_IF_ERROR(ReadBool(od, "scales_with_load", o.scales_with_load, field));
    o.fp8_allowed = o.kind != OpKind::kRouter;
    BGL_RETURN_IF_ERROR(ReadBool(od, "fp8_allowed", o.fp8_allowed, field));
    BGL_RETURN_IF_ERROR(ReadBool(od, "recompute_allowed", o.recompute_allowed, field));
    if (op_index.count(o.name)) return InvalidArgument(field + ": duplicate operator");
    op_index[o.name] = static_cast<int>(spec.ops.size());
    spec.ops.push_back(std::move(o));
  }
  std::map<std::string, int> tensor_index;
  for (const auto& td : doc["tensors"]) {
    std::string field = where + ".tensors[" + std::to_string(spec.tensors.size()) + "]";
    if (!td.is_object() || !td.contains("name") || !td["name"].is_string() ||
        td["name"].get<std::string>().empty()) {
      return InvalidArgument(field + ": missing field 'name'");
    }
    TensorSpec t;
    t.name = td["name"].get<std::string>();
    field += " ('" + t.name + "')";
    BGL_RETURN_IF_ERROR(RejectUnknownKeys(td,
                                          {"name", "bytes", "dtype", "producer", "consumers",
                                           "readers", "block_input", "scales_with_load", "comment"},
                                          field));
    if (tensor_index.count(t.name)) return InvalidArgument(field + ": duplicate tensor");
    tensor_index[t.name] = static_cast<int>(spec.tensors.size());
    if (!td.contains("bytes")) return InvalidArgument(field + ": missing field 'bytes'");
    auto bytes = ReadTensorBytes(td["bytes"], field + ": field 'bytes'");
    if (!bytes.ok()) return bytes.status();
    t.bytes = *bytes;
    if (td.contains("dtype")) {
      if (!td["dtype"].is_string())
        return InvalidArgument(field + ": field 'dtype' must be a string");
      auto dtype = ParseDType(td["dtype"].get<std::string>(), field + ".dtype");
      if (!dtype.ok()) return dtype.status();
      t.dtype = *dtype;
    }
    BGL_RETURN_IF_ERROR(ReadBool(td, "block_input", t.block_input, field));
    if (td.contains("producer")) {
      if (!td["producer"].is_string()) {
        return InvalidArgument(field + ": field 'producer' must name an operator of the layer");
      }
      const std::string producer = td["producer"].get<std::string>();
      if (!op_index.count(producer)) {
        return InvalidArgument(field + ": producer '" + producer +
                               "' is not an operator of the layer (unknown operator)");
      }
      if (t.block_input) {
        return InvalidArgument(field + ": the block input comes from the previous layer; it " +
                               "takes no 'producer'");
      }
      t.producer = op_index[producer];
    }
    // The scaling rule (docs/planner.md): a tensor scales when it says so; when it does not,
    // it scales with its producer. The block input scales only when it says so, in every layer.
    t.scales_with_load = t.producer >= 0 && spec.ops[t.producer].scales_with_load;
    BGL_RETURN_IF_ERROR(ReadBool(td, "scales_with_load", t.scales_with_load, field));
    for (auto [key, list] : {std::pair{"consumers", &t.consumers}, {"readers", &t.readers}}) {
      if (!td.contains(key)) continue;
      if (!td[key].is_array()) return InvalidArgument(field + "." + key + " must be a list");
      for (const auto& c : td[key]) {
        if (!c.is_string() || !op_index.count(c.get<std::string>())) {
          const std::string op = c.is_string() ? c.get<std::string>() : c.type_name();
          return InvalidArgument(field + ": " + key + " names '" + op +
                                 "', which is not an operator of the layer (unknown operator)");
        }
        list->push_back(op_index[c.get<std::string>()]);
      }
    }
    if (t.block_input) {
      if (spec.block_input >= 0) {
        return InvalidArgument(where + ": more than one tensor has block_input: true");
      }
      spec.block_input = static_cast<int>(spec.tensors.size());
    }
    spec.tensors.push_back(std::move(t));
  }
  if (spec.block_input < 0) {
    return InvalidArgument(where +
                           ": no tensor has block_input: true (the layer's input, which "
                           "full recompute keeps)");
  }
  return spec;
}

// Replicates the layer over the chunk. Layer l > 0 reads the previous layer's output (produced
// by its last operator, shaped like the block input) where layer 0 reads the block input; the
// copy of the block input in those layers stays as an empty placeholder so every layer has the
// same tensor indices. A tensor with neither producer nor block_input is made outside the layer
// (rotary tables, masks): recompute cannot regenerate it, so it is retained like the block input.
Result<StageGraph> BuildCustomGraph(const ModelConfig& config, const nlohmann::json& doc) {
  const std::string where = "model '" + config.name + "': layer_graph";
  auto parsed = ParseLayerGraph(doc, where);
  if (!parsed.ok()) return parsed.status();
  const LayerSpec& spec = *parsed;
  const TensorSpec& input = spec.tensors[spec.block_input];
  StageGraph g;
  g.layers = static_cast<int>(config.LayersPerChunk());
  if (spec.forward_s > 0) {
    double sum = 0;
    for (const OpSpec& s : spec.ops) sum += s.forward_s;
    if (sum > 0) g.forward_window_scale = g.backward_window_scale = spec.forward_s / sum;
  }
  if (spec.backward_s > 0) {
    double sum = 0;
    for (const OpSpec& s : spec.ops) sum += s.backward_s;
    if (sum > 0) g.backward_window_scale = spec.backward_s / sum;
  }
  int previous_output = -1;
  for (int layer = 0; layer < g.layers; ++layer) {
    const std::string prefix = "L" + std::to_string(layer) + ".";
    const int op_base = static_cast<int>(g.ops.size());
    for (const OpSpec& s : spec.ops) {
      Operator o;
      o.name = prefix + s.name;
      o.kind = s.kind;
      o.layer = layer;
      o.forward_s = s.forward_s;
      o.backward_s = s.backward_s;
      o.flops = s.flops;
      o.scales_with_load = s.scales_with_load;
      o.fp8_allowed = s.fp8_allowed;
      o.recompute_allowed = s.recompute_allowed;
      g.ops.push_back(std::move(o));
    }
    for (size_t i = 0; i < spec.tensors.size(); ++i) {
      const TensorSpec& s = spec.tensors[i];
      const bool replaced = s.block_input && layer > 0;
      SavedTensor t;
      t.name = prefix + s.name;
      t.dtype = s.dtype;
      if (!replaced) {
        t.bytes = s.bytes;
        t.scales_with_load = s.scales_with_load;
        t.producer = s.producer >= 0 ? op_base + s.producer : -1;
        t.block_input = s.block_input || s.producer < 0;
      }
      const int index = replaced ? previous_output : static_cast<int>(g.tensors.size());
      g.tensors.push_back(std::move(t));
      for (int c : s.consumers) {
        g.ops[op_base + c].inputs.push_back(index);
        g.ops[op_base + c].saves.push_back(index);
      }
      for (int c : s.readers) g.ops[op_base + c].inputs.push_back(index);
    }
    SavedTensor out;
    out.name = prefix + "output";
    out.producer = static_cast<int>(g.ops.size()) - 1;
    out.dtype = input.dtype;
    out.bytes = input.bytes;
    out.scales_with_load = input.scales_with_load;
    out.block_input = true;  // the next layer's input
    g.tensors.push_back(std::move(out));
    previous_output = static_cast<int>(g.tensors.size()) - 1;
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
