// The bglctl subcommands. Each returns the process exit status (0 success, 1 failure) and
// writes results to `out`, errors (naming the governor's address) to `err`.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <ostream>
#include <string>

#include "tools/bglctl/options.h"

namespace bgl::ctl {

// What every command needs: where the daemon is, a channel to it and the streams to write to.
struct CtlContext {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::chrono::milliseconds timeout{3000};
  std::ostream* out;
  std::ostream* err;

  // A client context whose deadline is `timeout` from now.
  std::unique_ptr<grpc::ClientContext> NewCall() const;
};

// grpc.health.v1 Check; prints the status; 0 only when SERVING.
int RunHealth(const CtlContext& ctx, const CtlOptions& options);
// ListSessions as a table or JSON.
int RunSessions(const CtlContext& ctx, const CtlOptions& options);
// Snapshot: one session's allocator snapshot as is, or all of them wrapped in one document.
int RunSnapshot(const CtlContext& ctx, const CtlOptions& options);
// Plan for one scheduling point, summarised or as JSON.
int RunPlan(const CtlContext& ctx, const CtlOptions& options);

}  // namespace bgl::ctl
