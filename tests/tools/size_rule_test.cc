// One byte-size rule (bgl::ParseBytes): the same size string gives the same bytes in every entry
// point where a size is written (BGL_ALLOC_CONF, the allocator's C ABI, the daemon's flags and
// YAML file, model files, bgl-sim's and bglctl's options), and a bare "8G" is refused in each of
// them, the tools included, with the message naming both spellings (tools: exit status 2).
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "allocator/config.h"
#include "base/units.h"
#include "governor/daemon/config.h"
#include "governor/planner/model_config.h"
#include "governor/planner/stage_graph.h"
#include "tools/bgl-sim/options.h"
#include "tools/bglctl/options.h"

namespace bgl {
namespace {

// Sizes every entry point accepts (all small enough for the tightest range, a tensor's bytes).
const std::vector<std::string> kSizes = {"4096", "64KiB", "1.5MiB", "2MB", "3 kib", "0.5GB"};
constexpr const char* kAmbiguous = "'8G' is ambiguous: write 8GiB (2^30 bytes each) or 8GB (10^9)";

// One entry point: the bytes it reads from a size string, or the error message.
struct Read {
  int64_t bytes = -1;
  std::string error;
};
using EntryPoint = std::function<Read(const std::string&)>;

template <typename T>
Read FromResult(const Result<T>& r, const std::function<int64_t(const T&)>& bytes) {
  if (!r.ok()) return {-1, r.status().message()};
  return {bytes(*r), ""};
}

Read AllocConf(const std::string& text) {
  alloc::Config c;
  std::string error;
  if (!alloc::parse_config("capacity:" + text, &c, &error)) return {-1, error};
  return {static_cast<int64_t>(c.capacity), ""};
}

Read AllocCAbi(const std::string& text) {
  // As the Python package calls it: through libbgl_alloc.so.
  static void* lib = dlopen(BGL_ALLOC_SO, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return {-1, std::string("dlopen: ") + dlerror()};
  using ParseFn = int (*)(const char*, const char*, int64_t*);
  using ErrorFn = const char* (*)();
  auto parse = reinterpret_cast<ParseFn>(dlsym(lib, "bgl_parse_bytes"));
  auto error = reinterpret_cast<ErrorFn>(dlsym(lib, "bgl_alloc_last_error"));
  if (parse == nullptr || error == nullptr) return {-1, "bgl_parse_bytes is not exported"};
  int64_t bytes = -1;
  if (parse(text.c_str(), "capacity", &bytes) != 0) return {-1, error()};
  return {bytes, ""};
}

Read DaemonFlag(const std::string& text) {
  return FromResult<gov::DaemonConfig>(
      gov::LoadDaemonConfig("", {{"host_budget_bytes", text}}),
      [](const gov::DaemonConfig& c) { return c.host_budget_bytes; });
}

Read DaemonYaml(const std::string& text) {
  const std::string path = ::testing::TempDir() + "/size_rule_governord.yaml";
  // A budget that covers any floor here, whatever the machine's memory.
  std::ofstream(path) << "host_budget_bytes: 1TiB\nhost_floor_bytes: \"" << text << "\"\n";
  return FromResult<gov::DaemonConfig>(
      gov::LoadDaemonConfig(path, {}),
      [](const gov::DaemonConfig& c) { return c.host_floor_bytes; });
}

nlohmann::json TinyModel() {
  std::ifstream in(BGL_MODELS_DIR "/tiny-moe.json");
  return nlohmann::json::parse(in);
}

Read ModelWorkspace(const std::string& text) {
  nlohmann::json doc = TinyModel();
  doc["workspace"] = text;
  return FromResult<plan::ModelConfig>(
      plan::ModelConfigFromJson(doc, "model.json"),
      [](const plan::ModelConfig& c) { return c.workspace_bytes; });
}

Read LayerGraphTensor(const std::string& text) {
  nlohmann::json doc = TinyModel();
  doc["layer_graph"] = {
      {"operators", {{{"name", "fc"}, {"kind", "linear"}, {"forward_ms", 1}, {"backward_ms", 2}}}},
      {"tensors",
       {{{"name", "x"}, {"bytes", text}, {"block_input", true}, {"consumers", {"fc"}}}}}};
  auto config = plan::ModelConfigFromJson(doc, "model.json");
  if (!config.ok()) return {-1, config.status().message()};
  auto graph = plan::BuildStageGraph(*config, *plan::HardwareProfileByName("h200"));
  if (!graph.ok()) return {-1, graph.status().message()};
  // M0 holds the block input of every layer of the chunk.
  return {static_cast<int64_t>(graph->M0(1.0)) / config->LayersPerChunk(), ""};
}

Read SimCapacity(const std::string& text) {
  return FromResult<sim::SimOptions>(sim::ParseOptions({"--model", "m.json", "--capacity", text}),
                                     [](const sim::SimOptions& o) { return o.capacity_bytes; });
}

Read CtlBudgetStep(const std::string& text) {
  return FromResult<ctl::CtlOptions>(
      ctl::ParseCtlOptions(
          {"plan", "--model", "m.json", "--capacity", "1GiB", "--budget-step", text}),
      [](const ctl::CtlOptions& o) { return o.budget_step_bytes; });
}

const std::vector<std::pair<std::string, EntryPoint>>& EntryPoints() {
  static const std::vector<std::pair<std::string, EntryPoint>> kAll = {
      {"BGL_ALLOC_CONF capacity", AllocConf},
      {"bgl_parse_bytes (libbgl_alloc.so)", AllocCAbi},
      {"bgl-governord --host-budget-bytes", DaemonFlag},
      {"governord.yaml host_floor_bytes", DaemonYaml},
      {"model file workspace", ModelWorkspace},
      {"model file layer_graph tensor bytes", LayerGraphTensor},
      {"bgl-sim --capacity", SimCapacity},
      {"bglctl --budget-step", CtlBudgetStep},
  };
  return kAll;
}

TEST(SizeRule, SameBytesInEveryEntryPoint) {
  for (const std::string& text : kSizes) {
    auto expected = ParseBytes(text, "size");
    ASSERT_TRUE(expected.ok()) << expected.status().message();
    for (const auto& [name, read] : EntryPoints()) {
      const Read r = read(text);
      EXPECT_EQ(r.bytes, *expected) << name << " read '" << text << "': " << r.error;
    }
  }
  EXPECT_EQ(*ParseBytes("1.5MiB", "x"), 3 << 19);
  EXPECT_EQ(*ParseBytes("0.5GB", "x"), 500'000'000);
}

TEST(SizeRule, BareUnitRefusedEverywhereNamingBothSpellings) {
  for (const auto& [name, read] : EntryPoints()) {
    const Read r = read("8G");
    EXPECT_EQ(r.bytes, -1) << name;
    EXPECT_NE(r.error.find(kAmbiguous), std::string::npos) << name << ": " << r.error;
  }
}

// Runs a command line, returning its exit status and what it wrote (stdout and stderr).
std::pair<int, std::string> RunCommand(const std::string& command) {
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(SizeRule, ToolsRefuseABareUnitWithExitStatus2) {
  const std::string model = BGL_MODELS_DIR "/tiny-moe.json";
  const std::string plan = std::string(BGL_PLAN) + " --model " + model + " --load 1 --json";
  const std::vector<std::pair<std::string, std::string>> commands = {
      {"bgl-plan --capacity", plan + " --capacity 8G"},
      {"bgl-plan --budget-step", plan + " --capacity 80GiB --budget-step 8G"},
      {"bgl-sim --capacity", std::string(BGL_SIM) + " --model " + model + " --capacity 8G"},
      {"bglctl --capacity", std::string(BGL_CTL) + " plan --model " + model + " --capacity 8G"},
      {"bgl-replay --conf", std::string(BGL_REPLAY) + " --trace /nonexistent --conf capacity:8G"},
      {"bgl-governord --host-budget-bytes",
       std::string(BGL_GOVERNORD) + " --host-budget-bytes 8G --metrics-port 0"},
  };
  for (const auto& [name, command] : commands) {
    const auto [status, out] = RunCommand(command);
    EXPECT_EQ(status, 2) << name << ": " << out;
    EXPECT_NE(out.find(kAmbiguous), std::string::npos) << name << ": " << out;
  }
}

// Bad input (issue 44): an unknown flag, last on the line or not, is refused by every tool with
// exit status 2 and a message that names it as typed, not as a flag wanting a value.
TEST(ToolMessages, UnknownFlagExitsTwoNamingIt) {
  const std::string model = BGL_MODELS_DIR "/tiny-moe.json";
  const std::vector<std::pair<std::string, std::string>> tools = {
      {"bgl-plan", std::string(BGL_PLAN) + " --model " + model + " --capacity 1GiB --load 1"},
      {"bgl-sim", std::string(BGL_SIM) + " --model " + model},
      {"bglctl", std::string(BGL_CTL)},
      {"bgl-replay", std::string(BGL_REPLAY) + " --trace /nonexistent"},
      {"bgl-top", std::string(BGL_TOP) + " --once"},
      {"bgl-governord", std::string(BGL_GOVERNORD) + " --metrics-port 0"},
  };
  for (const auto& [name, command] : tools) {
    for (const std::string& tail :
         {std::string(" --host-budget"), std::string(" --bogus-flag 1")}) {
      const auto [status, out] = RunCommand(command + tail);
      const std::string flag = tail.substr(1, tail.find(' ', 1) - 1);
      EXPECT_EQ(status, 2) << name << tail << ": " << out;
      EXPECT_NE(out.find("'" + flag + "'"), std::string::npos) << name << tail << ": " << out;
      EXPECT_EQ(out.find(flag + ": needs a value"), std::string::npos)
          << name << tail << ": " << out;
      EXPECT_EQ(out.find(flag + ": missing value"), std::string::npos)
          << name << tail << ": " << out;
    }
  }
}

TEST(SizeRule, BglPlanReadsTheSameBytes) {
  const std::string command = std::string(BGL_PLAN) +
                              " --model " BGL_MODELS_DIR
                              "/tiny-moe.json --load 1 --json --capacity 80GiB";
  const auto [status, out] = RunCommand(command);
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["capacity_bytes"].get<int64_t>(), int64_t{80} << 30);
}

}  // namespace
}  // namespace bgl
