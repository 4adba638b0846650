// Byte sizes as users write them ("64GiB", "1.5GB", "4096") and as tables print them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace bgl {

// Parses a non-negative byte count, the one size rule of every place a size is written (flags,
// YAML, BGL_ALLOC_CONF, model files, the Python package through bgl_parse_bytes): a bare number
// or B is bytes, KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000 (any case); a
// bare K, M, G or T is refused as ambiguous, with a message naming both spellings. Fractions
// ("1.5GiB") are rounded to whole bytes. `what` names the value in error messages.
Result<int64_t> ParseBytes(std::string_view text, std::string_view what);

// Formats bytes with a binary unit, three significant digits and never more than three integer
// digits ("1.25 GiB"; 1010 MiB reads "0.99 GiB"), so table columns keep their width: the one
// byte formatter of every tool's output and message. `exact` adds the count where the exact
// figure matters ("11.8 GiB (12638097408 bytes)"; under 1000 bytes the count is already exact).
std::string FormatBytes(double bytes, bool exact = false);

// Formats seconds as us or ms, whichever reads better.
std::string FormatSeconds(double seconds);

}  // namespace bgl
