#include "tools/bglctl/options.h"

#include <charconv>
#include <cmath>

#include "base/units.h"

namespace bgl::ctl {

const char* const kCtlUsage =
    "usage: bglctl [--governor ADDR] [--timeout SECONDS] COMMAND [FLAGS]\n"
    "\n"
    "Talks to bgl-governord. ADDR defaults to $BGL_GOVERNOR, else\n"
    "unix:///run/bagualu/governor.sock.\n"
    "\n"
    "commands:\n"
    "  health [--service NAME]          exit 0 only when the daemon is SERVING (exec probe)\n"
    "  sessions [--json]                list the sessions visible to the caller\n"
    "  snapshot [--session ID] [--out FILE]\n"
    "                                   write the latest allocator snapshots (JSON)\n"
    "  plan (--session ID | --model FILE --capacity BYTES [--gpu N] [--budget-step BYTES])\n"
    "       [--phase warmup|steady|cooldown] [--forward MB] [--chunk N] [--backward MB]\n"
    "       [--backward-chunk N] [--load R] [--bytes-in-use BYTES] [--json]\n"
    "                                   ask for one plan (debugging). The daemon plans only\n"
    "                                   for the process that registered a session, so\n"
    "                                   --model registers a throwaway session of that model\n"
    "                                   file, plans it and ends it; --budget-step sets its\n"
    "                                   plan-cache budget bucket (default 64MiB)\n"
    "\n"
    "exit status: 0 success (healthy), 1 failure (unreachable, unhealthy, refused), 2 usage\n";

namespace {

Result<int32_t> ParseInt(const std::string& flag, const std::string& text) {
  int32_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    return InvalidArgument(flag + ": expected a non-negative integer, got '" + text + "'");
  }
  return value;
}

Result<double> ParseDouble(const std::string& flag, const std::string& text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value) || value < 0) {
    return InvalidArgument(flag + ": expected a non-negative number, got '" + text + "'");
  }
  return value;
}

// Which flags each command takes (beyond the global ones).
bool Accepts(Command command, const std::string& flag) {
  switch (command) {
    case Command::kHealth:
      return flag == "--service";
    case Command::kSessions:
      return flag == "--json";
    case Command::kSnapshot:
      return flag == "--session" || flag == "--out";
    case Command::kPlan:
      return flag == "--session" || flag == "--phase" || flag == "--forward" || flag == "--chunk" ||
             flag == "--backward" || flag == "--backward-chunk" || flag == "--load" ||
             flag == "--bytes-in-use" || flag == "--json" || flag == "--model" ||
             flag == "--capacity" || flag == "--gpu" || flag == "--budget-step";
    case Command::kHelp:
      return false;
  }
  return false;
}

}  // namespace

Result<CtlOptions> ParseCtlOptions(const std::vector<std::string>& args) {
  CtlOptions o;
  bool have_command = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= args.size()) return InvalidArgument(arg + ": missing value");
      return args[++i];
    };
    if (arg == "-h" || arg == "--help" || arg == "help") {
      o.command = Command::kHelp;
      return o;
    }
    if (!arg.starts_with("-")) {
      if (have_command) return InvalidArgument("unexpected argument '" + arg + "'");
      if (arg == "health")
        o.command = Command::kHealth;
      else if (arg == "sessions")
        o.command = Command::kSessions;
      else if (arg == "snapshot")
        o.command = Command::kSnapshot;
      else if (arg == "plan")
        o.command = Command::kPlan;
      else
        return InvalidArgument("unknown command '" + arg + "' (health, sessions, snapshot, plan)");
      have_command = true;
      continue;
    }
    if (arg == "--governor") {
      auto v = value();
      if (!v.ok()) return v.status();
      o.governor = *v;
      continue;
    }
    if (arg == "--timeout") {
      auto v = value();
      if (!v.ok()) return v.status();
      auto d = ParseDouble(arg, *v);
      if (!d.ok()) return d.status();
      if (*d <= 0) return InvalidArgument("--timeout: must be positive");
      o.timeout_s = *d;
      continue;
    }
    if (!have_command || !Accepts(o.command, arg)) {
      return InvalidArgument("unknown flag '" + arg + "'" +
                             (have_command ? " for this command" : " (before the command)"));
    }
    if (arg == "--json") {
      o.json = true;
      continue;
    }
    auto v = value();
    if (!v.ok()) return v.status();
    if (arg == "--service") {
      o.service = *v;
    } else if (arg == "--session") {
      if (v->empty()) return InvalidArgument("--session: empty id");
      o.session_id = *v;
    } else if (arg == "--out") {
      o.out_path = *v;
    } else if (arg == "--phase") {
      if (*v != "warmup" && *v != "steady" && *v != "cooldown" && *v != "unspecified") {
        return InvalidArgument("--phase: expected warmup, steady or cooldown, got '" + *v + "'");
      }
      o.phase = *v;
    } else if (arg == "--load") {
      auto d = ParseDouble(arg, *v);
      if (!d.ok()) return d.status();
      o.load_factor = *d;
    } else if (arg == "--model") {
      o.model_path = *v;
    } else if (arg == "--capacity") {
      auto b = ParseBytes(*v, "--capacity");
      if (!b.ok()) return b.status();
      o.capacity_bytes = *b;
    } else if (arg == "--budget-step") {
      auto b = ParseBytes(*v, "--budget-step");
      if (!b.ok()) return b.status();
      o.budget_step_bytes = *b;
    } else if (arg == "--bytes-in-use") {
      auto b = ParseBytes(*v, "--bytes-in-use");
      if (!b.ok()) return b.status();
      o.bytes_in_use = *b;
    } else {
      auto n = ParseInt(arg, *v);
      if (!n.ok()) return n.status();
      if (arg == "--forward")
        o.forward_micro_batch = *n;
      else if (arg == "--chunk")
        o.forward_chunk = *n;
      else if (arg == "--backward")
        o.backward_micro_batch = *n;
      else
        o.backward_chunk = *n;
    }
  }
  if (!have_command) return InvalidArgument("missing command (health, sessions, snapshot, plan)");
  if (o.command == Command::kPlan) {
    if (o.session_id.empty() == o.model_path.empty()) {
      return InvalidArgument("plan: give either --session ID or --model FILE");
    }
    if (!o.model_path.empty() && o.capacity_bytes <= 0) {
      return InvalidArgument("plan: --model needs --capacity BYTES");
    }
    if (o.model_path.empty() && o.budget_step_bytes != 0) {
      return InvalidArgument(
          "plan: --budget-step applies only to --model (a session keeps its own)");
    }
  }
  return o;
}

}  // namespace bgl::ctl
