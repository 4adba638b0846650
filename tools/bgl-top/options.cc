#include "tools/bgl-top/options.h"

#include <charconv>
#include <cmath>

namespace bgl::top {

const char* const kTopUsage =
    "usage: bgl-top [--governor ADDR] [--once] [--json] [-d SECONDS] [--sort KEY]\n"
    "               [--reverse] [--ascii] [--width N] [--timeout SECONDS]\n"
    "\n"
    "Live view of bgl-governord: per GPU a bar of memory in use, reserved, the planner's\n"
    "budget and capacity, a history sparkline with load spikes (load factor > 1.2) marked,\n"
    "and one row per training process.\n"
    "\n"
    "  --governor ADDR   daemon address (default $BGL_GOVERNOR, else\n"
    "                    unix:///run/bagualu/governor.sock)\n"
    "  --once            print one frame as plain text and exit\n"
    "  --json            print one frame as JSON and exit\n"
    "  -d, --interval S  refresh interval in seconds (default 1, minimum 0.1)\n"
    "  --sort KEY        memory (default), peak, pid, user, job, rank, ooms, gpu\n"
    "  --reverse         reverse the sort order\n"
    "  --ascii           draw with ASCII only\n"
    "  --width N         columns for --once (default: the terminal's, $COLUMNS, or 120)\n"
    "  --timeout S       how long to wait for the daemon's first frame (default 5)\n"
    "\n"
    "keys: q quit, m memory, e peak, p pid, u user, j job, r rank, o ooms, g gpu, R reverse\n";

namespace {

Result<double> ParseSeconds(const std::string& flag, const std::string& text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || !std::isfinite(value) ||
      value <= 0) {
    return InvalidArgument(flag + ": expected a positive number of seconds, got '" + text + "'");
  }
  return value;
}

}  // namespace

Result<TopOptions> ParseTopOptions(const std::vector<std::string>& args) {
  TopOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    auto value = [&]() -> Result<std::string> {
      if (i + 1 >= args.size()) return InvalidArgument(arg + ": missing value");
      return args[++i];
    };
    if (arg == "-h" || arg == "--help") {
      o.help = true;
    } else if (arg == "--once") {
      o.once = true;
    } else if (arg == "--json") {
      o.json = true;
    } else if (arg == "--reverse") {
      o.reverse = true;
    } else if (arg == "--ascii" || arg == "-U") {
      o.ascii = true;
    } else if (arg == "--governor" || arg == "--sort" || arg == "-d" || arg == "--interval" ||
               arg == "--width" || arg == "--timeout") {
      auto v = value();
      if (!v.ok()) return v.status();
      if (arg == "--governor") {
        o.governor = *v;
      } else if (arg == "--sort") {
        auto key = ParseSortKey(*v);
        if (!key.ok()) return key.status();
        o.sort = *key;
      } else if (arg == "--width") {
        int w = 0;
        const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), w);
        if (ec != std::errc() || end != v->data() + v->size() || w < 40 || w > 1000) {
          return InvalidArgument("--width: expected 40..1000 columns, got '" + *v + "'");
        }
        o.width = w;
      } else {
        auto s = ParseSeconds(arg, *v);
        if (!s.ok()) return s.status();
        if (arg == "--timeout") {
          o.timeout_s = *s;
        } else {
          if (*s < 0.1) return InvalidArgument(arg + ": the minimum interval is 0.1 s");
          o.interval_s = *s;
        }
      }
    } else {
      return InvalidArgument("unknown argument '" + arg + "'");
    }
  }
  return o;
}

}  // namespace bgl::top
