// bgl-socket-floor: the round trip of 200 bytes over a unix socket between two processes, with
// no RPC layer: the floor under any daemon round trip on this machine (two process wakeups).
// Usage: bgl-socket-floor [--iterations N]
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  int iterations = 20000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iterations") == 0 && i + 1 < argc) {
      iterations = std::max(100, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--iterations N]\n", argv[0]);
      return 2;
    }
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    std::perror("socketpair");
    return 1;
  }
  char buf[256] = {};
  const pid_t child = fork();
  if (child == 0) {  // the echo side
    close(sv[0]);
    while (read(sv[1], buf, sizeof buf) > 0) {
      if (write(sv[1], buf, 200) != 200) break;
    }
    _exit(0);
  }
  close(sv[1]);
  std::vector<double> us(static_cast<std::size_t>(iterations));
  for (double& t : us) {
    const auto start = std::chrono::steady_clock::now();
    if (write(sv[0], buf, 200) != 200 || read(sv[0], buf, sizeof buf) <= 0) {
      std::perror("round trip");
      return 1;
    }
    t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  }
  close(sv[0]);
  waitpid(child, nullptr, 0);
  std::sort(us.begin(), us.end());
  std::printf("unix socket round trip, 200 bytes, %d iterations: p50 %.1f us, p99 %.1f us\n",
              iterations, us[us.size() / 2], us[us.size() * 99 / 100]);
  return 0;
}
