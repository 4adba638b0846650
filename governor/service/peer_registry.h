// PeerRegistry: credentials of each accepted unix-socket connection. gRPC names a connection
// added from a file descriptor only by its number ("fd:N"), and numbers are reused as soon as a
// connection closes, so each entry also records the identity of the socket itself (device and
// inode, unique per socket while the kernel's counter does not wrap). A lookup answers only
// while fd N still holds that same socket: a closed connection's entry is never read for
// whatever opens on its number next, and Sweep() forgets entries whose socket is gone.
// Thread-safe: every member may be called from any thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace bgl::gov {

// What SO_PEERCRED said, plus the groups of the uid at accept time.
struct PeerCredentials {
  uint32_t uid = 0;
  uint32_t gid = 0;
  int32_t pid = 0;
  std::string user;
  std::vector<gid_t> groups;
};

class PeerRegistry {
 public:
  // Records `creds` for the connection open on `fd` now (with its socket's identity), replacing
  // the entry of an earlier connection that had the same number. False when `fd` is not open.
  bool Set(int fd, PeerCredentials creds);
  // The credentials of the connection `peer` ("fd:N") names, if fd N still holds the socket they
  // were recorded for; nullopt for other peers, closed connections and reused numbers.
  std::optional<PeerCredentials> Lookup(const std::string& peer) const;
  // Removes the entries whose fd is closed or now holds another socket; returns how many.
  size_t Sweep();
  // Entries held (connections recorded and not yet swept).
  size_t size() const;
  // Shuts down every recorded connection whose fd still holds its socket, so a draining server
  // is not held open by idle clients.
  void DisconnectAll() const;
  // Reads SO_PEERCRED of a connected unix socket and the uid's name and groups.
  static std::optional<PeerCredentials> Read(int fd);

 private:
  struct Entry {
    dev_t dev = 0;
    ino_t ino = 0;
    PeerCredentials creds;
  };
  // True when `fd` is open on the socket `e` was recorded for.
  static bool SameSocket(int fd, const Entry& e);

  mutable std::mutex mu_;
  std::unordered_map<int, Entry> peers_;  // by fd number
};

}  // namespace bgl::gov
