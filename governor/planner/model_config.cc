#include "governor/planner/model_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "base/units.h"
#include "base/utf8.h"

namespace bgl::plan {

int DTypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
      return 4;
    case DType::kFP8:
      return 1;
  }
  return 2;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
    case DType::kFP8:
      return "fp8";
  }
  return "?";
}

Result<DType> ParseDType(const std::string& name, const std::string& field) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16") return DType::kFP16;
  if (name == "fp32" || name == "float32") return DType::kFP32;
  if (name == "fp8" || name == "fp8_e4m3") return DType::kFP8;
  return InvalidArgument(field + ": unknown dtype '" + name + "' (bf16, fp16, fp32, fp8)");
}

double ModelConfig::ParamsPerGpu() const {
  const double h = static_cast<double>(hidden);
  const double attention = 4.0 * h * h / static_cast<double>(tp);
  const double local_experts = static_cast<double>(experts) / static_cast<double>(ep);
  const double expert = 3.0 * h * static_cast<double>(moe_hidden);  // gated FC1 (2x) + FC2
  const double shared = 3.0 * h * static_cast<double>(SharedHidden() * shared_experts);
  const double router = h * static_cast<double>(experts);
  const double per_layer = attention + local_experts * expert + shared + router + 2 * h;
  return per_layer * static_cast<double>(LayersPerRank());
}

double ModelConfig::StaticBytesPerGpu() const {
  const double optimizer =
      distributed_optimizer ? optimizer_bytes / static_cast<double>(dp) : optimizer_bytes;
  return ParamsPerGpu() * (param_bytes + grad_bytes + optimizer);
}

Status ModelConfig::Validate() const {
  const std::string where = "model '" + name + "': ";
  auto positive = [&](int64_t v, const char* field) -> Status {
    if (v <= 0) {
      return InvalidArgument(where + "field '" + field + "' must be positive, got " +
                             std::to_string(v));
    }
    return OkStatus();
  };
  BGL_RETURN_IF_ERROR(positive(layers, "layers"));
  BGL_RETURN_IF_ERROR(positive(hidden, "hidden"));
  BGL_RETURN_IF_ERROR(positive(moe_hidden, "moe_hidden"));
  BGL_RETURN_IF_ERROR(positive(experts, "experts"));
  BGL_RETURN_IF_ERROR(positive(top_k, "top_k"));
  BGL_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  BGL_RETURN_IF_ERROR(positive(seq_len, "seq_len"));
  BGL_RETURN_IF_ERROR(positive(micro_batch_size, "micro_batch_size"));
  BGL_RETURN_IF_ERROR(positive(gpus, "gpus"));
  BGL_RETURN_IF_ERROR(positive(dp, "dp"));
  BGL_RETURN_IF_ERROR(positive(tp, "tp"));
  BGL_RETURN_IF_ERROR(positive(ep, "ep"));
  BGL_RETURN_IF_ERROR(positive(pp, "pp"));
  if (heads < 0) return InvalidArgument(where + "field 'heads' must be non-negative");
  if (shared_experts < 0) return InvalidArgument(where + "field 'shared_experts' must be >= 0");
  if (vp_layers < 0) return InvalidArgument(where + "field 'vp' must be non-negative");
  if (micro_batches < 0) return InvalidArgument(where + "field 'micro_batches' must be >= 0");
  if (workspace_bytes < 0) return InvalidArgument(where + "field 'workspace' must be >= 0");
  if (safety_margin < 0 || safety_margin >= 0.5) {
    return InvalidArgument(where + "field 'safety_margin' must be in [0, 0.5)");
  }
  if (top_k > experts) {
    return InvalidArgument(where + "field 'top_k' (" + std::to_string(top_k) +
                           ") exceeds 'experts' (" + std::to_string(experts) + ")");
  }
  if (gpus != dp * tp * pp) {
    return InvalidArgument(where + "impossible parallel degrees: gpus (" + std::to_string(gpus) +
                           ") != dp x tp x pp (" + std::to_string(dp) + " x " + std::to_string(tp) +
                           " x " + std::to_string(pp) + ")");
  }
  if (experts % ep != 0) {
    return InvalidArgument(where + "experts (" + std::to_string(experts) +
                           ") not divisible by ep (" + std::to_string(ep) + ")");
  }
  if ((dp * tp) % ep != 0) {
    return InvalidArgument(where + "ep (" + std::to_string(ep) + ") must divide dp x tp (" +
                           std::to_string(dp * tp) + ")");
  }
  if (layers % pp != 0) {
    return InvalidArgument(where + "layers (" + std::to_string(layers) + ") not divisible by pp (" +
                           std::to_string(pp) + ")");
  }
  if (vp_layers > 0 && LayersPerRank() % vp_layers != 0) {
    return InvalidArgument(where + "layers per rank (" + std::to_string(LayersPerRank()) +
                           ") not divisible by vp (" + std::to_string(vp_layers) + ")");
  }
  if (Heads() <= 0 || Heads() % tp != 0) {
    return InvalidArgument(where + "attention heads (" + std::to_string(Heads()) +
                           ") must be a positive multiple of tp (" + std::to_string(tp) + ")");
  }
  if (seq_len % tp != 0) {
    return InvalidArgument(where + "seq_len must be divisible by tp for sequence parallelism");
  }
  if (Interleaved() && MicroBatches() % pp != 0) {
    return InvalidArgument(where + "interleaved 1F1B needs micro_batches (" +
                           std::to_string(MicroBatches()) + ") divisible by pp (" +
                           std::to_string(pp) + ")");
  }
  return OkStatus();
}

namespace {

// Reads typed fields from a JSON object, remembering which keys were consumed.
// A value as JSON text for an error message (bytes that are no UTF-8 shown as U+FFFD: the
// message must not fail on what it reports).
std::string Shown(const nlohmann::json& v) {
  return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

class FieldReader {
 public:
  FieldReader(const nlohmann::json& doc, std::string source)
      : doc_(doc), source_(std::move(source)) {}

  Status Int(const char* key, int64_t& out, bool required) {
    return Field(key, out, required, "an integer", &nlohmann::json::is_number_integer);
  }
  Status Double(const char* key, double& out) {
    BGL_RETURN_IF_ERROR(Field(key, out, false, "a number", &nlohmann::json::is_number));
    if (out < 0 && doc_.contains(key)) {
      return InvalidArgument(Where(key) + " must be non-negative, got " + Shown(doc_[key]));
    }
    return OkStatus();
  }
  Status Bool(const char* key, bool& out) {
    return Field(key, out, false, "true or false", &nlohmann::json::is_boolean);
  }
  Status String(const char* key, std::string& out, bool required) {
    return Field(key, out, required, "a string", &nlohmann::json::is_string);
  }
  void Allow(const char* key) { used_[key] = true; }
  Status RejectUnknown() const {
    for (const auto& [key, value] : doc_.items()) {
      if (!used_.count(key)) return InvalidArgument(source_ + ": unknown field '" + key + "'");
    }
    return OkStatus();
  }
  std::string Where(const char* key) const { return source_ + ": field '" + key + "'"; }

 private:
  // Reads `key` into `out` when present (`required`: an error when absent); `is` checks the
  // value's JSON type, `want` names that type in the error.
  template <typename T, typename Is>
  Status Field(const char* key, T& out, bool required, const char* want, Is is) {
    used_[key] = true;
    if (!doc_.contains(key)) return required ? Missing(key) : OkStatus();
    const auto& v = doc_[key];
    if (!(v.*is)()) return Wrong(key, want, v);
    out = v.template get<T>();
    return OkStatus();
  }
  Status Missing(const char* key) const {
    return InvalidArgument(source_ + ": missing field '" + key + "'");
  }
  Status Wrong(const char* key, const char* want, const nlohmann::json& v) const {
    return InvalidArgument(Where(key) + " must be " + want + ", got " + Shown(v));
  }

  const nlohmann::json& doc_;
  std::string source_;
  std::map<std::string, bool> used_;
};

}  // namespace

Result<ModelConfig> ModelConfigFromJson(const nlohmann::json& doc, const std::string& source,
                                        int max_depth) {
  if (!doc.is_object()) return InvalidArgument(source + ": model description must be an object");
  BGL_RETURN_IF_ERROR(CheckJsonDepth(doc, max_depth, source));
  ModelConfig c;
  FieldReader r(doc, source);
  BGL_RETURN_IF_ERROR(r.String("name", c.name, /*required=*/true));
  BGL_RETURN_IF_ERROR(r.Int("layers", c.layers, true));
  BGL_RETURN_IF_ERROR(r.Int("hidden", c.hidden, true));
  BGL_RETURN_IF_ERROR(r.Int("moe_hidden", c.moe_hidden, true));
  BGL_RETURN_IF_ERROR(r.Int("experts", c.experts, true));
  BGL_RETURN_IF_ERROR(r.Int("top_k", c.top_k, true));
  BGL_RETURN_IF_ERROR(r.Int("head_dim", c.head_dim, true));
  BGL_RETURN_IF_ERROR(r.Int("heads", c.heads, false));
  BGL_RETURN_IF_ERROR(r.Int("shared_experts", c.shared_experts, false));
  BGL_RETURN_IF_ERROR(r.Int("shared_expert_hidden", c.shared_expert_hidden, false));
  BGL_RETURN_IF_ERROR(r.Int("seq_len", c.seq_len, false));
  BGL_RETURN_IF_ERROR(r.Int("micro_batch_size", c.micro_batch_size, false));
  BGL_RETURN_IF_ERROR(r.Int("gpus", c.gpus, true));
  BGL_RETURN_IF_ERROR(r.Int("dp", c.dp, true));
  BGL_RETURN_IF_ERROR(r.Int("tp", c.tp, true));
  BGL_RETURN_IF_ERROR(r.Int("ep", c.ep, true));
  BGL_RETURN_IF_ERROR(r.Int("pp", c.pp, true));
  BGL_RETURN_IF_ERROR(r.Int("vp", c.vp_layers, false));
  BGL_RETURN_IF_ERROR(r.Int("micro_batches", c.micro_batches, false));
  BGL_RETURN_IF_ERROR(r.Bool("sequence_parallel", c.sequence_parallel));
  BGL_RETURN_IF_ERROR(r.Bool("distributed_optimizer", c.distributed_optimizer));
  BGL_RETURN_IF_ERROR(r.Double("param_bytes", c.param_bytes));
  BGL_RETURN_IF_ERROR(r.Double("grad_bytes", c.grad_bytes));
  BGL_RETURN_IF_ERROR(r.Double("optimizer_bytes", c.optimizer_bytes));
  BGL_RETURN_IF_ERROR(r.Double("safety_margin", c.safety_margin));
  BGL_RETURN_IF_ERROR(r.String("gpu", c.gpu, false));
  std::string dtype = "bf16";
  BGL_RETURN_IF_ERROR(r.String("dtype", dtype, false));
  auto parsed = ParseDType(dtype, source + ": field 'dtype'");
  if (!parsed.ok()) return parsed.status();
  c.dtype = *parsed;
  r.Allow("workspace");
  if (doc.contains("workspace")) {
    const auto& w = doc["workspace"];
    if (w.is_number_integer())
      c.workspace_bytes = w.get<int64_t>();
    else if (w.is_string()) {
      auto bytes = ParseBytes(w.get<std::string>(), source + ": field 'workspace'");
      if (!bytes.ok()) return bytes.status();
      c.workspace_bytes = *bytes;
    } else {
      return InvalidArgument(r.Where("workspace") + " must be bytes or a size string");
    }
  }
  r.Allow("layer_graph");
  if (doc.contains("layer_graph")) c.layer_graph = doc["layer_graph"];
  r.Allow("description");
  r.Allow("source");
  BGL_RETURN_IF_ERROR(r.RejectUnknown());
  BGL_RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<nlohmann::json> YamlToJson(const std::string& text, const std::string& source,
                                  int max_depth) {
  if (const auto bad = FirstInvalidUtf8(text)) {  // YAML is Unicode text; JSON output needs it
    const auto line = 1 + std::count(text.begin(), text.begin() + *bad, '\n');
    char byte[8];
    std::snprintf(byte, sizeof byte, "0x%02X", static_cast<unsigned char>(text[*bad]));
    return InvalidArgument(source + ": not valid UTF-8 at line " + std::to_string(line) +
                           " (byte " + byte + " at offset " + std::to_string(*bad) + ")");
  }
  BGL_RETURN_IF_ERROR(CheckYamlNesting(text, max_depth, source));
  // An alias names its anchor's node again however large it is, so a few hundred bytes of
  // anchors naming anchors stand for 10^9 values ("billion laughs"; the model_yaml_fuzz target
  // found it: seconds and gigabytes per file). The conversion counts what it writes, one per
  // value plus the bytes of keys and scalars, and refuses a document past a budget no model file
  // comes near: twice the text's length (all a document without aliases can write) plus 1 M.
  const std::size_t budget = 2 * text.size() + 1'000'000;
  std::size_t written = 0;
  std::function<nlohmann::json(const YAML::Node&)> convert = [&](const YAML::Node& node) {
    nlohmann::json out;
    if (++written > budget) return out;
    switch (node.Type()) {
      case YAML::NodeType::Map:
        out = nlohmann::json::object();
        for (const auto& kv : node) {
          if (written > budget) break;
          std::string key = kv.first.as<std::string>();
          written += key.size();
          out[std::move(key)] = convert(kv.second);
        }
        break;
      case YAML::NodeType::Sequence:
        out = nlohmann::json::array();
        for (const auto& item : node) {
          if (written > budget) break;
          out.push_back(convert(item));
        }
        break;
      case YAML::NodeType::Scalar: {
        const std::string s = node.Scalar();
        written += s.size();
        if (node.Tag() == "!") {  // quoted: always a string
          out = s;
          break;
        }
        if (s == "true" || s == "false") {
          out = (s == "true");
          break;
        }
        char* end = nullptr;
        const long long i = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && end && *end == '\0') {
          out = static_cast<int64_t>(i);
          break;
        }
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end && *end == '\0') {
          out = d;
          break;
        }
        out = s;
        break;
      }
      default:
        out = nullptr;
    }
    return out;
  };
  try {
    nlohmann::json doc = convert(YAML::Load(text));
    if (written > budget) {
      return InvalidArgument(source + ": expands to more than " + std::to_string(budget) +
                             " values and bytes (YAML aliases repeat what their anchor names); "
                             "a model file is far smaller");
    }
    return doc;
  } catch (const YAML::Exception& e) {
    return InvalidArgument(source + ": not valid YAML: " + e.what());
  }
}

Result<nlohmann::json> LoadJsonOrYaml(const std::string& path, const std::string& what,
                                      int max_depth) {
  std::ifstream in(path);
  if (!in) return NotFound(what + " '" + path + "' cannot be opened");
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  nlohmann::json doc;
  if (yaml) {
    auto converted = YamlToJson(text, path, max_depth);
    if (!converted.ok()) return converted.status();
    doc = std::move(converted).value();
  } else {
    BGL_RETURN_IF_ERROR(CheckJsonNesting(text, max_depth, path));
    doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded()) return InvalidArgument(path + ": not valid JSON");
  }
  return doc;
}

Result<ModelConfig> LoadModelConfig(const std::string& path, int max_depth) {
  auto doc = LoadJsonOrYaml(path, "model file", max_depth);
  if (!doc.ok()) return doc.status();
  return ModelConfigFromJson(*doc, path, max_depth);
}

}  // namespace bgl::plan
