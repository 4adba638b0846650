#include "allocator/detail/fault.h"

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace bgl::alloc::detail {
namespace {

constexpr const char* kNames[kFaultKinds] = {"device", "pinned", "copy"};

struct State {
  std::atomic<bool> enabled{false};
  std::atomic<std::uint64_t> count[kFaultKinds] = {};
  std::atomic<std::uint64_t> fail_at[kFaultKinds] = {};  // 0: none
  std::atomic<bool> fail_after[kFaultKinds] = {};        // fail_at and every later one
  std::atomic<std::uint64_t> stall_at{0};                // the Nth copy stalls; 0: none
  std::atomic<std::uint64_t> fired{0};
  std::atomic<std::int64_t> pinned_live{0};
  std::atomic<std::int64_t> timeout_ms{60000};
  std::atomic<std::int64_t> stall_ms{-1};  // -1: twice the timeout
  std::mutex configure_mu;
  std::mutex stall_mu;
  std::condition_variable stall_cv;
  std::uint64_t stall_generation = 0;  // bumped by release_stalls
  // stall_generation when the stall fired (fault_point, the copy's caller): a release between
  // that and the stream reaching stall() still releases it. Guarded by stall_mu.
  std::uint64_t armed_generation = 0;
};

State& state() {
  static State* s = new State();  // never destroyed: used from threads still running at exit
  return *s;
}

// The first bad variable's message ("" when all are good), set once by read_env.
std::string& environment_error_text() {
  static std::string* text = new std::string();
  return *text;
}

// A positive whole number of milliseconds, or `fallback` when unset or empty; a bad value
// keeps `fallback`, is reported on stderr at once (a preloaded allocator has no caller to tell)
// and becomes the environment error that enforcers refuse to start with.
std::int64_t env_ms(const char* name, std::int64_t fallback, std::string* error) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || ms <= 0 || errno == ERANGE) {
    if (error->empty()) {
      *error = std::string(name) + ": '" + v + "' is not a positive whole number of milliseconds";
    }
    return fallback;
  }
  return ms;
}

bool configure_impl(const std::string& spec, std::string* error);

// BGL_FAULT, BGL_WAIT_TIMEOUT_MS and BGL_FAULT_STALL_MS, read once.
bool read_env() {
  State& s = state();
  std::string error;
  s.timeout_ms.store(env_ms("BGL_WAIT_TIMEOUT_MS", 60000, &error));
  s.stall_ms.store(env_ms("BGL_FAULT_STALL_MS", -1, &error));
  if (const char* spec = std::getenv("BGL_FAULT")) {
    std::string fault_error;
    if (!configure_impl(spec, &fault_error) && error.empty()) {
      error = "BGL_FAULT: " + fault_error;
    }
  }
  if (!error.empty()) {
    std::fprintf(stderr, "bgl_alloc: %s (enforcers refuse to start)\n", error.c_str());
    environment_error_text() = error;
  }
  return true;
}

void ensure_env() {
  static const bool done = read_env();
  (void)done;
}

}  // namespace

const std::string& environment_error() {
  ensure_env();
  return environment_error_text();
}

const char* fault_kind_name(FaultKind kind) { return kNames[static_cast<int>(kind)]; }

FaultAction fault_point(FaultKind kind) {
  ensure_env();
  State& s = state();
  if (!s.enabled.load(std::memory_order_relaxed)) return FaultAction::kNone;
  const int k = static_cast<int>(kind);
  const std::uint64_t n = s.count[k].fetch_add(1) + 1;
  FaultAction action = FaultAction::kNone;
  const std::uint64_t at = s.fail_at[k].load();
  if (at != 0 && (n == at || (n > at && s.fail_after[k].load()))) {
    action = FaultAction::kFail;
  } else if (kind == FaultKind::kCopy && n == s.stall_at.load()) {
    action = FaultAction::kStall;
    std::lock_guard<std::mutex> lock(s.stall_mu);
    s.armed_generation = s.stall_generation;
  }
  if (action != FaultAction::kNone) {
    s.fired.fetch_add(1);
    std::fprintf(stderr, "bgl fault injection: %s %s operation #%llu\n",
                 action == FaultAction::kFail ? "failing" : "stalling", kNames[k],
                 static_cast<unsigned long long>(n));
  }
  return action;
}

bool configure_faults(const std::string& spec, std::string* error) {
  ensure_env();
  return configure_impl(spec, error);
}

namespace {

bool configure_impl(const std::string& spec, std::string* error) {
  State& s = state();
  std::uint64_t fail_at[kFaultKinds] = {};
  bool fail_after[kFaultKinds] = {};
  std::uint64_t stall_at = 0;
  bool enabled = false;
  std::stringstream in(spec);
  std::string part;
  while (std::getline(in, part, ',')) {
    if (part.empty()) continue;
    enabled = true;
    if (part == "count") continue;
    const std::size_t colon = part.find(':');
    const std::string kind = part.substr(0, colon);
    std::uint64_t n = 0;
    bool after = false;
    if (colon != std::string::npos) {
      std::string num = part.substr(colon + 1);
      if (!num.empty() && num.back() == '+') {
        after = true;
        num.pop_back();
      }
      char* end = nullptr;
      n = std::strtoull(num.c_str(), &end, 10);
      if (num.empty() || *end != '\0' || num[0] == '-') n = 0;
    }
    if (n == 0) {
      *error = "fault '" + part + "': expected KIND:N with N >= 1 (KIND device, pinned, copy, " +
               "stall) or 'count'";
      return false;
    }
    if (kind == "stall") {
      if (after) n = 0;
    }
    if (n == 0) {
      *error = "fault '" + part + "': a stall names one copy (stall:N, no '+')";
      return false;
    }
    if (kind == "stall") {
      stall_at = n;
      continue;
    }
    int k = 0;
    while (k < kFaultKinds && kind != kNames[k]) ++k;
    if (k == kFaultKinds) {
      *error = "fault '" + part + "': unknown kind '" + kind +
               "' (device, pinned, copy, stall or 'count')";
      return false;
    }
    fail_at[k] = n;
    fail_after[k] = after;
  }
  std::lock_guard<std::mutex> lock(s.configure_mu);
  s.enabled.store(false);
  for (int k = 0; k < kFaultKinds; ++k) {
    s.count[k].store(0);
    s.fail_at[k].store(fail_at[k]);
    s.fail_after[k].store(fail_after[k]);
  }
  s.stall_at.store(stall_at);
  s.fired.store(0);
  s.enabled.store(enabled);
  release_stalls();
  return true;
}

}  // namespace

std::uint64_t fault_operations(FaultKind kind) {
  return state().count[static_cast<int>(kind)].load();
}

std::uint64_t faults_fired() { return state().fired.load(); }

void count_pinned_blocks(int delta) { state().pinned_live.fetch_add(delta); }

std::int64_t pinned_blocks_live() { return state().pinned_live.load(); }

std::chrono::milliseconds wait_timeout() {
  ensure_env();
  return std::chrono::milliseconds(state().timeout_ms.load(std::memory_order_relaxed));
}

void set_wait_timeout(std::chrono::milliseconds timeout) {
  ensure_env();
  state().timeout_ms.store(timeout.count() > 0 ? timeout.count() : 1);
}

std::chrono::milliseconds stall_duration() {
  ensure_env();
  const std::int64_t ms = state().stall_ms.load();
  return ms > 0 ? std::chrono::milliseconds(ms) : 2 * wait_timeout();
}

void set_stall_duration(std::chrono::milliseconds stall) {
  ensure_env();
  state().stall_ms.store(stall.count() > 0 ? stall.count() : -1);
}

void stall() {
  State& s = state();
  const auto until = std::chrono::steady_clock::now() + stall_duration();
  std::unique_lock<std::mutex> lock(s.stall_mu);
  const std::uint64_t generation = s.armed_generation;
  s.stall_cv.wait_until(lock, until, [&] { return s.stall_generation != generation; });
}

void release_stalls() {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.stall_mu);
    ++s.stall_generation;
  }
  s.stall_cv.notify_all();
}

std::string wait_timeout_message(const char* what) {
  return std::string(what) + " did not complete within " + std::to_string(wait_timeout().count()) +
         " ms (BGL_WAIT_TIMEOUT_MS)";
}

}  // namespace bgl::alloc::detail
