// UnixListener: the daemon's own accept loop on its unix socket. It removes a stale socket
// (refusing if a live daemon answers on it), binds with the configured mode and group, reads
// each connection's SO_PEERCRED into the PeerRegistry, and hands the non-blocking fd to gRPC
// (AddInsecureChannelFromFd), since gRPC C++ does not expose peer credentials itself. Once a
// second it sweeps the registry of connections gRPC has closed. Start/Stop from one thread;
// the accept loop runs on its own thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "base/status.h"
#include "governor/service/peer_registry.h"

namespace grpc {
class Server;
}

namespace bgl::gov {

class UnixListener {
 public:
  // `path` is a filesystem path (no "unix://"). `group` empty: keep the daemon's group.
  static Result<std::unique_ptr<UnixListener>> Bind(const std::string& path, mode_t mode,
                                                    const std::string& group);
  ~UnixListener();
  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;

  // Starts accepting into `server` (already started, no ports needed).
  void Start(grpc::Server* server, PeerRegistry* peers);
  // Stops accepting and removes the socket file. Connections already handed over stay open.
  void Stop();
  const std::string& path() const { return path_; }
  uint64_t accepted() const { return accepted_.load(); }

 private:
  UnixListener(std::string path, int fd, int wake_fd);
  void Loop(grpc::Server* server, PeerRegistry* peers);

  std::string path_;
  int fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<uint64_t> accepted_{0};
};

// "unix:///a/b" or "unix:/a/b" -> "/a/b"; "" when `address` is not a unix address.
std::string UnixSocketPath(const std::string& address);

}  // namespace bgl::gov
