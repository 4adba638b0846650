// DaemonProcess: starts the real bgl-governord binary on a temporary socket for a test, waits
// until it answers health checks, and signals or kills it.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bgl::gov::testing {

class DaemonProcess {
 public:
  // `extra` are more flags; the socket lives in a fresh temporary directory.
  explicit DaemonProcess(std::vector<std::string> extra = {}, std::string dir = "");
  ~DaemonProcess();

  // Runs the daemon as `uid`/`gid` from the next Start on (root only: a copy of the binary in
  // the socket's folder, which that uid is given).
  void RunAs(int uid, int gid) {
    run_uid_ = uid;
    run_gid_ = gid;
  }
  // Starts (or restarts) the daemon; true once it answers on the socket.
  bool Start();
  // Starts it with its metrics endpoint on a free loopback port. The port is picked by binding
  // port 0 and closing it, so another process may take it before the daemon binds it: the
  // daemon then cannot listen and exits, and another port is tried. Restarts keep the port.
  bool StartWithMetrics();
  // The metrics port (-1 before StartWithMetrics) and one scrape of /metrics ("" when nothing
  // answers).
  int metrics_port() const { return metrics_port_; }
  std::string ScrapeMetrics() const;
  void Signal(int sig);
  // Sends SIGKILL and reaps it.
  void Kill();
  // Sends SIGTERM and waits; returns the exit status (-1 if it did not exit normally).
  int Stop();
  // Like Stop, but gives up after `limit_ms`: then kills the daemon and returns -2 (it hung).
  int StopWithin(int limit_ms);
  // The daemon's resident set size and thread count (/proc/PID/status); -1 when unknown.
  int64_t RssBytes() const;
  int Threads() const;
  const std::string& address() const { return address_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }

 private:
  std::vector<std::string> extra_;
  std::string dir_;
  std::string address_;
  int metrics_port_ = -1;
  pid_t pid_ = -1;
  int run_uid_ = -1;  // -1: this process's
  int run_gid_ = -1;
};

// Reads a file into a string ("" when missing).
std::string ReadFile(const std::string& path);
// A loopback TCP port that was free a moment ago (bound to port 0, then closed), or -1.
int FreeTcpPort();
// GET `path` from 127.0.0.1:`port`; the whole response, or "" when nothing answers.
std::string HttpGet(int port, const std::string& path);
// The value of an unlabelled metric in a Prometheus text scrape, or -1 when absent.
double MetricValue(const std::string& scrape, const std::string& name);
// A registration of the tiny model the tests use.
std::string TinyModelJson();
// Runs `argv` (argv[0] a path), optionally as another uid/gid (through copies of the files
// `argv` names in a folder that uid can read, so the build and source trees' permissions do
// not matter), capturing stdout (and why the program could not start, exit status 127);
// returns the exit status (or -1).
int RunProgram(const std::vector<std::string>& argv, std::string* out, int uid = -1, int gid = -1);

}  // namespace bgl::gov::testing
