#include "governor/service/peer_registry.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace bgl::gov {

void PeerRegistry::Set(int fd, PeerCredentials creds) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_["fd:" + std::to_string(fd)] = std::move(creds);
}

std::optional<PeerCredentials> PeerRegistry::Lookup(const std::string& peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return std::nullopt;
  return it->second;
}

void PeerRegistry::DisconnectAll() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [peer, creds] : peers_) {
    const int fd = std::atoi(peer.c_str() + 3);  // "fd:N"
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) continue;
    if (cred.pid != creds.pid || cred.uid != creds.uid) continue;
    ::shutdown(fd, SHUT_RDWR);
  }
}

std::optional<PeerCredentials> PeerRegistry::Read(int fd) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return std::nullopt;
  PeerCredentials creds;
  creds.uid = cred.uid;
  creds.gid = cred.gid;
  creds.pid = cred.pid;
  struct passwd pw {};
  struct passwd* found = nullptr;
  std::vector<char> buf(16384);
  if (getpwuid_r(cred.uid, &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr) {
    creds.user = pw.pw_name;
    int n = 64;
    creds.groups.resize(static_cast<size_t>(n));
    if (getgrouplist(pw.pw_name, cred.gid, creds.groups.data(), &n) < 0) {
      creds.groups.resize(static_cast<size_t>(n));
      getgrouplist(pw.pw_name, cred.gid, creds.groups.data(), &n);
    }
    creds.groups.resize(static_cast<size_t>(std::max(n, 0)));
  } else {
    creds.user = std::to_string(cred.uid);
    creds.groups.push_back(cred.gid);
  }
  return creds;
}

}  // namespace bgl::gov
