// UTF-8 validation of text users hand in (model files, configs): a byte sequence that is not
// well-formed UTF-8 is refused where it is read, so no later JSON serialization meets it.
// Thread-safe (no state).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace bgl {

// The offset of the first byte of `text` that does not start a well-formed UTF-8 sequence
// (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF); nullopt when all is.
std::optional<std::size_t> FirstInvalidUtf8(std::string_view text);

}  // namespace bgl
