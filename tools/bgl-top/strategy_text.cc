#include "tools/bgl-top/strategy_text.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <vector>

namespace bgl::top {
namespace {

// Lower case without a "strategy_" prefix.
std::string Normalize(const std::string& key) {
  std::string k = key;
  std::transform(k.begin(), k.end(), k.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (k.starts_with("strategy_")) k = k.substr(9);
  return k;
}

}  // namespace

std::string StrategyText(const google::protobuf::Map<std::string, int64_t>& counts) {
  static const std::vector<std::pair<std::string, std::string>> kKnown = {
      {"keep", "keep"}, {"recompute", "rc"}, {"offload", "off"}, {"fp8", "fp8"}};
  std::map<std::string, int64_t> merged;
  for (const auto& [key, n] : counts) merged[Normalize(key)] += n;
  std::string text;
  auto add = [&](const std::string& label, int64_t n) {
    if (n == 0) return;
    if (!text.empty()) text += ' ';
    text += label + " " + std::to_string(n);
  };
  for (const auto& [key, label] : kKnown) {
    auto it = merged.find(key);
    if (it == merged.end()) continue;
    add(label, it->second);
    merged.erase(it);
  }
  for (const auto& [key, n] : merged) add(key, n);
  return text.empty() ? "-" : text;
}

}  // namespace bgl::top
