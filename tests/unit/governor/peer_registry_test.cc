// PeerRegistry binds credentials to the socket, not to its fd number: after a connection closes
// and another (another process, and as root another uid) is accepted on the same number, the
// old credentials are never returned for it, and closed connections' entries are swept.
#include "governor/service/peer_registry.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace bgl::gov {
namespace {

class Listener {
 public:
  Listener() {
    char tmpl[] = "/tmp/bgl-peers-XXXXXX";
    dir_ = mkdtemp(tmpl);
    chmod(dir_.c_str(), 0755);  // the child connects as another uid
    path_ = dir_ + "/s.sock";
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr = Address();
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(chmod(path_.c_str(), 0777), 0);
    EXPECT_EQ(listen(fd_, 8), 0);
  }
  ~Listener() {
    close(fd_);
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  sockaddr_un Address() const {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof(addr.sun_path) - 1);
    return addr;
  }
  int Connect() const {
    int c = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr = Address();
    if (connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(c);
      return -1;
    }
    return c;
  }
  int Accept() const { return accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC); }

 private:
  std::string dir_, path_;
  int fd_ = -1;
};

// A child process that connects (as `uid` when >= 0) and holds the connection until told.
struct Child {
  pid_t pid = -1;
  int release = -1;  // write end: closing it lets the child exit
};

Child ConnectFromChild(const Listener& l, int uid) {
  int ready[2], hold[2];
  EXPECT_EQ(pipe(ready), 0);
  EXPECT_EQ(pipe(hold), 0);
  Child child;
  child.pid = fork();
  if (child.pid == 0) {
    close(ready[0]);
    close(hold[1]);
    if (uid >= 0 && setuid(static_cast<uid_t>(uid)) != 0) _exit(3);
    int c = l.Connect();
    if (c < 0) _exit(4);
    char one = 1;
    if (write(ready[1], &one, 1) != 1) _exit(5);
    char buf;
    while (read(hold[0], &buf, 1) > 0) {
    }
    _exit(0);
  }
  close(ready[1]);
  close(hold[0]);
  char buf = 0;
  if (read(ready[0], &buf, 1) != 1) {  // the child could not connect: nothing to accept
    int status = 0;
    waitpid(child.pid, &status, 0);
    ADD_FAILURE() << "the child could not connect (exit status " << status << ")";
    std::abort();
  }
  close(ready[0]);
  child.release = hold[1];
  return child;
}

void Finish(Child& c) {
  close(c.release);
  int status = 0;
  waitpid(c.pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(PeerRegistry, ReusedFdNumberNeverGetsTheOldCredentials) {
  Listener l;
  PeerRegistry peers;
  const int client = l.Connect();
  ASSERT_GE(client, 0);
  const int first = l.Accept();
  ASSERT_GE(first, 0);
  auto mine = PeerRegistry::Read(first);
  ASSERT_TRUE(mine.has_value());
  EXPECT_EQ(mine->pid, getpid());
  ASSERT_TRUE(peers.Set(first, *mine));
  const std::string peer = "fd:" + std::to_string(first);
  ASSERT_TRUE(peers.Lookup(peer).has_value());
  EXPECT_EQ(peers.Lookup(peer)->pid, getpid());

  // Another process (another uid when root) connects; the first connection closes and the
  // daemon's next accept gets the same number back.
  const int other_uid = geteuid() == 0 ? 65534 : -1;
  Child child = ConnectFromChild(l, other_uid);
  close(first);
  EXPECT_FALSE(peers.Lookup(peer).has_value()) << "a closed connection still has credentials";
  const int second = l.Accept();
  close(client);
  ASSERT_EQ(second, first) << "the test needs the kernel to reuse the lowest free number";
  // Until the new connection's own credentials are recorded, the number answers nothing.
  EXPECT_FALSE(peers.Lookup(peer).has_value())
      << "the new connection on " << peer << " was attributed to the closed one's caller (pid "
      << peers.Lookup(peer)->pid << ")";
  auto theirs = PeerRegistry::Read(second);
  ASSERT_TRUE(theirs.has_value());
  ASSERT_TRUE(peers.Set(second, *theirs));
  auto now = peers.Lookup(peer);
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->pid, child.pid);
  if (other_uid >= 0) {
    EXPECT_EQ(now->uid, static_cast<uint32_t>(other_uid));
  }
  close(second);
  Finish(child);
}

TEST(PeerRegistry, SweepForgetsClosedConnections) {
  Listener l;
  PeerRegistry peers;
  int clients[3], conns[3];
  for (int i = 0; i < 3; ++i) {
    clients[i] = l.Connect();
    conns[i] = l.Accept();
    ASSERT_GE(conns[i], 0);
    ASSERT_TRUE(peers.Set(conns[i], *PeerRegistry::Read(conns[i])));
  }
  EXPECT_EQ(peers.size(), 3u);
  EXPECT_EQ(peers.Sweep(), 0u);
  close(conns[0]);
  close(conns[2]);
  EXPECT_EQ(peers.Sweep(), 2u);
  EXPECT_EQ(peers.size(), 1u);
  EXPECT_TRUE(peers.Lookup("fd:" + std::to_string(conns[1])).has_value());
  EXPECT_FALSE(peers.Lookup("fd:" + std::to_string(conns[0])).has_value());
  // Not an fd peer, or a malformed one: nothing.
  EXPECT_FALSE(peers.Lookup("ipv4:127.0.0.1:5").has_value());
  EXPECT_FALSE(peers.Lookup("fd:99999999999999").has_value());
  EXPECT_FALSE(peers.Set(-1, PeerCredentials{}));
  close(conns[1]);
  for (int c : clients) close(c);
}

}  // namespace
}  // namespace bgl::gov
