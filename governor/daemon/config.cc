#include "governor/daemon/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>

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
                                                "max_watch_streams_per_uid"};
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
  return config;
}

}  // namespace bgl::gov
