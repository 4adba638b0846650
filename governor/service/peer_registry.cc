#include "governor/service/peer_registry.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

namespace bgl::gov {

namespace {

// "fd:N" -> N; -1 for any other peer string.
int FdOfPeer(const std::string& peer) {
  if (peer.rfind("fd:", 0) != 0 || peer.size() < 4 || peer.size() > 12)
    return -1;  // at most 9 digits
  int fd = 0;
  for (size_t i = 3; i < peer.size(); ++i) {
    if (peer[i] < '0' || peer[i] > '9') return -1;
    fd = fd * 10 + (peer[i] - '0');
  }
  return fd;
}

}  // namespace

bool PeerRegistry::SameSocket(int fd, const Entry& e) {
  struct stat st {};
  return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_dev == e.dev && st.st_ino == e.ino;
}

bool PeerRegistry::Set(int fd, PeerCredentials creds) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return false;
  std::lock_guard<std::mutex> lock(mu_);
  peers_[fd] = Entry{st.st_dev, st.st_ino, std::move(creds)};
  return true;
}

std::optional<PeerCredentials> PeerRegistry::Lookup(const std::string& peer) const {
  const int fd = FdOfPeer(peer);
  if (fd < 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(fd);
  if (it == peers_.end() || !SameSocket(fd, it->second)) return std::nullopt;
  return it->second.creds;
}

size_t PeerRegistry::Sweep() {
  std::lock_guard<std::mutex> lock(mu_);
  size_t removed = 0;
  for (auto it = peers_.begin(); it != peers_.end();) {
    if (SameSocket(it->first, it->second)) {
      ++it;
    } else {
      it = peers_.erase(it);
      ++removed;
    }
  }
  return removed;
}

size_t PeerRegistry::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peers_.size();
}

void PeerRegistry::DisconnectAll() const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [fd, entry] : peers_) {
    if (SameSocket(fd, entry)) ::shutdown(fd, SHUT_RDWR);
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
