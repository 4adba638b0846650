// Where the command-line tools find bgl-governord, and how they describe failing to reach it.
// Shared by bglctl and bgl-top so both honour --governor and $BGL_GOVERNOR the same way.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"

namespace bgl::tools {

// The daemon's default socket (DESIGN.md).
inline constexpr char kDefaultGovernorAddress[] = "unix:///run/bagualu/governor.sock";

// $BGL_GOVERNOR when set and not empty, otherwise kDefaultGovernorAddress.
std::string DefaultGovernorAddress();

// Accepts what gRPC can dial: unix:///abs/path, unix:path, dns:/ipv4:/ipv6: targets and
// host:port. The error names the address.
Status CheckGovernorAddress(std::string_view address);

// An insecure channel (on a unix socket the socket's file mode and the daemon's peer
// credentials are the access control; TCP is off unless an operator turns it on) that retries
// a lost connection every few seconds at most.
std::shared_ptr<grpc::Channel> OpenGovernorChannel(const std::string& address);

// One line for a failed call that names the address, e.g. "cannot reach the governor at
// unix:///run/bagualu/governor.sock (no such socket): ...".
std::string DescribeRpcFailure(const std::string& address, const grpc::Status& status);

}  // namespace bgl::tools
