// bglctl snapshot: the allocator snapshots workers reported (PyTorch memory-snapshot JSON).
// With --session the session's document is written unchanged, so it can be loaded by tools
// that read PyTorch snapshots; otherwise every visible one is wrapped in
// {"snapshots": [{"session_id", "reported_unix_ms", "snapshot"}]}.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "bagualu/v1/governor.grpc.pb.h"
#include "tools/bglctl/commands.h"
#include "tools/bglctl/governor_address.h"

namespace bgl::ctl {
namespace {

// Writes `text` to `path` through a temporary file, so a reader never sees half a document.
bool WriteFile(const std::string& path, const std::string& text, std::ostream& err) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream file(tmp, std::ios::binary | std::ios::trunc);
    file << text;
    if (!file.good()) {
      err << "bglctl: cannot write " << tmp << "\n";
      return false;
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err << "bglctl: cannot rename " << tmp << " to " << path << "\n";
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace

int RunSnapshot(const CtlContext& ctx, const CtlOptions& options) {
  auto stub = bagualu::v1::Governor::NewStub(ctx.channel);
  bagualu::v1::SnapshotRequest request;
  request.set_session_id(options.session_id);
  bagualu::v1::SnapshotResponse response;
  auto call = ctx.NewCall();
  const grpc::Status status = stub->Snapshot(call.get(), request, &response);
  if (!status.ok()) {
    *ctx.err << "bglctl: " << tools::DescribeRpcFailure(ctx.address, status) << "\n";
    return 1;
  }
  std::string text;
  if (!options.session_id.empty()) {
    if (response.snapshots().empty() || response.snapshots(0).allocator_snapshot_json().empty()) {
      *ctx.err << "bglctl: session " << options.session_id
               << " has not reported an allocator snapshot yet\n";
      return 1;
    }
    text = response.snapshots(0).allocator_snapshot_json();
  } else {
    nlohmann::json all = {{"snapshots", nlohmann::json::array()}};
    for (const auto& s : response.snapshots()) {
      nlohmann::json doc = nlohmann::json::parse(s.allocator_snapshot_json(), nullptr, false);
      if (doc.is_discarded()) doc = s.allocator_snapshot_json();
      all["snapshots"].push_back({{"session_id", s.session_id()},
                                  {"reported_unix_ms", s.reported_unix_ms()},
                                  {"snapshot", std::move(doc)}});
    }
    text = all.dump(1);
    if (response.snapshots().empty()) *ctx.err << "bglctl: no session has reported a snapshot\n";
  }
  if (!text.empty() && text.back() != '\n') text += '\n';
  if (options.out_path.empty() || options.out_path == "-") {
    *ctx.out << text;
    return 0;
  }
  if (!WriteFile(options.out_path, text, *ctx.err)) return 1;
  *ctx.err << "bglctl: wrote " << response.snapshots().size() << " snapshot(s) to "
           << options.out_path << "\n";
  return 0;
}

}  // namespace bgl::ctl
