#include "tests/integration/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "governor/client/remote_governor.h"

namespace bgl::gov::testing {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string TinyModelJson() { return ReadFile(std::string(BGL_MODELS_DIR) + "/tiny-moe.json"); }

DaemonProcess::DaemonProcess(std::vector<std::string> extra, std::string dir)
    : extra_(std::move(extra)), dir_(std::move(dir)) {
  if (dir_.empty()) {
    char tmpl[] = "/tmp/bgl-gov-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    chmod(dir_.c_str(), 0755);
  }
  address_ = "unix://" + dir_ + "/governor.sock";
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) Kill();
  std::string cmd = "rm -rf '" + dir_ + "'";
  (void)std::system(cmd.c_str());
}

namespace {

// Whether a Unix socket at `path` accepts a connection now.
bool Accepts(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

}  // namespace

bool DaemonProcess::Start() {
  std::string binary = BGL_GOVERNORD;
  if (run_uid_ >= 0) {
    namespace fs = std::filesystem;
    const std::string copy = dir_ + "/bgl-governord";
    std::error_code ec;
    fs::copy_file(binary, copy, fs::copy_options::overwrite_existing, ec);
    if (ec || chmod(copy.c_str(), 0755) != 0 ||
        chown(dir_.c_str(), static_cast<uid_t>(run_uid_), static_cast<gid_t>(run_gid_)) != 0) {
      std::fprintf(stderr, "DaemonProcess: cannot prepare %s for uid %d: %s\n", dir_.c_str(),
                   run_uid_, ec ? ec.message().c_str() : std::strerror(errno));
      return false;
    }
    binary = copy;
  }
  std::vector<std::string> args = {binary,
                                   "--listen",
                                   address_,
                                   "--metrics-port",
                                   std::to_string(std::max(metrics_port_, 0)),
                                   "--metrics-address",
                                   "127.0.0.1",
                                   "--drain-timeout-ms",
                                   "1000"};
  args.insert(args.end(), extra_.begin(), extra_.end());
  const std::string log = dir_ + "/daemon.log";
  // Everything the child needs is made before fork: it only opens, dups and execs.
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const int uid = run_uid_, gid = run_gid_;
  pid_ = fork();
  if (pid_ == 0) {
    if (uid >= 0 && (setgroups(0, nullptr) != 0 || setgid(static_cast<gid_t>(gid)) != 0 ||
                     setuid(static_cast<uid_t>(uid)) != 0)) {
      _exit(126);
    }
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  // A loaded machine (CI runs two suites at once) can take seconds to start a process: wait by
  // the clock, not by a count of quick refusals.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string why = "still starting after 60 s";
  auto exited = [&] {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
    why = "exited with status " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    pid_ = -1;
    return true;
  };
  auto fail = [&] {
    std::fprintf(stderr, "DaemonProcess: bgl-governord at %s %s; its log:\n%s\n", address_.c_str(),
                 why.c_str(), ReadFile(log).c_str());
    return false;
  };
  // Wait until the socket accepts a connection first (a socket file alone may be one a killed
  // daemon left): a gRPC channel whose first connect failed backs off before retrying.
  const std::string path = dir_ + "/governor.sock";
  while (std::chrono::steady_clock::now() < deadline && !Accepts(path)) {
    if (exited()) return fail();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  RemoteOptions options;
  options.address = address_;
  options.reconnect = false;
  RemoteGovernor probe(options);
  while (std::chrono::steady_clock::now() < deadline) {
    if (probe.Health(std::chrono::milliseconds(200)).ok()) return true;
    if (exited()) return fail();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return fail();
}

bool DaemonProcess::StartWithMetrics() {
  const std::string log = dir_ + "/daemon.log";
  for (int attempt = 0; attempt < 20; ++attempt) {
    metrics_port_ = FreeTcpPort();
    if (metrics_port_ <= 0) return false;
    const size_t logged = ReadFile(log).size();
    if (Start()) return true;
    // Only a port taken meanwhile is worth another try.
    if (ReadFile(log).find("metrics_port: cannot listen", logged) == std::string::npos) break;
    std::fprintf(stderr, "DaemonProcess: metrics port %d was taken; trying another\n",
                 metrics_port_);
  }
  return false;
}

std::string DaemonProcess::ScrapeMetrics() const {
  return metrics_port_ > 0 ? HttpGet(metrics_port_, "/metrics") : "";
}

int FreeTcpPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

std::string HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      ssize_t n;
      while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return out;
}

double MetricValue(const std::string& scrape, const std::string& name) {
  const std::string key = "\n" + name + " ";
  const size_t at = scrape.find(key);
  return at == std::string::npos ? -1 : std::strtod(scrape.c_str() + at + key.size(), nullptr);
}

void DaemonProcess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

int DaemonProcess::Stop() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int DaemonProcess::StopWithin(int limit_ms) {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = 0;
  for (int waited = 0; waitpid(pid_, &status, WNOHANG) != pid_; waited += 10) {
    if (waited >= limit_ms) {
      Kill();
      return -2;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  pid_ = -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

namespace {

// One "Key:   N ..." field of /proc/PID/status.
int64_t StatusField(pid_t pid, const std::string& key) {
  if (pid <= 0) return -1;
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1);
  }
  return -1;
}

}  // namespace

int64_t DaemonProcess::RssBytes() const {
  const int64_t kib = StatusField(pid_, "VmRSS");
  return kib < 0 ? -1 : kib * 1024;
}

int DaemonProcess::Threads() const { return static_cast<int>(StatusField(pid_, "Threads")); }

namespace {

// Copies of the files among `args` (the program, a model file) in a new folder under /tmp that
// another uid can enter and read, each argument that names one pointed at its copy: the build
// and source trees may sit in a folder only their owner can enter (mktemp -d makes 0700
// folders). Returns the folder, or "" with `why` set (nothing left behind).
std::string CopyForOtherUid(std::vector<std::string>* args, std::string* why) {
  namespace fs = std::filesystem;
  char tmpl[] = "/tmp/bgl-program-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    *why = std::string("mkdtemp: ") + std::strerror(errno);
    return "";
  }
  const fs::perms readable = fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec;
  std::error_code ec;
  fs::permissions(tmpl, readable, ec);
  for (std::size_t i = 0; i < args->size() && !ec; ++i) {
    const fs::path from = (*args)[i];
    if (!fs::is_regular_file(from, ec)) {
      ec.clear();
      continue;
    }
    const fs::path to = fs::path(tmpl) / (std::to_string(i) + "-" + from.filename().string());
    if (fs::copy_file(from, to, ec) && !ec) fs::permissions(to, readable, ec);
    if (ec) *why = "cannot copy " + from.string() + " to " + to.string() + ": " + ec.message();
    (*args)[i] = to.string();
  }
  if (ec) {
    fs::remove_all(tmpl, ec);
    return "";
  }
  return tmpl;
}

}  // namespace

int RunProgram(const std::vector<std::string>& args, std::string* out, int uid, int gid) {
  std::vector<std::string> copy = args;
  std::string dir;
  if (uid >= 0) {
    std::string why;
    dir = CopyForOtherUid(&copy, &why);
    if (dir.empty()) {
      *out += "RunProgram: " + why + "\n";
      return -1;
    }
  }
  int pipefd[2];
  if (pipe(pipefd) != 0) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], 1);
    close(pipefd[0]);
    close(pipefd[1]);
    if (gid >= 0 && (setgroups(0, nullptr) != 0 || setgid(static_cast<gid_t>(gid)) != 0)) {
      _exit(126);
    }
    if (uid >= 0 && setuid(static_cast<uid_t>(uid)) != 0) _exit(126);
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    const std::string why =
        "RunProgram: cannot run " + copy[0] + ": " + std::strerror(errno) + "\n";
    (void)!write(1, why.data(), why.size());
    _exit(127);
  }
  close(pipefd[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof(buf))) > 0) out->append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace bgl::gov::testing
