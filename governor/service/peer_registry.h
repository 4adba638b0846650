// PeerRegistry: credentials of each accepted unix-socket connection, keyed by the peer string
// gRPC reports for channels added from a file descriptor ("fd:N"). An accept that reuses fd N
// replaces the entry, so a stale entry can never be read for a new connection.
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
  void Set(int fd, PeerCredentials creds);
  std::optional<PeerCredentials> Lookup(const std::string& peer) const;
  // Shuts down every recorded connection whose fd still holds the same peer (a closed fd may
  // have been reused), so a draining server is not held open by idle clients.
  void DisconnectAll() const;
  // Reads SO_PEERCRED of a connected unix socket and the uid's name and groups.
  static std::optional<PeerCredentials> Read(int fd);

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, PeerCredentials> peers_;
};

}  // namespace bgl::gov
