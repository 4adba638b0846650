#include "governor/service/unix_listener.h"

#include <errno.h>
#include <grp.h>
#include <grpcpp/server.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <vector>

namespace bgl::gov {
namespace {

Status Errno(const std::string& what) {
  return {StatusCode::kUnavailable, what + ": " + std::strerror(errno)};
}

bool FillAddress(const std::string& path, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr->sun_path)) return false;
  std::memcpy(addr->sun_path, path.c_str(), path.size() + 1);
  return true;
}

}  // namespace

std::string UnixSocketPath(const std::string& address) {
  if (address.rfind("unix://", 0) == 0) return address.substr(7);
  if (address.rfind("unix:", 0) == 0) return address.substr(5);
  return "";
}

Result<std::unique_ptr<UnixListener>> UnixListener::Bind(const std::string& path, mode_t mode,
                                                         const std::string& group) {
  sockaddr_un addr;
  if (path.empty() || path[0] != '/' || !FillAddress(path, &addr)) {
    return InvalidArgument("listen: socket path must be absolute and shorter than " +
                           std::to_string(sizeof(addr.sun_path)) + " bytes: '" + path + "'");
  }
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return FailedPrecondition("listen: '" + path + "' exists and is not a socket");
    }
    // A live daemon answers a connect; a stale socket (crashed daemon) refuses it.
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live =
        probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) close(probe);
    if (live) return FailedPrecondition("listen: another daemon is serving '" + path + "'");
    if (unlink(path.c_str()) != 0) return Errno("listen: removing stale socket '" + path + "'");
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Errno("listen: socket");
  // Bind under a umask that never exposes the socket wider than `mode` before the chmod.
  const mode_t old_umask = umask(0177);
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  umask(old_umask);
  if (rc != 0) {
    Status s = Errno("listen: bind '" + path + "'");
    close(fd);
    return s;
  }
  if (!group.empty()) {
    struct group gr {};
    struct group* found = nullptr;
    std::vector<char> buf(16384);
    if (getgrnam_r(group.c_str(), &gr, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
      close(fd);
      unlink(path.c_str());
      return InvalidArgument("socket_group: no such group '" + group + "'");
    }
    if (chown(path.c_str(), static_cast<uid_t>(-1), gr.gr_gid) != 0) {
      Status s = Errno("socket_group: chown '" + path + "'");
      close(fd);
      unlink(path.c_str());
      return s;
    }
  }
  if (chmod(path.c_str(), mode) != 0 || listen(fd, 256) != 0) {
    Status s = Errno("listen: chmod/listen '" + path + "'");
    close(fd);
    unlink(path.c_str());
    return s;
  }
  int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    Status s = Errno("listen: eventfd");
    close(fd);
    unlink(path.c_str());
    return s;
  }
  return std::unique_ptr<UnixListener>(new UnixListener(path, fd, wake));
}

UnixListener::UnixListener(std::string path, int fd, int wake_fd)
    : path_(std::move(path)), fd_(fd), wake_fd_(wake_fd) {}

UnixListener::~UnixListener() {
  Stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void UnixListener::Start(grpc::Server* server, PeerRegistry* peers) {
  thread_ = std::thread([this, server, peers] { Loop(server, peers); });
}

void UnixListener::Stop() {
  if (fd_ < 0) return;
  const uint64_t one = 1;
  if (write(wake_fd_, &one, sizeof(one)) < 0) {
    // Nothing else to do: the join below still returns once the loop sees the flag.
  }
  if (thread_.joinable()) thread_.join();
  close(fd_);
  fd_ = -1;
  unlink(path_.c_str());
}

void UnixListener::Loop(grpc::Server* server, PeerRegistry* peers) {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // Wakes at least once a second to forget the connections gRPC has closed since.
    const int ready = poll(fds, 2, 1000);
    if (ready < 0) {
      if (errno == EINTR) continue;
      return;
    }
    peers->Sweep();
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (conn < 0) continue;  // EAGAIN, ECONNABORTED, EMFILE: try again on the next event
    auto creds = PeerRegistry::Read(conn);
    if (!creds) {
      close(conn);
      continue;
    }
    // Before gRPC sees the fd, so no call on it can precede its credentials. The entry an
    // earlier connection on the same number left is replaced (it no longer matches anyway).
    if (!peers->Set(conn, std::move(*creds))) {
      close(conn);
      continue;
    }
    accepted_.fetch_add(1);
    grpc::AddInsecureChannelFromFd(server, conn);
  }
}

}  // namespace bgl::gov
