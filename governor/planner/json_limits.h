// Nesting limits for model and calibration documents. nlohmann::json and yaml-cpp build and
// print values recursively, so a document nested tens of thousands deep overflows the stack
// (in the parser, in copies, in error messages that print it). These scans are iterative and run
// on the text before anything parses it. Stateless functions: safe from any thread.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "base/status.h"

namespace bgl::plan {

// The default limit of bgl-plan, the C API and the daemon (max_json_depth). Model files nest
// about 5 deep.
inline constexpr int kDefaultMaxJsonDepth = 64;

// Arrays and objects of JSON `text` nested deeper than `max_depth`: INVALID_ARGUMENT naming
// `source`, the limit and the byte offset where it was passed. Does not validate the syntax.
Status CheckJsonNesting(std::string_view text, int max_depth, const std::string& source);
// The same for YAML `text`: flow collections ([, {), block indentation levels and compact
// sequence entries ("- - x") together, an upper bound of the parser's nesting.
Status CheckYamlNesting(std::string_view text, int max_depth, const std::string& source);
// The same for an already parsed value (the C API and callers that build documents), walked
// without recursion.
Status CheckJsonDepth(const nlohmann::json& doc, int max_depth, const std::string& source);

}  // namespace bgl::plan
