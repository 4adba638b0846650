#include "tools/bglctl/commands.h"

namespace bgl::ctl {

std::unique_ptr<grpc::ClientContext> CtlContext::NewCall() const {
  auto call = std::make_unique<grpc::ClientContext>();
  call->set_deadline(std::chrono::system_clock::now() + timeout);
  return call;
}

}  // namespace bgl::ctl
