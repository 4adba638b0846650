// bgl-top's frame pieces without a daemon: bars, sparklines with spike markers, sorting, the
// plain-text layout and the JSON frame.
#include <gtest/gtest.h>

#include <string>

#include "tools/bgl-top/frame_json.h"
#include "tools/bgl-top/frame_layout.h"
#include "tools/bgl-top/gpu_bar.h"
#include "tools/bgl-top/history.h"
#include "tools/bgl-top/process_sort.h"
#include "tools/bgl-top/strategy_text.h"

namespace bgl::top {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

std::string Text(const Line& line) {
  std::string s;
  for (const Span& span : line) s += span.text;
  return s;
}

bagualu::v1::ProcessRow* AddProcess(bagualu::v1::GpuState* gpu, int pid, const char* user,
                                    const char* job, int64_t in_use, int64_t peak) {
  auto* row = gpu->add_processes();
  row->mutable_session()->set_pid(pid);
  row->mutable_session()->set_user(user);
  row->mutable_session()->set_job_id(job);
  row->mutable_session()->set_pipeline_rank(pid % 4);
  row->set_in_use_bytes(in_use);
  row->set_peak_bytes(peak);
  return row;
}

bagualu::v1::WatchResponse TwoGpuFrame() {
  bagualu::v1::WatchResponse frame;
  frame.set_unix_ms(1700000000000);
  auto* g0 = frame.add_gpus();
  g0->set_gpu_uuid("GPU-a");
  g0->set_gpu_index(0);
  g0->set_capacity_bytes(8 * kGiB);
  g0->set_in_use_bytes(2 * kGiB);
  g0->set_reserved_bytes(4 * kGiB);
  g0->set_budget_bytes(6 * kGiB);
  g0->set_load_factor(1.0);
  auto* r = AddProcess(g0, 300, "alice", "job-a", 2 * kGiB, 3 * kGiB);
  (*r->mutable_strategy_counts())["recompute"] = 4;
  (*r->mutable_strategy_counts())["keep"] = 10;
  r->set_ooms_avoided(2);
  auto* g1 = frame.add_gpus();
  g1->set_gpu_uuid("GPU-b");
  g1->set_gpu_index(1);
  g1->set_capacity_bytes(8 * kGiB);
  g1->set_in_use_bytes(5 * kGiB);
  g1->set_load_factor(2.6);
  AddProcess(g1, 100, "bob", "job-b", 5 * kGiB, 6 * kGiB);
  return frame;
}

TEST(GpuBar, CellsFollowInUseReservedAndBudget) {
  Line line;
  AppendGpuBar({8 * kGiB, 2 * kGiB, 4 * kGiB, 6 * kGiB}, 8, AsciiGlyphs(), line);
  EXPECT_EQ(Text(line), "##==.|..");
  ASSERT_FALSE(line.empty());
  EXPECT_EQ(line.front().style, Style::kInUse);
}

TEST(GpuBar, EmptyAndFullCapacity) {
  Line empty;
  AppendGpuBar({0, 0, 0, 0}, 5, AsciiGlyphs(), empty);
  EXPECT_EQ(Text(empty), ".....");
  Line full;
  AppendGpuBar({kGiB, 2 * kGiB, 2 * kGiB, 0}, 4, AsciiGlyphs(), full);
  EXPECT_EQ(Text(full), "####");
}

TEST(Sparkline, MarksSpikesAboveThreshold) {
  History history;
  for (double load : {1.0, 1.3, 1.1, 2.6}) {
    bagualu::v1::WatchResponse frame;
    auto* gpu = frame.add_gpus();
    gpu->set_gpu_uuid("GPU-a");
    gpu->set_capacity_bytes(100);
    gpu->set_in_use_bytes(50);
    gpu->set_load_factor(load);
    history.Add(frame);
  }
  Line spark, markers;
  AppendSparkline(history.Of("GPU-a"), 6, AsciiGlyphs(), spark, markers);
  EXPECT_EQ(DisplayWidth(Text(spark)), 6u);
  EXPECT_EQ(Text(markers), "   ^ ^");
  EXPECT_EQ(CountSpikes(history.Of("GPU-a"), 6), 2);
  EXPECT_EQ(CountSpikes(history.Of("GPU-a"), 1), 1);
  EXPECT_TRUE(history.Of("unknown").empty());
}

TEST(History, KeepsOnlyDepthSamples) {
  History history(3);
  bagualu::v1::WatchResponse frame;
  frame.add_gpus()->set_gpu_uuid("g");
  for (int i = 0; i < 10; ++i) {
    frame.set_unix_ms(i);
    history.Add(frame);
  }
  ASSERT_EQ(history.Of("g").size(), 3u);
  EXPECT_EQ(history.Of("g").front().unix_ms, 7);
}

TEST(ProcessSort, KeysAndReverse) {
  const auto frame = TwoGpuFrame();
  auto by_memory = SortedProcesses(frame, SortKey::kMemory, false);
  ASSERT_EQ(by_memory.size(), 2u);
  EXPECT_EQ(by_memory[0].row->session().pid(), 100);
  auto by_pid = SortedProcesses(frame, SortKey::kPid, false);
  EXPECT_EQ(by_pid[0].row->session().pid(), 100);
  auto by_user_rev = SortedProcesses(frame, SortKey::kUser, true);
  EXPECT_EQ(by_user_rev[0].row->session().user(), "bob");
  auto by_ooms = SortedProcesses(frame, SortKey::kOoms, false);
  EXPECT_EQ(by_ooms[0].row->session().pid(), 300);
}

TEST(ProcessSort, ParseAndKeys) {
  EXPECT_EQ(*ParseSortKey("mem"), SortKey::kMemory);
  EXPECT_EQ(*ParseSortKey("peak"), SortKey::kPeak);
  auto bad = ParseSortKey("speed");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--sort"), std::string::npos);
  EXPECT_EQ(SortKeyForPress('m'), SortKey::kMemory);
  EXPECT_EQ(SortKeyForPress('p'), SortKey::kPid);
  EXPECT_FALSE(SortKeyForPress('x').has_value());
  for (SortKey k : {SortKey::kMemory, SortKey::kPeak, SortKey::kPid, SortKey::kUser, SortKey::kJob,
                    SortKey::kRank, SortKey::kOoms, SortKey::kGpu}) {
    EXPECT_EQ(*ParseSortKey(SortKeyName(k)), k);
  }
}

TEST(StrategyText, FixedOrderAndPrefixes) {
  google::protobuf::Map<std::string, int64_t> counts;
  EXPECT_EQ(StrategyText(counts), "-");
  counts["STRATEGY_FP8"] = 2;
  counts["keep"] = 40;
  counts["offload"] = 0;
  counts["recompute"] = 8;
  EXPECT_EQ(StrategyText(counts), "keep 40 rc 8 fp8 2");
}

TEST(FrameLayout, PlainTextHasBarsSparklinesAndRows) {
  const auto frame = TwoGpuFrame();
  History history;
  history.Add(frame);
  LayoutOptions options;
  options.width = 100;
  options.ascii = true;
  options.address = "unix:///tmp/x.sock";
  const std::string text = ToPlainText(LayoutFrame(frame, history, options));
  EXPECT_NE(text.find("unix:///tmp/x.sock"), std::string::npos) << text;
  EXPECT_NE(text.find("2 GPUs, 2 processes"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU 0 GPU-a"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU 1 GPU-b"), std::string::npos) << text;
  EXPECT_NE(text.find("budget 6.00 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("keep 10 rc 4"), std::string::npos) << text;
  EXPECT_NE(text.find("OOMs avoided 0"), std::string::npos) << text;  // wrapped, not cut
  // The spike on GPU 1 (load 2.6) is marked under its sparkline.
  EXPECT_NE(text.find("1 spike"), std::string::npos) << text;
  // Rows sorted by memory: bob (5 GiB) before alice (2 GiB).
  EXPECT_LT(text.find("bob"), text.find("alice")) << text;
  for (size_t pos = 0, end; pos < text.size(); pos = end + 1) {
    end = text.find('\n', pos);
    EXPECT_LE(DisplayWidth(text.substr(pos, end - pos)), 100u) << text.substr(pos, end - pos);
  }
}

TEST(FrameLayout, EmptyFrameSaysSo) {
  History history;
  const std::string text =
      ToPlainText(LayoutFrame(bagualu::v1::WatchResponse(), history, LayoutOptions()));
  EXPECT_NE(text.find("no GPUs"), std::string::npos);
  EXPECT_NE(text.find("(no sessions)"), std::string::npos);
}

TEST(FrameJson, CarriesGpusHistoryAndSortedProcesses) {
  const auto frame = TwoGpuFrame();
  History history;
  history.Add(frame);
  const auto json = FrameToJson(frame, history, SortKey::kPid, false, "unix:///s");
  ASSERT_EQ(json["gpus"].size(), 2u);
  EXPECT_EQ(json["gpus"][0]["budget_bytes"], 6 * kGiB);
  EXPECT_EQ(json["gpus"][1]["history"][0]["spike"], true);
  ASSERT_EQ(json["processes"].size(), 2u);
  EXPECT_EQ(json["processes"][0]["pid"], 100);
  EXPECT_EQ(json["processes"][1]["strategy_counts"]["recompute"], 4);
  EXPECT_EQ(json["sort"], "pid");
}

// Issue 14: the node line, each link's load and each session's host grant and use.
TEST(FrameLayout, ShowsHostGrantsAndLinkLoad) {
  auto frame = TwoGpuFrame();
  frame.set_host_budget_bytes(16 * kGiB);
  for (int g = 0; g < 2; ++g) {
    auto* row = frame.mutable_gpus(g)->mutable_processes(0);
    row->mutable_session()->set_host_grant_bytes(8 * kGiB);
    row->mutable_session()->set_host_used_bytes((g + 1) * kGiB);
    row->set_bandwidth_share(0.5);
    row->set_offloading(true);
    row->mutable_session()->set_link(0);
  }
  auto* link = frame.add_links();
  link->set_link(0);
  link->add_gpus(0);
  link->add_gpus(1);
  link->set_sessions(2);
  link->set_offloading_sessions(2);
  link->set_host_grant_bytes(16 * kGiB);
  link->set_host_used_bytes(3 * kGiB);
  History history;
  history.Add(frame);
  LayoutOptions options;
  options.width = 100;
  options.ascii = true;
  const std::string text = ToPlainText(LayoutFrame(frame, history, options));
  EXPECT_NE(text.find("host budget 16.0 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("link 0 [GPU 0,1]"), std::string::npos) << text;
  EXPECT_NE(text.find("2 offloading"), std::string::npos) << text;
  EXPECT_NE(text.find("host 3.00 GiB/16.0 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("pinned 2.00 GiB of grant 8.00 GiB  link 0  share 0.50  offloading"),
            std::string::npos)
      << text;
  const auto json = FrameToJson(frame, history, SortKey::kPid, false, "unix:///s");
  EXPECT_EQ(json["host_budget_bytes"], 16 * kGiB);
  ASSERT_EQ(json["links"].size(), 1u);
  EXPECT_EQ(json["links"][0]["offloading_sessions"], 2);
  EXPECT_EQ(json["processes"][0]["host_grant_bytes"], 8 * kGiB);
  EXPECT_EQ(json["processes"][0]["bandwidth_share"], 0.5);
}

// Issue 44: planned against actual per process, and the strategy mix of the plans it serves
// (a gate's revision that offloads) rather than the daemon's latest plan (a later forward's,
// keep only); a process that reports none shows "-" and the latest plan's mix.
TEST(FrameLayout, ShowsPlannedAgainstActualAndTheMixInEffect) {
  auto frame = TwoGpuFrame();
  auto* row = frame.mutable_gpus(0)->mutable_processes(0);  // alice: her latest plan keep 10 rc 4
  auto* e = row->mutable_in_effect();
  e->set_micro_batches(3);
  e->set_planned_bytes(int64_t{1536} << 20);
  e->set_actual_bytes(int64_t{1545} << 20);
  e->set_planned_host_bytes(int64_t{200} << 20);
  e->set_actual_host_bytes(int64_t{150} << 20);
  (*e->mutable_strategy_counts())["keep"] = 25;
  (*e->mutable_strategy_counts())["offload"] = 5;
  (*e->mutable_strategy_counts())["recompute"] = 12;
  History history;
  history.Add(frame);
  LayoutOptions options;
  options.width = 120;
  options.ascii = true;
  const std::string text = ToPlainText(LayoutFrame(frame, history, options));
  EXPECT_NE(text.find("PLANNED   ACTUAL"), std::string::npos) << text;
  const size_t alice = text.find("alice");
  ASSERT_NE(alice, std::string::npos) << text;
  const std::string line = text.substr(alice, text.find('\n', alice) - alice);
  EXPECT_NE(line.find("1.50 GiB 1.51 GiB"), std::string::npos) << line;
  EXPECT_NE(line.find("keep 25 rc 12 off 5"), std::string::npos) << line;
  EXPECT_EQ(line.find("keep 10"), std::string::npos) << line;
  EXPECT_NE(text.find("in flight 3 micro-batches  on host planned 200 MiB actual 150 MiB"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("offloading"), std::string::npos) << text;
  // bob reports nothing: dashes, and his latest plan's mix ("-": none).
  const size_t bob = text.find("bob");
  ASSERT_NE(bob, std::string::npos);
  EXPECT_NE(text.substr(bob, text.find('\n', bob) - bob).find(" -        - "), std::string::npos)
      << text;
  for (size_t pos = 0, end; pos < text.size(); pos = end + 1) {
    end = text.find('\n', pos);
    EXPECT_LE(DisplayWidth(text.substr(pos, end - pos)), 120u) << text.substr(pos, end - pos);
  }
  const auto json = FrameToJson(frame, history, SortKey::kPid, false, "unix:///s");
  EXPECT_TRUE(json["processes"][0]["in_effect"].is_null());  // bob
  EXPECT_EQ(json["processes"][1]["in_effect"]["planned_bytes"], int64_t{1536} << 20);
  EXPECT_EQ(json["processes"][1]["in_effect"]["actual_host_bytes"], int64_t{150} << 20);
  EXPECT_EQ(json["processes"][1]["in_effect"]["strategy_counts"]["offload"], 5);
}

TEST(Screen, FitAndTruncateCountCells) {
  EXPECT_EQ(Fit("abc", 5), "abc  ");
  EXPECT_EQ(Fit("abc", 5, true), "  abc");
  EXPECT_EQ(Fit("abcdef", 3), "abc");
  EXPECT_EQ(DisplayWidth("█▒·"), 3u);
  EXPECT_EQ(TruncateCells("█▒·x", 2), "█▒");
  Line line{{"ab", Style::kNormal}, {"█▒", Style::kInUse}};
  EXPECT_EQ(Text(TruncateLine(line, 3)), "ab█");
}

}  // namespace
}  // namespace bgl::top
