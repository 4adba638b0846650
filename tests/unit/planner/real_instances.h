// Real-sized instances for the planner against the exact reference (issue 23): chunks of 1 to 4
// layers of 12 to 32 operators shaped like MoE blocks at GPU magnitudes (norms, TP collectives,
// q/k/v or MLA projections, attention saving its output and log-sum-exp, an FP32 router, top-k,
// dispatch, expert linears sharing the dispatched tokens, activation, combine, shared experts,
// residuals), and the layer graphs captured from the Hugging Face models (data/hf-*.json)
// rescaled to GPU bytes and times. Budgets at M0, near M0, keep-all minus an exact subset of the
// tensors, near keep-all, and uniform between. Plain values; build them on any thread.
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "governor/planner/model_config.h"
#include "governor/planner/stage_graph.h"

namespace bgl::plan::testing {

struct RealInstance {
  std::string set;    // "moe-block" or the captured model
  std::string label;  // the set, the shape and the budget family
  StageGraph graph;
  double r = 1;
  double budget = 0;
};

// One MoE layer graph drawn from `rng` (the same draw for every layer of a chunk, times and
// sizes optionally jittered per layer), then replicated.
class MoeBlockBuilder {
 public:
  MoeBlockBuilder(std::mt19937& rng, const HardwareProfile& hw) : rng_(rng), hw_(hw) {}

  StageGraph Build(int layers, std::string& shape) {
    std::bernoulli_distribution half(0.5);
    const double tokens = std::uniform_int_distribution<int>(1, 4)(rng_) * 2048.0;
    const double h = std::uniform_int_distribution<int>(2, 7)(rng_) * 1024.0;
    tp_ = std::uniform_int_distribution<int>(0, 2)(rng_);  // 1, 2 or 4
    const double tp = static_cast<double>(1 << tp_);
    mla_ = half(rng_);
    shared_ = half(rng_);
    minimal_ = !mla_ && !shared_ && tp_ == 0 && half(rng_);
    rope_ = !minimal_ && half(rng_);
    uneven_ = half(rng_);
    if (production_) {  // after the draws, so the default instances stay the same
      mla_ = shared_ = rope_ = true;
      minimal_ = false;
      tp_ = std::max(tp_, 1);
    }
    const double k = std::uniform_int_distribution<int>(2, 8)(rng_);
    const double mh = std::uniform_int_distribution<int>(1, 4)(rng_) * 512.0;
    const double local = tokens / tp;  // sequence parallel
    shape = std::to_string(layers) + "x" + (mla_ ? "mla" : "mha") + (shared_ ? "+shared" : "") +
            (minimal_ ? "-minimal" : "") + " tp" + std::to_string(1 << tp_) +
            (uneven_ ? " uneven" : "");
    g_ = StageGraph();
    g_.layers = layers;
    int x = Tensor("input", local * h * 2, DType::kBF16, -1);
    g_.tensors[x].block_input = true;
    for (int l = 0; l < layers; ++l) {
      layer_ = l;
      jitter_ = uneven_ ? std::uniform_real_distribution<double>(0.5, 2.0)(rng_) : 1.0;
      x = Layer(x, tokens, local, h, tp, k, mh, l == layers - 1);
    }
    (void)g_.Finalize();
    return std::move(g_);
  }

  int ops_per_layer() const { return ops_per_layer_; }
  // The production block of issue 23 (32 operators per layer): MLA, RoPE, shared experts and TP
  // (the draws above decide only sizes), with attention and MoE dropout, the router's auxiliary
  // loss and the shared experts' own TP gather and reduce-scatter.
  void set_production(bool on) { production_ = on; }

 private:
  int Tensor(const std::string& name, double bytes, DType dtype, int producer,
             bool scales = false) {
    SavedTensor t;
    t.name = "L" + std::to_string(layer_) + "." + name;
    t.bytes = static_cast<int64_t>(bytes * (uneven_ ? jitter_ : 1.0));
    t.dtype = dtype;
    t.producer = producer;
    t.scales_with_load = scales;
    g_.tensors.push_back(t);
    return static_cast<int>(g_.tensors.size()) - 1;
  }
  // An operator of `seconds` (jittered) reading `in` and saving `saves`; returns its index.
  int Op(const std::string& name, OpKind kind, double seconds, std::vector<int> in,
         std::vector<int> saves, bool scales = false) {
    Operator o;
    o.name = "L" + std::to_string(layer_) + "." + name;
    o.kind = kind;
    o.layer = layer_;
    const double noise = std::uniform_real_distribution<double>(0.8, 1.25)(rng_);
    o.forward_s = std::max(hw_.kernel_launch_s, seconds * noise * jitter_);
    o.backward_s = (IsCommunication(kind) ? 1.0 : 2.0) * o.forward_s;
    o.scales_with_load = scales;
    o.fp8_allowed = kind != OpKind::kRouter && kind != OpKind::kNorm;
    o.inputs = std::move(in);
    o.saves = std::move(saves);
    g_.ops.push_back(std::move(o));
    return static_cast<int>(g_.ops.size()) - 1;
  }
  double Gemm(double m, double k, double n) const {
    return hw_.KernelTime(2 * m * k * n, (m * k + k * n + m * n) * 2);
  }
  double Elementwise(double bytes) const { return hw_.KernelTime(0, bytes); }
  double Collective(double bytes) const { return bytes / (400e9); }
  int Next() const { return static_cast<int>(g_.ops.size()); }

  int Layer(int x, double tokens, double local, double h, double tp, double k, double mh,
            bool last) {
    const int first = Next();
    const double e = 2;  // BF16
    int n1 = Tensor("norm1", local * h * e, DType::kBF16, Next());
    Op("attn_norm", OpKind::kNorm, Elementwise(2 * local * h * e), {x}, {x});
    int full = n1;
    if (tp_ > 0) {
      full = Tensor("norm1_gathered", tokens * h * e, DType::kBF16, Next());
      Op("tp_all_gather", OpKind::kComm, Collective(tokens * h * e), {n1}, {});
    }
    int q, kk, v;
    if (mla_) {
      const double qr = h / 2, kvr = h / 8;
      int qa = Tensor("q_a", tokens * qr * e, DType::kBF16, Next());
      Op("q_a_proj", OpKind::kLinear, Gemm(tokens, h, qr), {full}, {full});
      int qan = Tensor("q_a_norm", tokens * qr * e, DType::kBF16, Next());
      Op("q_a_norm", OpKind::kNorm, Elementwise(2 * tokens * qr * e), {qa}, {qa});
      q = Tensor("q", tokens * h / tp * e * 1.5, DType::kBF16, Next());
      Op("q_b_proj", OpKind::kLinear, Gemm(tokens, qr, 1.5 * h / tp), {qan}, {qan});
      int kva = Tensor("kv_a", tokens * kvr * e, DType::kBF16, Next());
      Op("kv_a_proj", OpKind::kLinear, Gemm(tokens, h, kvr), {full}, {full});
      int kvan = Tensor("kv_a_norm", tokens * kvr * e, DType::kBF16, Next());
      Op("kv_a_norm", OpKind::kNorm, Elementwise(2 * tokens * kvr * e), {kva}, {kva});
      kk = Tensor("kv", tokens * 2 * h / tp * e, DType::kBF16, Next());
      Op("kv_b_proj", OpKind::kLinear, Gemm(tokens, kvr, 2 * h / tp), {kvan}, {kvan});
      v = kk;
    } else if (minimal_) {
      q = Tensor("qkv", tokens * 3 * h / tp * e, DType::kBF16, Next());
      Op("qkv_proj", OpKind::kLinear, Gemm(tokens, h, 3 * h / tp), {full}, {full});
      kk = v = q;
    } else {
      q = Tensor("q", tokens * h / tp * e, DType::kBF16, Next());
      Op("q_proj", OpKind::kLinear, Gemm(tokens, h, h / tp), {full}, {full});
      kk = Tensor("k", tokens * h / tp / 4 * e, DType::kBF16, Next());
      Op("k_proj", OpKind::kLinear, Gemm(tokens, h, h / tp / 4), {full}, {full});
      v = Tensor("v", tokens * h / tp / 4 * e, DType::kBF16, Next());
      Op("v_proj", OpKind::kLinear, Gemm(tokens, h, h / tp / 4), {full}, {full});
    }
    if (rope_) {
      int qr = Tensor("q_rope", tokens * h / tp * e, DType::kBF16, Next());
      int kr = Tensor("k_rope", tokens * h / tp / 4 * e, DType::kBF16, Next());
      g_.tensors[kr].producer = Next();
      Op("rope", OpKind::kOther, Elementwise(4 * tokens * h / tp * e), {q, kk}, {});
      q = qr;
      kk = kr;
    }
    std::vector<int> attn_in = {q};
    if (kk != q) attn_in.push_back(kk);
    if (v != kk) attn_in.push_back(v);
    int attn = Tensor("attn_out", tokens * h / tp * e, DType::kBF16, Next());
    int lse = Tensor("lse", tokens * 32 / tp * 4, DType::kFP32, Next());
    std::vector<int> attn_saves = attn_in;
    attn_saves.push_back(attn);
    attn_saves.push_back(lse);
    const double attn_flops = 2.0 * tokens * tokens * h / tp;
    Op("core_attn", OpKind::kAttention, hw_.KernelTime(attn_flops, 4 * tokens * h / tp * e),
       attn_in, attn_saves);
    if (production_) {
      int dropped = Tensor("attn_dropout", tokens * h / tp * e, DType::kBF16, Next());
      Op("attn_dropout", OpKind::kOther, Elementwise(3 * tokens * h / tp * e), {attn}, {attn});
      attn = dropped;
    }
    int o = Tensor("o_proj_out", tokens * h * e, DType::kBF16, Next());
    Op("o_proj", OpKind::kLinear, Gemm(tokens, h / tp, h), {attn}, {attn});
    if (tp_ > 0) {
      int rs = Tensor("reduce_scattered", local * h * e, DType::kBF16, Next());
      Op("tp_reduce_scatter", OpKind::kComm, Collective(tokens * h * e), {o}, {});
      o = rs;
    }
    int h1 = Tensor("residual1", local * h * e, DType::kBF16, Next());
    Op("residual_add", OpKind::kOther, Elementwise(3 * local * h * e), {x, o}, {});
    int n2 = Tensor("norm2", local * h * e, DType::kBF16, Next());
    Op("moe_norm", OpKind::kNorm, Elementwise(2 * local * h * e), {h1}, {h1});
    const double experts = 64;
    int logits = Tensor("router_logits", local * experts * 4, DType::kFP32, Next());
    Op("router", OpKind::kRouter, Gemm(local, h, experts), {n2}, {n2});
    int probs = logits;
    if (!minimal_) {
      probs = Tensor("topk_probs", local * k * 4, DType::kFP32, Next());
      Op("topk", OpKind::kRouter, Elementwise(local * experts * 8), {logits}, {logits, probs});
    }
    if (production_) {
      Tensor("aux_loss", 4, DType::kFP32, Next());
      Op("router_aux_loss", OpKind::kRouter, Elementwise(local * experts * 8), {logits},
         {logits, probs});
    }
    const double routed = local * k;
    int disp = Tensor("dispatched", routed * h * e, DType::kBF16, Next(), true);
    Op("dispatch", OpKind::kDispatch, Collective(routed * h * e) * 4, {n2, probs}, {}, true);
    int up, act;
    if (minimal_) {
      up = Tensor("expert_fc1", routed * 2 * mh * e, DType::kBF16, Next(), true);
      Op("expert_fc1", OpKind::kExpertLinear, Gemm(routed, h, 2 * mh), {disp}, {disp}, true);
      act = Tensor("expert_act", routed * mh * e, DType::kBF16, Next(), true);
      Op("expert_act", OpKind::kExpertActivation, Elementwise(3 * routed * mh * e), {up}, {up},
         true);
    } else {
      int gate = Tensor("expert_gate", routed * mh * e, DType::kBF16, Next(), true);
      Op("expert_gate", OpKind::kExpertLinear, Gemm(routed, h, mh), {disp}, {disp}, true);
      up = Tensor("expert_up", routed * mh * e, DType::kBF16, Next(), true);
      Op("expert_up", OpKind::kExpertLinear, Gemm(routed, h, mh), {disp}, {disp}, true);
      act = Tensor("expert_act", routed * mh * e, DType::kBF16, Next(), true);
      Op("expert_act", OpKind::kExpertActivation, Elementwise(3 * routed * mh * e), {gate, up},
         {gate, up}, true);
    }
    int down = Tensor("expert_down", routed * h * e, DType::kBF16, Next(), true);
    Op("expert_down", OpKind::kExpertLinear, Gemm(routed, mh, h), {act}, {act}, true);
    int combined = Tensor("combined", local * h * e, DType::kBF16, Next());
    Op("combine", OpKind::kCombine, Collective(routed * h * e) * 4, {down, probs}, {down, probs},
       true);
    if (production_) {
      int dropped = Tensor("moe_dropout", local * h * e, DType::kBF16, Next());
      Op("moe_dropout", OpKind::kOther, Elementwise(3 * local * h * e), {combined}, {combined});
      combined = dropped;
    }
    std::vector<int> out_in = {h1, combined};
    if (shared_) {
      const double sh = mh * 2;
      int shared_in = n2;
      if (production_) {
        shared_in = Tensor("shared_gathered", tokens * h * e, DType::kBF16, Next());
        Op("shared_tp_all_gather", OpKind::kComm, Collective(tokens * h * e), {n2}, {});
      }
      int sg = Tensor("shared_gate", local * sh * e, DType::kBF16, Next());
      Op("shared_gate", OpKind::kSharedLinear, Gemm(local, h, sh), {shared_in}, {shared_in});
      int su = Tensor("shared_up", local * sh * e, DType::kBF16, Next());
      Op("shared_up", OpKind::kSharedLinear, Gemm(local, h, sh), {shared_in}, {shared_in});
      int sa = Tensor("shared_act", local * sh * e, DType::kBF16, Next());
      Op("shared_act", OpKind::kSharedActivation, Elementwise(3 * local * sh * e), {sg, su},
         {sg, su});
      int sd = Tensor("shared_down", local * h * e, DType::kBF16, Next());
      Op("shared_down", OpKind::kSharedLinear, Gemm(local, sh, h), {sa}, {sa});
      if (production_) {
        int rs = Tensor("shared_scattered", local * h * e, DType::kBF16, Next());
        Op("shared_tp_reduce_scatter", OpKind::kComm, Collective(tokens * h * e), {sd}, {});
        sd = rs;
      }
      out_in.push_back(sd);
    }
    int out = Tensor("output", local * h * e, DType::kBF16, Next());
    g_.tensors[out].block_input = !last;  // the next layer's input; the chunk's output leaves
    Op("residual_add2", OpKind::kOther, Elementwise(3 * local * h * e), out_in, {});
    ops_per_layer_ = Next() - first;
    return out;
  }

  std::mt19937& rng_;
  const HardwareProfile& hw_;
  StageGraph g_;
  int layer_ = 0, tp_ = 0, ops_per_layer_ = 0;
  bool mla_ = false, shared_ = false, minimal_ = false, rope_ = false, uneven_ = false;
  bool production_ = false;
  double jitter_ = 1;
};

// A budget of one of the five families for `g` at load r.
inline double DrawBudget(std::mt19937& rng, const StageGraph& g, double r, int family,
                         std::string& label) {
  const double m0 = g.M0(r), keep = g.KeepAllBytes(r);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  constexpr double kNear[] = {1e-4, 1e-3, 0.01, 0.05};
  const double near = kNear[std::uniform_int_distribution<int>(0, 3)(rng)];
  switch (family) {
    case 0:
      label += " budget=M0";
      return m0;
    case 1:
      label += " budget=near-M0";
      return m0 + near * (keep - m0);
    case 2: {
      label += " budget=keep-all-minus-subset";
      double b = keep;
      for (const SavedTensor& t : g.tensors) {
        if (!t.block_input && !t.savers.empty() && unit(rng) < 0.4) b -= t.Bytes(r);
      }
      return std::max(b, m0);
    }
    case 3:
      label += " budget=near-keep-all";
      return keep - near * (keep - m0);
    default:
      label += " budget=uniform";
      return m0 + unit(rng) * (keep - m0);
  }
}

// A captured layer graph (data/hf-*.json) replicated over `layers`, its bytes scaled so the block
// input is `input_bytes` and its times so that the layer's forward takes `forward_s`.
inline StageGraph RescaledCapture(const std::string& path, int layers, double input_bytes,
                                  double forward_s) {
  auto doc = LoadJsonOrYaml(path, "model");
  if (!doc.ok()) return {};
  (*doc)["layers"] = layers * 4;
  (*doc)["pp"] = 4;
  (*doc)["gpus"] = 4;
  auto config = ModelConfigFromJson(*doc, path);
  if (!config.ok()) return {};
  auto g = BuildStageGraph(*config, *HardwareProfileByName("h200"));
  if (!g.ok()) return {};
  double block = 0, forward = 0;
  for (const SavedTensor& t : g->tensors) {
    if (t.block_input) block = std::max(block, static_cast<double>(t.bytes));
  }
  for (const Operator& o : g->ops) forward += o.layer == 0 ? o.forward_s : 0;
  const double sb = input_bytes / std::max(block, 1.0), st = forward_s / std::max(forward, 1e-12);
  for (SavedTensor& t : g->tensors) t.bytes = static_cast<int64_t>(t.bytes * sb);
  for (Operator& o : g->ops) {
    o.forward_s *= st;
    o.backward_s *= st;
  }
  return std::move(*g);
}

// `count` production blocks (32 operators per layer) of `layers` layers, budgets of every family
// in turn (issue 23's latency bar: 32 operators per layer, 4 layers per chunk).
inline std::vector<RealInstance> ProductionInstances(uint32_t seed, int count, int layers) {
  std::mt19937 rng(seed);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<RealInstance> out;
  constexpr double kLoads[] = {1.0, 1.0, 1.3, 2.6};
  for (int i = 0; i < count; ++i) {
    RealInstance x;
    x.set = "production-block";
    MoeBlockBuilder builder(rng, hw);
    builder.set_production(true);
    std::string shape;
    x.graph = builder.Build(layers, shape);
    x.r = kLoads[std::uniform_int_distribution<int>(0, 3)(rng)];
    x.label = "production #" + std::to_string(i) + " " + shape + " (" +
              std::to_string(builder.ops_per_layer()) + " ops/layer) r=" + std::to_string(x.r);
    x.budget = DrawBudget(rng, x.graph, x.r, i % 5, x.label);
    out.push_back(std::move(x));
  }
  return out;
}

// `count_blocks` random MoE chunks and `per_capture` instances of each captured model.
inline std::vector<RealInstance> RealInstances(const std::string& data_dir, uint32_t seed,
                                               int count_blocks, int per_capture) {
  std::mt19937 rng(seed);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  std::vector<RealInstance> out;
  constexpr double kLoads[] = {1.0, 1.0, 1.3, 2.6};
  for (int i = 0; i < count_blocks; ++i) {
    RealInstance x;
    x.set = "moe-block";
    const int layers = std::uniform_int_distribution<int>(1, 4)(rng);
    MoeBlockBuilder builder(rng, hw);
    std::string shape;
    x.graph = builder.Build(layers, shape);
    x.r = kLoads[std::uniform_int_distribution<int>(0, 3)(rng)];
    x.label = "moe #" + std::to_string(i) + " " + shape + " (" +
              std::to_string(builder.ops_per_layer()) + " ops/layer) r=" + std::to_string(x.r);
    x.budget = DrawBudget(rng, x.graph, x.r, i % 5, x.label);
    out.push_back(std::move(x));
  }
  for (const char* name : {"hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3"}) {
    for (int i = 0; i < per_capture; ++i) {
      RealInstance x;
      x.set = name;
      const int layers = std::uniform_int_distribution<int>(1, 4)(rng);
      // A block input of 16 to 128 MiB; a forward whose D2H window holds 0.1x to 2x the layer's
      // saved bytes (from copy-bound to compute-bound layers).
      const double input = std::uniform_int_distribution<int>(1, 8)(rng) * 16.0 * (1 << 20);
      StageGraph probe = RescaledCapture(data_dir + "/" + name + ".json", 1, input, 1e-3);
      const double saved = probe.KeepAllBytes(1) - probe.M0(1);
      const double window = std::uniform_real_distribution<double>(0.1, 2.0)(rng);
      const double forward = window * saved / hw.offload.peak_bytes_per_s;
      x.graph = RescaledCapture(data_dir + "/" + name + ".json", layers, input, forward);
      x.r = kLoads[std::uniform_int_distribution<int>(0, 3)(rng)];
      x.label = std::string(name) + " #" + std::to_string(i) + " " + std::to_string(layers) +
                " layers window=" + std::to_string(window) + " r=" + std::to_string(x.r);
      x.budget = DrawBudget(rng, x.graph, x.r, i % 5, x.label);
      out.push_back(std::move(x));
    }
  }
  return out;
}

// A downgrade after the gate (issue 43) on an unseen generated MoE chunk of 1-4 layers: the gate
// of a random layer sees a load of 1.3-2.6 where the plan was made at load 1, the budget one of
// the five families at load 1 (at least M0 at the observed load). A plain value.
struct GateInstance {
  StageGraph graph;
  double observed = 1;
  int gate = 0;
  double budget = 0;
  std::string label;
};

inline std::vector<GateInstance> GateInstances(uint32_t seed, int count) {
  std::mt19937 rng(seed);
  const HardwareProfile hw = *HardwareProfileByName("h200");
  constexpr double kObserved[] = {1.3, 1.6, 2.0, 2.6};
  std::vector<GateInstance> out;
  for (int i = 0; i < count; ++i) {
    GateInstance x;
    const int layers = std::uniform_int_distribution<int>(1, 4)(rng);
    MoeBlockBuilder builder(rng, hw);
    std::string shape;
    x.graph = builder.Build(layers, shape);
    x.observed = kObserved[std::uniform_int_distribution<int>(0, 3)(rng)];
    x.gate = std::uniform_int_distribution<int>(0, layers - 1)(rng);
    x.label = "#" + std::to_string(i) + " " + shape + " (" +
              std::to_string(builder.ops_per_layer()) + " ops/layer x " + std::to_string(layers) +
              ") gate " + std::to_string(x.gate) + " at " + std::to_string(x.observed);
    x.budget = std::max(DrawBudget(rng, x.graph, 1.0, i % 5, x.label), x.graph.M0(x.observed));
    out.push_back(std::move(x));
  }
  return out;
}

}  // namespace bgl::plan::testing
