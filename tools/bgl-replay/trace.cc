#include "tools/bgl-replay/trace.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

namespace bgl::alloc::replay {
namespace {

// Maps trace addresses to slots: an alloc opens a slot, the first free of it closes it.
class Slots {
 public:
  explicit Slots(Trace* t) : t_(t) {}
  void alloc(std::uint64_t addr, std::size_t size, std::uint64_t stream) {
    std::uint32_t slot = t_->slots++;
    open_[addr] = slot;
    t_->ops.push_back(TraceOp{true, size, stream, slot});
  }
  void free(std::uint64_t addr, std::size_t size, std::uint64_t stream) {
    auto it = open_.find(addr);
    if (it == open_.end()) {
      ++t_->skipped;
      return;
    }
    t_->ops.push_back(TraceOp{false, size, stream, it->second});
    open_.erase(it);
  }

 private:
  Trace* t_;
  std::unordered_map<std::uint64_t, std::uint32_t> open_;
};

std::uint64_t to_u64(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer()) return static_cast<std::uint64_t>(v.get<std::int64_t>());
  if (v.is_string()) return std::stoull(v.get<std::string>(), nullptr, 0);
  return 0;
}

bool load_json(std::istream& in, int device, Trace* out, std::string* error) {
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    *error = "not valid JSON";
    return false;
  }
  const nlohmann::json* events = &j;
  if (j.is_object()) {
    if (!j.contains("device_traces") || !j["device_traces"].is_array()) {
      *error = "JSON object without a device_traces list";
      return false;
    }
    if (device < 0 || static_cast<std::size_t>(device) >= j["device_traces"].size()) {
      *error = "device_traces has no device " + std::to_string(device);
      return false;
    }
    events = &j["device_traces"][device];
  }
  if (!events->is_array()) {
    *error = "trace is not a list of events";
    return false;
  }
  // A free completes at free_completed when present, else at free_requested.
  bool has_completed = false;
  for (const auto& e : *events) has_completed |= e.value("action", "") == "free_completed";
  Slots slots(out);
  for (const auto& e : *events) {
    const std::string action = e.value("action", "");
    if (!e.contains("addr") || !e.contains("size")) continue;
    const std::uint64_t addr = to_u64(e["addr"]);
    const std::size_t size = to_u64(e["size"]);
    const std::uint64_t stream = e.contains("stream") ? to_u64(e["stream"]) : 0;
    if (action == "alloc") {
      slots.alloc(addr, size, stream);
    } else if (action == (has_completed ? "free_completed" : "free_requested")) {
      slots.free(addr, size, stream);
    }
  }
  return true;
}

bool load_csv(std::istream& in, Trace* out, std::string* error) {
  Slots slots(out);
  std::string line;
  std::size_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) f.push_back(cell);
    if (lineno == 1 && !f.empty() && (f[0] == "Thread" || f[0] == "thread")) continue;
    if (f.size() < 5) {
      *error =
          "line " + std::to_string(lineno) + ": expected thread,time,action,pointer,size,stream";
      return false;
    }
    try {
      const std::string& action = f[2];
      const std::uint64_t addr = std::stoull(f[3], nullptr, 0);
      const std::size_t size = std::stoull(f[4], nullptr, 0);
      const std::uint64_t stream =
          f.size() > 5 && !f[5].empty() ? std::stoull(f[5], nullptr, 0) : 0;
      if (action == "allocate" || action == "alloc") {
        slots.alloc(addr, size, stream);
      } else if (action == "free" || action == "deallocate") {
        slots.free(addr, size, stream);
      } else if (action == "allocate failure") {
        ++out->skipped;
      } else {
        *error = "line " + std::to_string(lineno) + ": unknown action '" + action + "'";
        return false;
      }
    } catch (const std::exception&) {
      *error = "line " + std::to_string(lineno) + ": bad number";
      return false;
    }
  }
  return true;
}

}  // namespace

bool load_trace(const std::string& path, int device, Trace* out, std::string* error) {
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  char c = 0;
  while (in.get(c) && std::isspace(static_cast<unsigned char>(c))) {
  }
  in.unget();
  const bool ok =
      (c == '{' || c == '[') ? load_json(in, device, out, error) : load_csv(in, out, error);
  if (!ok) *error = path + ": " + *error;
  return ok;
}

}  // namespace bgl::alloc::replay
