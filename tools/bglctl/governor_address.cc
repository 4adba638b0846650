#include "tools/bglctl/governor_address.h"

#include <sys/stat.h>

#include <cstdlib>

namespace bgl::tools {
namespace {

// The socket path of a unix: address, or empty for other schemes.
std::string UnixPath(std::string_view address) {
  if (address.starts_with("unix://")) return std::string(address.substr(7));
  if (address.starts_with("unix:")) return std::string(address.substr(5));
  return {};
}

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

std::string DefaultGovernorAddress() {
  const char* env = std::getenv("BGL_GOVERNOR");
  if (env != nullptr && *env != '\0') return env;
  return kDefaultGovernorAddress;
}

Status CheckGovernorAddress(std::string_view address) {
  if (address.empty()) return InvalidArgument("--governor: empty address");
  if (address.starts_with("unix:")) {
    if (UnixPath(address).empty()) {
      return InvalidArgument("--governor: '" + std::string(address) + "' has no socket path");
    }
    return OkStatus();
  }
  for (std::string_view scheme : {"dns:", "ipv4:", "ipv6:"}) {
    if (address.starts_with(scheme)) return OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == address.size()) {
    return InvalidArgument("--governor: '" + std::string(address) +
                           "' is neither unix:///path nor host:port");
  }
  return OkStatus();
}

std::shared_ptr<grpc::Channel> OpenGovernorChannel(const std::string& address) {
  // gRPC's reconnect backoff grows to two minutes by default; a dashboard should notice a
  // restarted daemon within seconds.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 250);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::string DescribeRpcFailure(const std::string& address, const grpc::Status& status) {
  const grpc::StatusCode code = status.error_code();
  std::string text;
  if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) {
    text = "cannot reach the governor at " + address;
    const std::string path = UnixPath(address);
    struct stat st {};
    if (!path.empty() && ::stat(path.c_str(), &st) != 0) {
      text += " (no such socket; is bgl-governord running?)";
    } else if (!path.empty() && !S_ISSOCK(st.st_mode)) {
      text += " (not a socket)";
    }
  } else {
    text = "the governor at " + address + " answered";
  }
  text += ": ";
  text += CodeName(code);
  if (!status.error_message().empty()) text += ": " + status.error_message();
  return text;
}

}  // namespace bgl::tools
