// The C ABI of libbgl_alloc.so: configuration errors, the pluggable pair, stats, snapshot,
// callbacks, wrong-device frees and the last-error message.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bgl/alloc.h"

namespace {

constexpr size_t kMiB = size_t{1} << 20;

std::string snapshot() {
  size_t needed = 0;
  EXPECT_EQ(bgl_alloc_snapshot_json(nullptr, 0, &needed), BGL_ERR_BUFFER_TOO_SMALL);
  std::string buf(needed, '\0');
  EXPECT_EQ(bgl_alloc_snapshot_json(buf.data(), buf.size(), &needed), BGL_OK);
  buf.resize(needed - 1);
  return buf;
}

TEST(CApiTest, BadConfigurationNamesTheKey) {
  EXPECT_EQ(bgl_alloc_configure("backend:host,bogus:1"), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_alloc_last_error()).find("unknown key 'bogus'"), std::string::npos);
  EXPECT_EQ(bgl_alloc_configure("capacity:12parsecs"), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_alloc_last_error()).find("capacity"), std::string::npos);
}

// PyTorch's pluggable allocator asks for 0 bytes for empty tensors: null, no message, no last
// error, not an allocation; counted in num_invalid_size as docs/allocator.md says.
TEST(CApiTest, EmptyAllocationIsNullQuietAndCounted) {
  ASSERT_EQ(bgl_alloc_configure("backend:host,capacity:64MiB,log:false"), BGL_OK);
  bgl_alloc_stats before{};
  ASSERT_EQ(bgl_alloc_get_stats(0, &before), BGL_OK);
  EXPECT_EQ(bgl_alloc_configure("bogus:1"), BGL_ERR_INVALID_ARGUMENT);  // a last error to keep
  const std::string last = bgl_alloc_last_error();
  EXPECT_EQ(bgl_alloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(bgl_alloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(bgl_alloc(0, 99, nullptr), nullptr);  // no such device: nothing to count on
  bgl_free(nullptr, 0, 0, nullptr);
  EXPECT_EQ(std::string(bgl_alloc_last_error()), last);
  bgl_alloc_stats after{};
  ASSERT_EQ(bgl_alloc_get_stats(0, &after), BGL_OK);
  EXPECT_EQ(after.num_invalid_size, before.num_invalid_size + 2);
  EXPECT_EQ(after.num_allocs, before.num_allocs);
  EXPECT_EQ(after.allocations, before.allocations);
}

TEST(CApiTest, PluggablePairStatsSnapshotAndCallbacks) {
  ASSERT_EQ(bgl_alloc_configure("backend:host,devices:2,capacity:256MiB,limit:64MiB,history:100,"
                                "log:false"),
            BGL_OK);
  EXPECT_EQ(bgl_alloc_device_count(), 2);
  std::vector<std::pair<size_t, int>> hook_events;
  int hook = 0;
  ASSERT_EQ(bgl_alloc_add_segment_hook(
                0,
                [](int, void*, size_t bytes, int mapped, void* user) {
                  static_cast<std::vector<std::pair<size_t, int>>*>(user)->emplace_back(bytes,
                                                                                        mapped);
                },
                &hook_events, &hook),
            BGL_OK);
  void* a = bgl_alloc(10 * kMiB, 0, nullptr);
  ASSERT_NE(a, nullptr);
  bgl_alloc_stats st{};
  ASSERT_EQ(bgl_alloc_get_stats(0, &st), BGL_OK);
  EXPECT_EQ(st.allocated_bytes, static_cast<int64_t>(10 * kMiB));
  EXPECT_EQ(st.limit_bytes, 64 * kMiB);
  EXPECT_EQ(bgl_alloc_configure("backend:host"), BGL_ERR_ALREADY_INITIALIZED);

  nlohmann::json j = nlohmann::json::parse(snapshot());
  EXPECT_EQ(j["segments"].size(), 1u);
  EXPECT_EQ(j["device_traces"].size(), 2u);
  EXPECT_EQ(j["segments"][0]["blocks"][0]["state"], "active_allocated");

  // Pressure: the callback frees `a` so a 60 MiB request fits under the 64 MiB limit.
  struct Ctx {
    void* victim;
    size_t asked = 0;
  } ctx{a};
  int cb = 0;
  ASSERT_EQ(bgl_alloc_add_pressure_callback(
                0,
                [](int device, size_t needed, void* user) -> size_t {
                  auto* c = static_cast<Ctx*>(user);
                  c->asked = needed;
                  bgl_free(c->victim, 10 * kMiB, device, nullptr);
                  return 10 * kMiB;
                },
                &ctx, &cb),
            BGL_OK);
  void* big = bgl_alloc(60 * kMiB, 0, nullptr);
  ASSERT_NE(big, nullptr) << bgl_alloc_last_error();
  EXPECT_GT(ctx.asked, 0u);
  ASSERT_EQ(bgl_alloc_remove_pressure_callback(0, cb), BGL_OK);
  EXPECT_EQ(bgl_alloc(60 * kMiB, 0, nullptr), nullptr);
  EXPECT_NE(std::string(bgl_alloc_last_error()).find("out of memory on device 0"),
            std::string::npos);

  // Wrong device: freed by its owner and counted there.
  bgl_free(big, 60 * kMiB, 1, nullptr);
  ASSERT_EQ(bgl_alloc_get_stats(0, &st), BGL_OK);
  EXPECT_EQ(st.num_wrong_device, 1u);
  EXPECT_EQ(st.allocated_bytes, 0);
  EXPECT_EQ(st.num_ooms, 1u);
  bgl_free(big, 60 * kMiB, 0, nullptr);  // now a double free
  ASSERT_EQ(bgl_alloc_get_stats(0, &st), BGL_OK);
  EXPECT_EQ(st.num_double_free, 1u);

  size_t released = 0;
  ASSERT_EQ(bgl_alloc_empty_cache(-1, &released), BGL_OK);
  EXPECT_GT(released, 0u);
  ASSERT_EQ(bgl_alloc_get_stats(0, &st), BGL_OK);
  EXPECT_EQ(st.reserved_bytes, 0);
  size_t mapped = 0, unmapped = 0;
  for (auto [bytes, m] : hook_events) (m ? mapped : unmapped) += bytes;
  EXPECT_EQ(mapped, unmapped);
  EXPECT_GT(mapped, 0u);
  ASSERT_EQ(bgl_alloc_remove_segment_hook(0, hook), BGL_OK);

  char small[8];
  size_t needed = 0;
  EXPECT_EQ(bgl_alloc_stats_json(0, small, sizeof small, &needed), BGL_ERR_BUFFER_TOO_SMALL);
  std::string sj(needed, '\0');
  ASSERT_EQ(bgl_alloc_stats_json(0, sj.data(), sj.size(), &needed), BGL_OK);
  EXPECT_EQ(nlohmann::json::parse(sj.c_str())["num_double_free"], 1);

  EXPECT_EQ(bgl_alloc_get_stats(7, &st), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_alloc_last_error()).find("out of range"), std::string::npos);
  EXPECT_EQ(bgl_alloc(100, 5, nullptr), nullptr);
  EXPECT_EQ(bgl_alloc_configure("backend:host,log:false"), BGL_OK);  // nothing live now
}

TEST(CApiTest, ParseBytesIsTheOneSizeRule) {
  int64_t bytes = -1;
  ASSERT_EQ(bgl_parse_bytes("1.5GiB", "capacity", &bytes), BGL_OK);
  EXPECT_EQ(bytes, int64_t{3} << 29);
  ASSERT_EQ(bgl_parse_bytes("80GB", nullptr, &bytes), BGL_OK);
  EXPECT_EQ(bytes, int64_t{80'000'000'000});
  bytes = 7;
  EXPECT_EQ(bgl_parse_bytes("8G", "capacity", &bytes), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 7);  // unchanged on failure
  EXPECT_NE(std::string(bgl_alloc_last_error())
                .find("capacity: '8G' is ambiguous: write 8GiB (2^30 bytes each) or 8GB (10^9)"),
            std::string::npos)
      << bgl_alloc_last_error();
  EXPECT_EQ(bgl_parse_bytes("lots", nullptr, &bytes), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_alloc_last_error()).find("size: 'lots' is not a size"),
            std::string::npos);
  EXPECT_EQ(bgl_parse_bytes(nullptr, nullptr, &bytes), BGL_ERR_INVALID_ARGUMENT);
}

TEST(CApiTest, StatusNamesRoundTrip) {
  for (int s = BGL_OK; s <= BGL_ERR_INTERNAL; ++s) {
    const char* name = bgl_status_name(s);
    ASSERT_NE(name, nullptr) << s;
    int value = -1;
    ASSERT_EQ(bgl_status_value(name, &value), BGL_OK) << name;
    EXPECT_EQ(value, s);
  }
  EXPECT_STREQ(bgl_status_name(BGL_ERR_BUFFER_TOO_SMALL), "buffer_too_small");
  EXPECT_STREQ(bgl_status_name(BGL_ERR_PINNED_EXHAUSTED), "pinned_exhausted");
  EXPECT_EQ(bgl_status_name(BGL_ERR_INTERNAL + 1), nullptr);
  EXPECT_EQ(bgl_status_name(-1), nullptr);
  int value = 3;
  EXPECT_EQ(bgl_status_value("no_such_status", &value), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(value, 3);
}

}  // namespace
