// bglctl sessions: the sessions the caller may see, as a table or JSON.
#include <google/protobuf/util/json_util.h>

#include <chrono>
#include <cstdio>

#include "bagualu/v1/governor.grpc.pb.h"
#include "base/units.h"
#include "tools/bglctl/commands.h"
#include "tools/bglctl/governor_address.h"

namespace bgl::ctl {
namespace {

std::string Age(int64_t created_unix_ms) {
  const int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::system_clock::now().time_since_epoch())
                          .count();
  const int64_t s = std::max<int64_t>(0, (now - created_unix_ms) / 1000);
  char buf[32];
  if (s < 120)
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 7200)
    std::snprintf(buf, sizeof buf, "%lldm", static_cast<long long>(s / 60));
  else
    std::snprintf(buf, sizeof buf, "%lldh", static_cast<long long>(s / 3600));
  return buf;
}

}  // namespace

int RunSessions(const CtlContext& ctx, const CtlOptions& options) {
  auto stub = bagualu::v1::Governor::NewStub(ctx.channel);
  bagualu::v1::ListSessionsResponse response;
  auto call = ctx.NewCall();
  const grpc::Status status = stub->ListSessions(call.get(), {}, &response);
  if (!status.ok()) {
    *ctx.err << "bglctl: " << tools::DescribeRpcFailure(ctx.address, status) << "\n";
    return 1;
  }
  if (options.json) {
    std::string json;
    google::protobuf::util::JsonPrintOptions print;
    print.add_whitespace = true;
    print.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(response, &json, print);
    *ctx.out << json;
    return 0;
  }
  char line[640];
  std::snprintf(line, sizeof line,
                "%-20s %8s %-10s %-16s %4s %5s %-16s %10s %10s %10s %5s %9s %9s\n", "SESSION",
                "PID", "USER", "JOB", "GPU", "RANK", "MODEL", "CAPACITY", "HOST-GRANT", "HOST-USED",
                "AGE", "WARM-KEYS", "WARM-HITS");
  *ctx.out << line;
  for (const auto& s : response.sessions()) {
    // The warm-up (RegisterRequest.warm_up): its plans cached now and the points they served;
    // '-' for a session without it.
    const bool warm = s.has_warm_up();
    const std::string warm_keys = warm ? std::to_string(s.warm_up().keys()) : "-";
    const std::string warm_hits = warm ? std::to_string(s.warm_up().hits()) : "-";
    std::snprintf(line, sizeof line,
                  "%-20s %8d %-10s %-16s %4d %5d %-16s %10s %10s %10s %5s %9s %9s\n",
                  s.session_id().c_str(), s.pid(),
                  (s.user().empty() ? std::to_string(s.uid()) : s.user()).c_str(),
                  s.job_id().c_str(), s.gpu_index(), s.pipeline_rank(), s.model().c_str(),
                  FormatBytes(static_cast<double>(s.capacity_bytes())).c_str(),
                  FormatBytes(static_cast<double>(s.host_grant_bytes())).c_str(),
                  FormatBytes(static_cast<double>(s.host_used_bytes())).c_str(),
                  Age(s.created_unix_ms()).c_str(), warm_keys.c_str(), warm_hits.c_str());
    *ctx.out << line;
  }
  if (response.sessions().empty()) *ctx.out << "(no sessions)\n";
  return 0;
}

}  // namespace bgl::ctl
