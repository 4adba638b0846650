// bglctl: health probe, session list, snapshot dump and plan requests against bgl-governord.
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "tools/bglctl/commands.h"
#include "tools/bglctl/governor_address.h"
#include "tools/bglctl/options.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  auto options = bgl::ctl::ParseCtlOptions(args);
  if (!options.ok()) {
    std::cerr << "bglctl: " << options.status().message() << "\n\n" << bgl::ctl::kCtlUsage;
    return 2;
  }
  if (options->command == bgl::ctl::Command::kHelp) {
    std::cout << bgl::ctl::kCtlUsage;
    return 0;
  }
  bgl::ctl::CtlContext ctx;
  ctx.address =
      options->governor.empty() ? bgl::tools::DefaultGovernorAddress() : options->governor;
  if (auto st = bgl::tools::CheckGovernorAddress(ctx.address); !st.ok()) {
    std::cerr << "bglctl: " << st.message() << "\n";
    return 2;
  }
  ctx.channel = bgl::tools::OpenGovernorChannel(ctx.address);
  ctx.timeout = std::chrono::milliseconds(static_cast<int64_t>(options->timeout_s * 1000));
  ctx.out = &std::cout;
  ctx.err = &std::cerr;
  switch (options->command) {
    case bgl::ctl::Command::kHealth:
      return bgl::ctl::RunHealth(ctx, *options);
    case bgl::ctl::Command::kSessions:
      return bgl::ctl::RunSessions(ctx, *options);
    case bgl::ctl::Command::kSnapshot:
      return bgl::ctl::RunSnapshot(ctx, *options);
    case bgl::ctl::Command::kPlan:
      return bgl::ctl::RunPlan(ctx, *options);
    case bgl::ctl::Command::kHelp:
      break;
  }
  return 0;
}
