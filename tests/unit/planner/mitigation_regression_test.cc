// No regression (issue 23): on every instance the planner's tests used before issue 23, the
// selection's exposed overhead is at most what the planner of that time chose, recorded in
// data/baseline_overheads.txt. BGL_WRITE_BASELINE=FILE writes the current figures instead.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "governor/planner/mitigation.h"
#include "regression_instances.h"

namespace bgl::plan {
namespace {

TEST(SelectMitigation, NoRegressionAgainstTheRecordedPlans) {
  const std::string data = BGL_PLANNER_TEST_DATA;
  const auto instances = testing::RegressionInstances(BGL_MODELS_DIR, data);
  ASSERT_GE(instances.size(), 1400u);
  if (const char* out = std::getenv("BGL_WRITE_BASELINE")) {
    std::FILE* f = std::fopen(out, "w");
    ASSERT_NE(f, nullptr);
    for (const auto& x : instances) {
      CostEvaluator eval(x.graph, x.hw);
      auto s = SelectMitigation(eval, x.r, x.budget);
      ASSERT_TRUE(s.ok()) << x.label;
      std::fprintf(f, "%.17g\t%s\n", s->cost.exposed_s, x.label.c_str());
    }
    std::fclose(f);
    return;
  }
  std::ifstream in(data + "/baseline_overheads.txt");
  ASSERT_TRUE(in.good());
  std::map<std::string, double> recorded;
  for (std::string line; std::getline(in, line);) {
    const size_t tab = line.find('\t');
    if (tab != std::string::npos) recorded[line.substr(tab + 1)] = std::stod(line.substr(0, tab));
  }
  int better = 0;
  for (const auto& x : instances) {
    auto it = recorded.find(x.label);
    ASSERT_NE(it, recorded.end()) << x.label;
    CostEvaluator eval(x.graph, x.hw);
    auto s = SelectMitigation(eval, x.r, x.budget);
    ASSERT_TRUE(s.ok()) << x.label;
    EXPECT_TRUE(s->fits) << x.label;
    EXPECT_FALSE(s->cost.conflict) << x.label;
    EXPECT_LE(s->cost.exposed_s, it->second * (1 + 1e-9) + 1e-12)
        << x.label << ": " << s->cost.exposed_s << " s, recorded " << it->second << " s";
    better += s->cost.exposed_s < it->second * (1 - 1e-9) ? 1 : 0;
  }
  std::printf("%zu instances, none worse than recorded, %d cheaper\n", instances.size(), better);
}

}  // namespace
}  // namespace bgl::plan
