#include "governor/daemon/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "base/units.h"

namespace bgl::gov {
namespace {

Result<int64_t> ParseInt(const std::string& key, const std::string& value, int64_t lo, int64_t hi,
                         int base = 10) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(value.c_str(), &end, base);
  if (value.empty() || end == nullptr || *end != '\0' || errno != 0 || v < lo || v > hi) {
    return InvalidArgument(key + ": expected an integer in [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + "], got '" + value + "'");
  }
  return static_cast<int64_t>(v);
}

// A link's peak in GB/s (`field` names it in errors) as bytes per second.
Result<double> PeakBytesPerS(double gbps, const std::string& field) {
  if (!std::isfinite(gbps) || gbps <= 0 || gbps > 1e4) {
    return InvalidArgument("links: " + field + ": peak must be GB/s in (0, 1e4]");
  }
  return gbps * 1e9;
}

// A GPU index of a link (`field` names it in errors).
Result<int> LinkGpu(const std::string& text, const std::string& field) {
  auto v = ParseInt("links", text, 0, 4095);
  if (!v.ok()) {
    return InvalidArgument("links: " + field + ": expected GPU indices in [0, 4095], got '" + text +
                           "'");
  }
  return static_cast<int>(*v);
}

// `links:` as a YAML list: of GPU lists ([[0,1],[2,3]]) or of maps ({gpus: [0,1], peak_gbps: 25}).
Result<std::vector<NodeLink>> LinksFromYaml(const YAML::Node& list) {
  std::vector<NodeLink> links;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string field = "links[" + std::to_string(i) + "]";
    const YAML::Node& item = list[i];
    NodeLink link;
    YAML::Node gpus = item;
    if (item.IsMap()) {
      for (const auto& kv : item) {
        const std::string k = kv.first.as<std::string>();
        if (k != "gpus" && k != "peak_gbps") {
          return InvalidArgument("links: " + field + ": unknown key '" + k + "' (gpus, peak_gbps)");
        }
      }
      gpus = item["gpus"];
      if (item["peak_gbps"]) {
        double gbps = 0;
        try {
          gbps = item["peak_gbps"].as<double>();
        } catch (const std::exception&) {
          return InvalidArgument("links: " + field + ".peak_gbps: expected a number");
        }
        auto peak = PeakBytesPerS(gbps, field + ".peak_gbps");
        if (!peak.ok()) return peak.status();
        link.peak_bytes_per_s = *peak;
      }
    }
    if (!gpus || !gpus.IsSequence()) {
      return InvalidArgument("links: " + field + ": expected a list of GPU indices");
    }
    for (const auto& g : gpus) {
      if (!g.IsScalar()) return InvalidArgument("links: " + field + ": expected GPU indices");
      auto gpu = LinkGpu(g.as<std::string>(), field);
      if (!gpu.ok()) return gpu.status();
      link.gpus.push_back(*gpu);
    }
    if (link.gpus.empty()) return InvalidArgument("links: " + field + " lists no GPU");
    links.push_back(std::move(link));
  }
  return links;
}

std::string EnvName(const std::string& key) {
  std::string name = "BGL_GOVERNOR_" + key;
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return name;
}

}  // namespace

const std::vector<std::string>& ConfigKeys() {
  static const std::vector<std::string> keys = {"listen",
                                                "tcp_listen",
                                                "socket_mode",
                                                "socket_group",
                                                "admin_group",
                                                "metrics_address",
                                                "metrics_port",
                                                "max_sessions",
                                                "max_sessions_per_uid",
                                                "max_model_json_bytes",
                                                "max_snapshot_json_bytes",
                                                "max_json_depth",
                                                "max_operators_per_layer",
                                                "max_layers_per_chunk",
                                                "plan_timeout_ms",
                                                "reap_interval_ms",
                                                "drain_timeout_ms",
                                                "log_level",
                                                "max_watch_streams",
                                                "max_watch_streams_per_uid",
                                                "host_budget_bytes",
                                                "host_budget_fraction",
                                                "host_floor_bytes",
                                                "node_max_sessions",
                                                "node_gpus",
                                                "links",
                                                "calibration"};
  return keys;
}

Status ApplyConfigValue(const std::string& key, const std::string& value, DaemonConfig& c) {
  auto set_int = [&](auto& field, int64_t lo, int64_t hi, int base = 10) -> Status {
    auto v = ParseInt(key, value, lo, hi, base);
    if (!v.ok()) return v.status();
    field = static_cast<std::remove_reference_t<decltype(field)>>(*v);
    return OkStatus();
  };
  if (key == "listen") {
    if (value.rfind("unix:", 0) != 0) {
      return InvalidArgument("listen: must be a unix:// address, got '" + value +
                             "' (use tcp_listen for TCP)");
    }
    c.listen = value;
  } else if (key == "tcp_listen") {
    c.tcp_listen = value;
  } else if (key == "socket_mode") {
    return set_int(c.socket_mode, 0, 0777, 8);
  } else if (key == "socket_group") {
    c.socket_group = value;
  } else if (key == "admin_group") {
    c.admin_group = value;
  } else if (key == "metrics_address") {
    c.metrics_address = value;
  } else if (key == "metrics_port") {
    return set_int(c.metrics_port, 0, 65535);
  } else if (key == "max_sessions") {
    return set_int(c.limits.max_sessions, 1, 1 << 20);
  } else if (key == "max_sessions_per_uid") {
    return set_int(c.limits.max_sessions_per_uid, 1, 1 << 20);
  } else if (key == "max_model_json_bytes") {
    return set_int(c.limits.max_model_json_bytes, 1024, int64_t{64} << 20);
  } else if (key == "max_snapshot_json_bytes") {
    return set_int(c.limits.max_snapshot_json_bytes, 0, int64_t{24} << 20);
  } else if (key == "max_json_depth") {
    return set_int(c.limits.max_json_depth, 8, 1000);
  } else if (key == "max_operators_per_layer") {
    return set_int(c.limits.max_operators_per_layer, 16, 4096);
  } else if (key == "max_layers_per_chunk") {
    return set_int(c.limits.max_layers_per_chunk, 1, 256);
  } else if (key == "plan_timeout_ms") {
    return set_int(c.limits.plan_timeout_ms, 10, 600000);
  } else if (key == "max_watch_streams") {
    return set_int(c.max_watch_streams, 1, 4096);
  } else if (key == "max_watch_streams_per_uid") {
    return set_int(c.max_watch_streams_per_uid, 1, 4096);
  } else if (key == "reap_interval_ms") {
    return set_int(c.reap_interval_ms, 10, 3600000);
  } else if (key == "drain_timeout_ms") {
    return set_int(c.drain_timeout_ms, 0, 600000);
  } else if (key == "host_budget_bytes" || key == "host_floor_bytes") {
    auto v = ParseBytes(value, key);
    if (!v.ok()) return v.status();
    if (*v > (int64_t{1} << 50)) return InvalidArgument(key + ": out of range (> 2^50)");
    (key == "host_budget_bytes" ? c.host_budget_bytes : c.host_floor_bytes) = *v;
  } else if (key == "host_budget_fraction") {
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || *end != '\0' || !std::isfinite(v) || v <= 0 || v > 1) {
      return InvalidArgument("host_budget_fraction: expected a number in (0, 1], got '" + value +
                             "'");
    }
    c.host_budget_fraction = v;
  } else if (key == "node_max_sessions") {
    return set_int(c.node_max_sessions, 1, 4096);
  } else if (key == "node_gpus") {
    return set_int(c.node_gpus, 0, 4096);
  } else if (key == "links") {
    auto links = ParseLinks(value);
    if (!links.ok()) return links.status();
    c.links = std::move(links).value();
    c.links_set = true;
    c.links_source = "config";
  } else if (key == "calibration") {
    c.calibration = value;
  } else if (key == "log_level") {
    if (value != "debug" && value != "info" && value != "warning" && value != "error") {
      return InvalidArgument("log_level: expected debug, info, warning or error, got '" + value +
                             "'");
    }
    c.log_level = value;
  } else {
    return InvalidArgument("unknown configuration key '" + key + "'");
  }
  return OkStatus();
}

Result<DaemonConfig> LoadDaemonConfig(const std::string& file, const ConfigOverrides& overrides) {
  DaemonConfig config;
  if (!file.empty()) {
    YAML::Node doc;
    try {
      doc = YAML::LoadFile(file);
    } catch (const std::exception& e) {
      return InvalidArgument("config '" + file + "': " + e.what());
    }
    // An empty file (or one of comments only) parses as nothing; taken as is it would reset
    // every setting to its default, which on SIGHUP is almost always a truncated write.
    if (!doc || doc.IsNull()) {
      return InvalidArgument("config '" + file +
                             "': the file is empty (no settings); refusing it, since it would "
                             "reset every setting to its default (omit --config for defaults)");
    }
    if (!doc.IsMap()) return InvalidArgument("config '" + file + "': must be a mapping");
    for (const auto& item : doc) {
      const std::string key = item.first.as<std::string>();
      if (key == "links" && item.second.IsSequence()) {
        auto links = LinksFromYaml(item.second);
        if (!links.ok())
          return InvalidArgument("config '" + file + "': " + links.status().message());
        config.links = std::move(links).value();
        config.links_set = true;
        config.links_source = "config";
        continue;
      }
      if (!item.second.IsScalar()) {
        return InvalidArgument("config '" + file + "': " + key + ": must be a scalar");
      }
      Status s = ApplyConfigValue(key, item.second.as<std::string>(), config);
      if (!s.ok()) return InvalidArgument("config '" + file + "': " + s.message());
    }
  }
  for (const std::string& key : ConfigKeys()) {
    const std::string name = EnvName(key);
    if (const char* v = std::getenv(name.c_str()); v != nullptr) {
      Status s = ApplyConfigValue(key, v, config);
      if (!s.ok()) return InvalidArgument(name + ": " + s.message());
    }
  }
  for (const auto& [key, value] : overrides) {
    Status s = ApplyConfigValue(key, value, config);
    if (!s.ok()) return InvalidArgument("--" + key + ": " + s.message());
  }
  const char* sysfs = std::getenv("BGL_GOVERNOR_SYSFS_ROOT");  // tests only
  BGL_RETURN_IF_ERROR(ResolveNodeDefaults(config, sysfs != nullptr ? sysfs : "/sys"));
  return config;
}

NodeConfig NodeConfigOf(const DaemonConfig& config) {
  NodeConfig node;
  node.host_budget_bytes = config.host_budget_bytes;
  node.host_floor_bytes = config.host_floor_bytes;
  node.max_sessions = config.node_max_sessions;
  node.links = config.links;
  return node;
}

Result<std::vector<NodeLink>> ParseLinks(const std::string& text) {
  std::vector<NodeLink> links;
  if (text.empty() || text == "none") return links;
  std::stringstream groups(text);
  std::string group;
  while (std::getline(groups, group, ';')) {
    const std::string field = "links[" + std::to_string(links.size()) + "]";
    NodeLink link;
    std::string gpus = group;
    if (auto at = group.find('@'); at != std::string::npos) {
      gpus = group.substr(0, at);
      const std::string peak = group.substr(at + 1);
      char* end = nullptr;
      const double gbps = std::strtod(peak.c_str(), &end);
      auto bytes = PeakBytesPerS(peak.empty() || *end != '\0' ? -1 : gbps,
                                 field + " (after '@', got '" + peak + "')");
      if (!bytes.ok()) return bytes.status();
      link.peak_bytes_per_s = *bytes;
    }
    std::stringstream items(gpus);
    std::string item;
    while (std::getline(items, item, ',')) {
      auto gpu = LinkGpu(item, field);
      if (!gpu.ok()) return gpu.status();
      link.gpus.push_back(*gpu);
    }
    if (link.gpus.empty()) return InvalidArgument("links: " + field + " lists no GPU");
    links.push_back(std::move(link));
  }
  return links;
}

namespace {

// MemTotal from /proc/meminfo, in bytes; 0 when unknown.
int64_t MemTotalBytes(const std::string& meminfo) {
  std::ifstream in(meminfo);
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemTotal:") return kb * 1024;
  }
  return 0;
}

std::string ReadTrimmed(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string s;
  std::getline(in, s);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

// NVIDIA GPUs (vendor 0x10de, display class 0x03xxxx) in PCI bus-id order with their NUMA nodes.
std::vector<int> NvidiaNumaNodes(const std::string& sysfs_root) {
  std::vector<std::pair<std::string, int>> found;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::path(sysfs_root) / "bus/pci/devices";
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (ReadTrimmed(entry.path() / "vendor") != "0x10de") continue;
    if (ReadTrimmed(entry.path() / "class").rfind("0x03", 0) != 0) continue;
    const std::string numa = ReadTrimmed(entry.path() / "numa_node");
    found.emplace_back(entry.path().filename().string(),
                       numa.empty() ? -1 : std::atoi(numa.c_str()));
  }
  std::sort(found.begin(), found.end());
  std::vector<int> nodes;
  for (const auto& [bus, numa] : found) nodes.push_back(numa);
  return nodes;
}

}  // namespace

Status ResolveNodeDefaults(DaemonConfig& c, const std::string& sysfs_root,
                           const std::string& meminfo) {
  const std::vector<int> numa = NvidiaNumaNodes(sysfs_root);
  if (c.node_gpus < 0) c.node_gpus = static_cast<int>(numa.size());
  if (c.host_budget_bytes < 0) {
    const int64_t total = MemTotalBytes(meminfo);
    if (total <= 0) {
      return InvalidArgument("host_budget_bytes: MemTotal is unreadable from " + meminfo +
                             "; set host_budget_bytes");
    }
    c.host_budget_bytes = static_cast<int64_t>(static_cast<double>(total) * c.host_budget_fraction);
  }
  if (c.host_floor_bytes < 0) {
    c.host_floor_bytes = std::min<int64_t>(int64_t{256} << 20,
                                           c.host_budget_bytes / std::max(1, c.node_max_sessions));
  }
  if (!c.links_set) {
    // One link per NUMA node the GPUs sit on; GPUs without one are links of their own.
    std::map<int, NodeLink> by_node;
    for (size_t gpu = 0; gpu < numa.size(); ++gpu) {
      if (numa[gpu] >= 0) by_node[numa[gpu]].gpus.push_back(static_cast<int>(gpu));
    }
    c.links.clear();
    for (auto& [node, link] : by_node) c.links.push_back(std::move(link));
    c.links_source = numa.empty()
                         ? "none (no NVIDIA GPU under " + sysfs_root +
                               ": host backend, every GPU index a link of its own)"
                         : "sysfs (NUMA nodes of " + std::to_string(numa.size()) + " NVIDIA GPUs)";
  }
  for (size_t i = 0; i < c.links.size(); ++i) {
    for (int gpu : c.links[i].gpus) {
      if (c.node_gpus > 0 && gpu >= c.node_gpus) {
        return InvalidArgument("links: links[" + std::to_string(i) + "] names GPU " +
                               std::to_string(gpu) + ", which is not on this node (node_gpus " +
                               std::to_string(c.node_gpus) + ")");
      }
    }
  }
  // The arbiter's own checks (budget against the floors, a GPU in two links, peaks) name their
  // fields too.
  auto arbiter = NodeArbiter::Create(NodeConfigOf(c));
  if (!arbiter.ok()) return arbiter.status();
  return OkStatus();
}

}  // namespace bgl::gov
