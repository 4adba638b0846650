// Byte counts as the dashboard prints them: binary units, three significant digits and never
// more than three integer digits ("1010 MiB" reads "0.99 GiB"), so table columns keep their width.
#pragma once

#include <cstdint>
#include <string>

namespace bgl::top {

std::string ShortBytes(int64_t bytes);

}  // namespace bgl::top
