#include "tools/bgl-replay/trace.h"

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
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

// A non-negative integer: a JSON number, or a string ("0x7f00...", "4096"). False otherwise
// (negative, fractional, too large, not a number).
bool parse_u64(const std::string& text, std::uint64_t* out) {
  if (text.empty() || text[0] == '-' || text[0] == '+' ||
      std::isspace(static_cast<unsigned char>(text[0]))) {
    return false;
  }
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 0);
  if (errno != 0 || end == text.c_str() || *end != '\0') return false;
  *out = v;
  return true;
}

bool to_u64(const nlohmann::json& v, std::uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer()) {
    const std::int64_t i = v.get<std::int64_t>();
    if (i < 0) return false;
    *out = static_cast<std::uint64_t>(i);
    return true;
  }
  if (v.is_string()) return parse_u64(v.get<std::string>(), out);
  return false;
}

// A size the pool can be asked for: positive and at most 2^60 bytes.
bool valid_size(std::uint64_t size) { return size > 0 && size <= (std::uint64_t{1} << 60); }

std::string shown(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 40) s = s.substr(0, 40) + "...";
  return s;
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
  // Every event is an object; its action, when present, a string.
  const std::string where =
      j.is_object() ? "device_traces[" + std::to_string(device) + "]" : "trace";
  for (std::size_t i = 0; i < events->size(); ++i) {
    const auto& e = (*events)[i];
    if (!e.is_object()) {
      *error = where + "[" + std::to_string(i) + "]: an event must be an object, got " + shown(e);
      return false;
    }
    if (e.contains("action") && !e["action"].is_string()) {
      *error =
          where + "[" + std::to_string(i) + "].action: must be a string, got " + shown(e["action"]);
      return false;
    }
  }
  // A free completes at free_completed when present, else at free_requested.
  bool has_completed = false;
  for (const auto& e : *events) has_completed |= e.value("action", "") == "free_completed";
  Slots slots(out);
  for (std::size_t i = 0; i < events->size(); ++i) {
    const auto& e = (*events)[i];
    const std::string action = e.value("action", "");
    if (!e.contains("addr") || !e.contains("size")) continue;
    const std::string at = where + "[" + std::to_string(i) + "]";
    std::uint64_t addr = 0, size = 0, stream = 0;
    if (!to_u64(e["addr"], &addr)) {
      *error = at + ".addr: must be a non-negative integer, got " + shown(e["addr"]);
      return false;
    }
    if (!to_u64(e["size"], &size)) {
      *error = at + ".size: must be a non-negative integer, got " + shown(e["size"]);
      return false;
    }
    if (e.contains("stream") && !to_u64(e["stream"], &stream)) {
      *error = at + ".stream: must be a non-negative integer, got " + shown(e["stream"]);
      return false;
    }
    if (action == "alloc" && !valid_size(size)) {
      *error = at + ".size: an allocation must be 1 byte to 2^60 bytes, got " + shown(e["size"]);
      return false;
    }
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
    {
      const std::string& action = f[2];
      const std::string at = "line " + std::to_string(lineno) + ": ";
      std::uint64_t addr = 0, size = 0, stream = 0;
      if (!parse_u64(f[3], &addr)) {
        *error = at + "pointer must be a non-negative integer, got '" + f[3].substr(0, 40) + "'";
        return false;
      }
      if (!parse_u64(f[4], &size)) {
        *error = at + "size must be a non-negative integer, got '" + f[4].substr(0, 40) + "'";
        return false;
      }
      if (f.size() > 5 && !f[5].empty() && !parse_u64(f[5], &stream)) {
        *error = at + "stream must be a non-negative integer, got '" + f[5].substr(0, 40) + "'";
        return false;
      }
      if ((action == "allocate" || action == "alloc") && !valid_size(size)) {
        *error = at + "an allocation must be 1 byte to 2^60 bytes, got " + f[4];
        return false;
      }
      if (action == "allocate" || action == "alloc") {
        slots.alloc(addr, size, stream);
      } else if (action == "free" || action == "deallocate") {
        slots.free(addr, size, stream);
      } else if (action == "allocate failure") {
        ++out->skipped;
      } else {
        *error =
            "line " + std::to_string(lineno) + ": unknown action '" + action.substr(0, 40) + "'";
        return false;
      }
    }
  }
  return true;
}

}  // namespace

bool load_trace(const std::string& path, int device, Trace* out, std::string* error) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    *error = path + ": cannot open (" + std::strerror(errno) + ")";
    return false;
  }
  if (S_ISDIR(st.st_mode)) {
    *error = path + ": is a directory, not a trace file";
    return false;
  }
  std::ifstream in(path);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  char c = 0;
  bool any = false;
  while (in.get(c)) {
    if (!std::isspace(static_cast<unsigned char>(c))) {
      any = true;
      break;
    }
  }
  if (!any) {
    *error = path + ": is empty";
    return false;
  }
  in.unget();
  bool ok = false;
  try {
    ok = (c == '{' || c == '[') ? load_json(in, device, out, error) : load_csv(in, out, error);
  } catch (const std::exception& e) {  // I/O errors and anything the JSON library throws
    *error = e.what();
    ok = false;
  }
  if (!ok) *error = path + ": " + *error;
  return ok;
}

}  // namespace bgl::alloc::replay
