// Byte sizes as users write them ("64GiB", "1.5GB", "4096") and as tables print them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "base/status.h"

namespace bgl {

// Parses a non-negative byte count with an optional unit: B, KB/MB/GB/TB (powers of 1000),
// KiB/MiB/GiB/TiB (powers of 1024). `what` names the value in error messages.
Result<int64_t> ParseBytes(std::string_view text, std::string_view what);

// Formats bytes with a binary unit, three significant digits ("1.25 GiB").
std::string FormatBytes(double bytes);

// Formats seconds as us or ms, whichever reads better.
std::string FormatSeconds(double seconds);

}  // namespace bgl
