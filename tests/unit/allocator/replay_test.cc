// bgl-replay's trace readers and replay loop on small inline traces and a shipped trace.
#include "tools/bgl-replay/replay.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "tools/bgl-replay/trace.h"

namespace bgl::alloc::replay {
namespace {

std::string write_temp(const std::string& name, const std::string& text) {
  std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ReplayTest, ReadsRmmCsvAndSnapshotJson) {
  Trace csv;
  std::string err;
  ASSERT_TRUE(load_trace(write_temp("t.csv",
                                    "Thread,Time,Action,Pointer,Size,Stream\n"
                                    "1,0,allocate,0x1000,4096,0\n"
                                    "1,1,allocate,0x2000,100,7\n"
                                    "1,2,free,0x1000,4096,0\n"
                                    "1,3,allocate failure,0x0,99,0\n"
                                    "1,4,free,0x9999,1,0\n"),
                         0, &csv, &err))
      << err;
  ASSERT_EQ(csv.ops.size(), 3u);
  EXPECT_EQ(csv.slots, 2u);
  EXPECT_EQ(csv.skipped, 2u);
  EXPECT_EQ(csv.ops[1].stream, 7u);
  Trace js;
  ASSERT_TRUE(load_trace(write_temp("t.json",
                                    R"({"segments":[],"device_traces":[[
        {"action":"alloc","addr":16,"size":512,"stream":0},
        {"action":"free_requested","addr":16,"size":512,"stream":0},
        {"action":"free_completed","addr":16,"size":512,"stream":0},
        {"action":"oom","device_free":0,"size":1,"stream":0}]]})"),
                         0, &js, &err))
      << err;
  ASSERT_EQ(js.ops.size(), 2u);
  EXPECT_FALSE(js.ops[1].alloc);
  EXPECT_FALSE(load_trace(write_temp("bad.csv", "1,0,explode,0x1,1,0\n"), 0, &js, &err));
  EXPECT_NE(err.find("unknown action 'explode'"), std::string::npos) << err;
}

TEST(ReplayTest, ShippedTraceReplaysWithinFragmentationTarget) {
  Trace t;
  std::string err;
  ASSERT_TRUE(load_trace(BGL_TRACES_DIR "/moe-coarse-16e.csv", 0, &t, &err)) << err;
  Config c;
  c.backend = "host";
  c.capacity = std::size_t{64} << 30;
  c.pool.log = false;
  ReplayResult r;
  ASSERT_TRUE(run_replay(t, c, 1, &r, &err)) << err;
  EXPECT_EQ(r.ooms, 0u);
  EXPECT_GT(r.peak_live, 0);
  EXPECT_LE(r.ratio, 1.05);
  EXPECT_GE(r.ratio, 1.0);
}

// Malformed traces are errors naming the event and field, never an abort or OOMs.
TEST(ReplayTest, MalformedTracesNameTheProblem) {
  struct Case {
    const char* name;
    std::string text;
    const char* expect;
  };
  const Case cases[] = {
      {"null.json", R"({"device_traces": [[null]]})",
       "device_traces[0][0]: an event must be an object, got null"},
      {"num.json", R"([1, 2])", "trace[0]: an event must be an object"},
      {"action.json", R"([{"action": 7, "addr": 1, "size": 1}])",
       "trace[0].action: must be a string"},
      {"zero.json", R"([{"action": "alloc", "addr": 16, "size": 0}])",
       "trace[0].size: an allocation must be 1 byte to 2^60 bytes, got 0"},
      {"neg.json", R"([{"action": "alloc", "addr": 16, "size": -4096}])",
       "trace[0].size: must be a non-negative integer, got -4096"},
      {"float.json", R"([{"action": "alloc", "addr": 16, "size": 1.5}])",
       "trace[0].size: must be a non-negative integer, got 1.5"},
      {"str.json", R"([{"action": "alloc", "addr": "zz", "size": 5}])",
       "trace[0].addr: must be a non-negative integer"},
      {"neg.csv", "1,0,allocate,0x10,-4096,0\n", "line 1: size must be a non-negative integer"},
      {"zero.csv", "1,0,allocate,0x10,0,0\n", "line 1: an allocation must be 1 byte"},
      {"junk.csv", "1,0,allocate,0x10,12abc,0\n", "line 1: size must be a non-negative integer"},
      {"empty.csv", "  \n", "is empty"},
  };
  for (const Case& c : cases) {
    Trace t;
    std::string err;
    EXPECT_FALSE(load_trace(write_temp(c.name, c.text), 0, &t, &err)) << c.name;
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.name << ": " << err;
  }
  Trace t;
  std::string err;
  EXPECT_FALSE(load_trace(::testing::TempDir(), 0, &t, &err));
  EXPECT_NE(err.find("is a directory"), std::string::npos) << err;
}

// The tool: bad input exits with status 2 and a message; nothing aborts.
TEST(ReplayTest, ToolExitsTwoOnBadInput) {
  const std::string tool = BGL_REPLAY;
  const std::string null_trace = write_temp("tool-null.json", R"({"device_traces": [[null]]})");
  const std::string no_events = write_temp("tool-empty.json", R"({"device_traces": [[]]})");
  for (const std::string& args :
       {"--trace " + null_trace, "--trace " + ::testing::TempDir(), "--trace " + no_events,
        "--trace " + null_trace + " --device x", "--trace " + null_trace + " --repeat 0",
        "--trace " + null_trace + " --conf capacity:8192TiB"}) {
    const std::string out = ::testing::TempDir() + "tool.err";
    const int status = std::system((tool + " " + args + " >/dev/null 2>" + out).c_str());
    ASSERT_TRUE(WIFEXITED(status)) << args;
    EXPECT_EQ(WEXITSTATUS(status), 2) << args;
    std::ifstream in(out);
    std::string msg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(msg.rfind("bgl-replay: ", 0), 0u) << args << ": " << msg;
  }
}

}  // namespace
}  // namespace bgl::alloc::replay
