// bglctl health: the Kubernetes exec probe. Exit 0 only when the daemon says SERVING.
#include "grpc/health/v1/health.grpc.pb.h"
#include "tools/bglctl/commands.h"
#include "tools/bglctl/governor_address.h"

namespace bgl::ctl {

int RunHealth(const CtlContext& ctx, const CtlOptions& options) {
  auto stub = grpc::health::v1::Health::NewStub(ctx.channel);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(options.service);
  grpc::health::v1::HealthCheckResponse response;
  auto call = ctx.NewCall();
  const grpc::Status status = stub->Check(call.get(), request, &response);
  const std::string what = options.service.empty() ? "governor" : "service " + options.service;
  if (!status.ok()) {
    if (status.error_code() == grpc::StatusCode::NOT_FOUND) {
      *ctx.err << "bglctl: " << what << " at " << ctx.address << " is unknown to the daemon\n";
    } else {
      *ctx.err << "bglctl: " << tools::DescribeRpcFailure(ctx.address, status) << "\n";
    }
    return 1;
  }
  const auto serving = response.status();
  const std::string name = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(serving);
  if (serving != grpc::health::v1::HealthCheckResponse::SERVING) {
    *ctx.err << "bglctl: " << what << " at " << ctx.address << " is " << name << "\n";
    return 1;
  }
  *ctx.out << name << "\n";
  return 0;
}

}  // namespace bgl::ctl
