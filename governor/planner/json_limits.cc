#include "governor/planner/json_limits.h"

#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

namespace bgl::plan {
namespace {

constexpr size_t kNoOffset = static_cast<size_t>(-1);

Status TooDeep(const std::string& source, int max_depth, size_t offset, const char* what) {
  const std::string at = offset == kNoOffset ? "" : "at byte " + std::to_string(offset) + "; ";
  return InvalidArgument(source + ": " + what + " nested deeper than " + std::to_string(max_depth) +
                         " levels (" + at + "the limit is max_json_depth)");
}

}  // namespace

Status CheckJsonNesting(std::string_view text, int max_depth, const std::string& source) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return TooDeep(source, max_depth, i, "arrays and objects");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return OkStatus();
}

Status CheckYamlNesting(std::string_view text, int max_depth, const std::string& source) {
  std::vector<size_t> indents;  // block indentation levels open above the current line
  int flow = 0;                 // open [ and { (flow collections may span lines)
  char quote = 0;               // inside '...' or "..." (may span lines)
  size_t line_start = 0;
  while (line_start < text.size()) {
    size_t end = text.find('\n', line_start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view line = text.substr(line_start, end - line_start);
    size_t i = 0;
    if (quote == 0 && flow == 0) {
      while (i < line.size() && line[i] == ' ') ++i;
      const bool blank = i == line.size() || line[i] == '#' || line[i] == '\r';
      if (!blank) {
        while (!indents.empty() && indents.back() > i) indents.pop_back();
        if (indents.empty() || indents.back() < i) indents.push_back(i);
        // Compact nested sequences: every "- " opens one more level on the same line.
        size_t dashes = 0;
        while (i < line.size() && line[i] == '-' &&
               (i + 1 == line.size() || line[i + 1] == ' ' || line[i + 1] == '\t')) {
          ++dashes;
          ++i;
          while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
        }
        if (indents.size() + dashes > static_cast<size_t>(max_depth)) {
          return TooDeep(source, max_depth, line_start + i, "blocks and sequences");
        }
      }
    }
    for (; i < line.size(); ++i) {
      const char c = line[i];
      if (quote != 0) {
        if (quote == '"' && c == '\\') {
          ++i;
        } else if (c == quote) {
          quote = 0;
        }
        continue;
      }
      if (c == '#' && (i == 0 || line[i - 1] == ' ' || line[i - 1] == '\t')) break;
      if (c == '"' || c == '\'') {
        // A quote opens a scalar only at its start; "it's" inside plain text does not.
        if (i == 0 || line[i - 1] == ' ' || line[i - 1] == '[' || line[i - 1] == '{' ||
            line[i - 1] == ',' || line[i - 1] == ':') {
          quote = c;
        }
      } else if (c == '[' || c == '{') {
        if (static_cast<size_t>(++flow) + indents.size() > static_cast<size_t>(max_depth)) {
          return TooDeep(source, max_depth, line_start + i, "flow collections");
        }
      } else if ((c == ']' || c == '}') && flow > 0) {
        --flow;
      }
    }
    line_start = end + 1;
  }
  return OkStatus();
}

Status CheckJsonDepth(const nlohmann::json& doc, int max_depth, const std::string& source) {
  std::vector<std::pair<const nlohmann::json*, int>> pending{{&doc, 0}};
  while (!pending.empty()) {
    auto [value, depth] = pending.back();
    pending.pop_back();
    if (!value->is_structured()) continue;
    if (depth + 1 > max_depth) return TooDeep(source, max_depth, kNoOffset, "arrays and objects");
    for (const auto& child : *value) {
      if (child.is_structured()) pending.emplace_back(&child, depth + 1);
    }
  }
  return OkStatus();
}

}  // namespace bgl::plan
