// BoundErrorMessage: the field name stays, long quoted values are cut with their length, bytes
// that are not printable ASCII are escaped, and the whole message is capped.
#include "governor/service/error_text.h"

#include <gtest/gtest.h>

namespace bgl::gov {
namespace {

TEST(ErrorText, ShortMessagesAreUnchanged) {
  for (const char* m : {"model_json: missing field 'hidden'",
                        "model_json.hidden: 4096 exceeds the daemon's limit 1024",
                        "gate.observed_load_factor: must be in (0, 64], got 65.000000", ""}) {
    EXPECT_EQ(BoundErrorMessage(m), m);
  }
}

TEST(ErrorText, LongQuotedValuesAreCutAndTheFieldKept) {
  const std::string key(100000, 'k');
  const std::string m = BoundErrorMessage("model_json: unknown field '" + key + "' (typo?)");
  EXPECT_EQ(m,
            "model_json: unknown field '" + std::string(40, 'k') + "...' (100000 bytes) (typo?)");
  // Double quotes, an unterminated quote, and a value with a quote inside a word.
  EXPECT_EQ(BoundErrorMessage("f: \"" + std::string(70, 'a') + "\""),
            "f: \"" + std::string(40, 'a') + "...\" (70 bytes)");
  EXPECT_EQ(BoundErrorMessage("f: last read: '" + std::string(70, 'b')),
            "f: last read: '" + std::string(40, 'b') + "... (70 bytes)");
  EXPECT_EQ(BoundErrorMessage("f: 'it's'"), "f: 'it's'");
}

TEST(ErrorText, EscapesAndCapsTheWhole) {
  EXPECT_EQ(BoundErrorMessage("f: bad 'a\nb\x01'"), "f: bad 'a\\x0ab\\x01'");
  std::string many = "f:";
  for (int i = 0; i < 1000; ++i) many += " 'value number " + std::to_string(i) + "'";
  const std::string m = BoundErrorMessage(many);
  EXPECT_LE(m.size(), kMaxErrorMessageBytes);
  EXPECT_EQ(m.rfind("f: 'value number 0'", 0), 0u);
  EXPECT_NE(m.find("bytes cut)"), std::string::npos) << m;
  const std::string binary(1 << 20, '\xff');
  EXPECT_LE(BoundErrorMessage("f: " + binary).size(), kMaxErrorMessageBytes);
  grpc::Status s = BoundErrorStatus({grpc::StatusCode::INVALID_ARGUMENT, "x: '" + binary + "'"});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LE(s.error_message().size(), kMaxErrorMessageBytes);
  EXPECT_TRUE(BoundErrorStatus(grpc::Status::OK).ok());
}

}  // namespace
}  // namespace bgl::gov
