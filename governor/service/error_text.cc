#include "governor/service/error_text.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace bgl::gov {
namespace {

constexpr size_t kKeptQuotedBytes = 40;  // what stays of a value longer than the limit

bool Word(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; }

void AppendEscaped(std::string_view text, std::string* out) {
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7f) {
      out->push_back(ch);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out->append(buf);
    }
  }
}

}  // namespace

std::string BoundErrorMessage(std::string_view message, size_t max) {
  std::string out;
  out.reserve(std::min(message.size(), max) + 64);
  size_t i = 0;
  while (i < message.size() && out.size() <= 2 * max) {  // the cap below cuts the rest
    const char q = message[i];
    // A quote opens a value only where a word does not continue ("daemon's" is not a quote).
    const bool opens = (q == '\'' || q == '"') && (i == 0 || !Word(message[i - 1]));
    if (!opens) {
      AppendEscaped(message.substr(i, 1), &out);
      ++i;
      continue;
    }
    // The value ends at the same quote followed by a non-word byte, or at the end.
    size_t end = i + 1;
    while (end < message.size() &&
           !(message[end] == q && (end + 1 == message.size() || !Word(message[end + 1])))) {
      ++end;
    }
    const std::string_view value = message.substr(i + 1, end - i - 1);
    const bool closed = end < message.size();
    out.push_back(q);
    if (value.size() <= kMaxQuotedValueBytes) {
      AppendEscaped(value, &out);
      if (closed) out.push_back(q);
    } else {
      AppendEscaped(value.substr(0, kKeptQuotedBytes), &out);
      out.append("...");
      if (closed) out.push_back(q);
      out.append(" (" + std::to_string(value.size()) + " bytes)");
    }
    i = closed ? end + 1 : end;
  }
  if (out.size() > max) {
    const std::string tail = "... (message of " + std::to_string(message.size()) + " bytes cut)";
    out.resize(max > tail.size() ? max - tail.size() : 0);
    out += tail;
  }
  return out;
}

grpc::Status BoundErrorStatus(const grpc::Status& status) {
  if (status.ok()) return status;
  if (status.error_message().size() <= kMaxQuotedValueBytes) {
    bool plain = true;
    for (char c : status.error_message()) plain &= c >= 0x20 && c < 0x7f;
    if (plain) return status;
  }
  return {status.error_code(), BoundErrorMessage(status.error_message())};
}

}  // namespace bgl::gov
