// bgl-replay's trace readers and replay loop on small inline traces and a shipped trace.
#include "tools/bgl-replay/replay.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>

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

}  // namespace
}  // namespace bgl::alloc::replay
