// The enforcer's C ABI through libbgl_enforce.so (on libbgl_alloc.so's pool), as ctypes calls it.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bgl/enforce.h"

namespace {

class EnforceCApi : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(bgl_alloc_configure("backend:host,capacity:256MiB,page_size:64KiB,log:false"), BGL_OK)
        << bgl_alloc_last_error();
    bgl_enf_options o;
    bgl_enf_default_options(&o);
    o.pinned_capacity = 8 << 20;
    ASSERT_EQ(bgl_enf_create(&o, &enf_), BGL_OK) << bgl_enf_last_error();
    ASSERT_EQ(bgl_enf_stream_create(enf_, &compute_), BGL_OK);
  }
  void TearDown() override {
    bgl_enf_stream_synchronize(enf_, compute_);
    EXPECT_EQ(bgl_enf_destroy(enf_), BGL_OK);
    // The stream is a host stream of the (still live) allocator backend.
    bgl_enforcer* tmp = nullptr;
    bgl_enf_create(nullptr, &tmp);
    bgl_enf_stream_destroy(tmp, compute_);
    bgl_enf_destroy(tmp);
  }

  uint64_t make(size_t bytes, std::vector<uint8_t>* data, int flags = BGL_ENF_OWNED) {
    void* p = bgl_alloc(bytes, 0, compute_);
    EXPECT_NE(p, nullptr);
    data->resize(bytes);
    std::mt19937 rng(static_cast<unsigned>(bytes));
    for (auto& b : *data) b = static_cast<uint8_t>(rng());
    std::memcpy(p, data->data(), bytes);
    bgl_enf_tensor_desc d{};
    d.ptr = p;
    d.bytes = bytes;
    d.dtype = BGL_DTYPE_BYTES;
    d.producer_op = 1;
    d.graph_tensor = 0;
    d.micro_batch = 0;
    d.stream = compute_;
    d.flags = static_cast<uint32_t>(flags);
    uint64_t h = 0;
    EXPECT_EQ(bgl_enf_register(enf_, &d, &h), BGL_OK) << bgl_enf_last_error();
    return h;
  }

  // An F32 saved tensor of operator 3, micro-batch 1, on the compute stream (graph index -1).
  bgl_enf_tensor_desc saved_desc(void* p, std::size_t bytes) const {
    bgl_enf_tensor_desc d{};
    d.ptr = p;
    d.bytes = bytes;
    d.dtype = BGL_DTYPE_F32;
    d.producer_op = 3;
    d.graph_tensor = -1;
    d.micro_batch = 1;
    d.stream = compute_;
    return d;
  }

  // A tensor registered by a *_saved call whose move failed: on the device; then forgotten.
  void expect_left_on_device(uint64_t h) {
    ASSERT_NE(h, 0u);
    bgl_enf_tensor_info info;
    ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
    EXPECT_EQ(info.placement, BGL_PLACE_DEVICE);
    ASSERT_EQ(bgl_enf_unregister(enf_, h), BGL_OK);
  }

  // `saved(desc, handle)`, the *_saved function `fn`, given dtype 17 and a null description:
  // nothing registered, the handle zeroed, the error naming `fn`.
  template <class Saved>
  void expect_bad_description_rejected(bgl_enf_tensor_desc d, const std::string& fn, Saved saved) {
    uint64_t h = 99;
    d.dtype = 17;
    EXPECT_EQ(saved(&d, &h), BGL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(h, 0u);
    EXPECT_NE(std::string(bgl_enf_last_error()).find(fn + ": dtype 17"), std::string::npos)
        << bgl_enf_last_error();
    EXPECT_EQ(saved(nullptr, &h), BGL_ERR_INVALID_ARGUMENT);
  }

  bgl_enforcer* enf_ = nullptr;
  void* compute_ = nullptr;
};

TEST_F(EnforceCApi, OffloadAcquireReleaseRoundTrip) {
  std::vector<uint8_t> data;
  const uint64_t h = make(123457, &data);
  ASSERT_EQ(bgl_enf_add_consumer(enf_, h, 4), BGL_OK);
  ASSERT_EQ(bgl_enf_offload(enf_, h), BGL_OK);
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
  EXPECT_EQ(info.placement, BGL_PLACE_HOST);
  EXPECT_EQ(info.applied, BGL_STRATEGY_OFFLOAD);
  void* p = nullptr;
  ASSERT_EQ(bgl_enf_acquire(enf_, h, 4, compute_, &p), BGL_OK);
  ASSERT_EQ(bgl_enf_stream_synchronize(enf_, compute_), BGL_OK);
  EXPECT_EQ(std::memcmp(p, data.data(), data.size()), 0);
  uint64_t found = 0;
  ASSERT_EQ(bgl_enf_lookup(enf_, p, &found), BGL_OK);
  EXPECT_EQ(found, h);
  ASSERT_EQ(bgl_enf_release(enf_, h, 4, compute_), BGL_OK);
  bgl_enf_stats s;
  ASSERT_EQ(bgl_enf_get_stats(enf_, &s), BGL_OK);
  EXPECT_EQ(s.offloads, 1u);
  EXPECT_EQ(s.reloads, 1u);
  EXPECT_EQ(s.tracked, 0u);
}

TEST_F(EnforceCApi, EnumValuesAreThePlannersNames) {
  int v = -1;
  ASSERT_EQ(bgl_enf_enum_value("strategy", "fp8", &v), BGL_OK);
  EXPECT_EQ(v, BGL_STRATEGY_FP8);
  ASSERT_EQ(bgl_enf_enum_value("strategy", "offload", &v), BGL_OK);
  EXPECT_EQ(v, BGL_STRATEGY_OFFLOAD);
  ASSERT_EQ(bgl_enf_enum_value("chain", "R", &v), BGL_OK);
  EXPECT_EQ(v, BGL_CHAIN_RECOVER);
  ASSERT_EQ(bgl_enf_enum_value("resource", "h2d", &v), BGL_OK);
  EXPECT_EQ(v, BGL_RES_H2D);
  v = 7;
  EXPECT_EQ(bgl_enf_enum_value("strategy", "swap", &v), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("'swap'"), std::string::npos);
  EXPECT_EQ(bgl_enf_enum_value("colour", "red", &v), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bgl_enf_enum_value(nullptr, "fp8", &v), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(v, 7);  // unchanged on failure
}

TEST_F(EnforceCApi, EveryNameOfTheVocabularyRoundTrips) {
  const struct {
    const char* kind;
    int count;
  } kinds[] = {{"strategy", BGL_STRATEGY_FP8 + 1}, {"chain", BGL_CHAIN_RECOVER + 1},
               {"resource", BGL_RES_H2D + 1},      {"placement", BGL_PLACE_DROPPED + 1},
               {"dtype", BGL_DTYPE_BYTES + 1},     {"status", BGL_ERR_INTERNAL + 1}};
  for (const auto& k : kinds) {
    for (int i = 0; i < k.count; ++i) {
      const char* name = nullptr;
      ASSERT_EQ(bgl_enf_enum_name(k.kind, i, &name), BGL_OK) << k.kind << " " << i;
      int v = -1;
      ASSERT_EQ(bgl_enf_enum_value(k.kind, name, &v), BGL_OK) << k.kind << " " << name;
      EXPECT_EQ(v, i) << k.kind << " " << name;
    }
    const char* name = "unchanged";
    EXPECT_EQ(bgl_enf_enum_name(k.kind, k.count, &name), BGL_ERR_INVALID_ARGUMENT) << k.kind;
    EXPECT_STREQ(name, "unchanged");
  }
  const char* name = nullptr;
  ASSERT_EQ(bgl_enf_enum_name("placement", BGL_PLACE_HOST, &name), BGL_OK);
  EXPECT_STREQ(name, "host");
  ASSERT_EQ(bgl_enf_enum_name("dtype", BGL_DTYPE_BF16, &name), BGL_OK);
  EXPECT_STREQ(name, "bf16");
  ASSERT_EQ(bgl_enf_enum_name("status", BGL_ERR_DUPLICATE, &name), BGL_OK);
  EXPECT_STREQ(name, bgl_status_name(BGL_ERR_DUPLICATE));
  EXPECT_EQ(bgl_enf_enum_name("colour", 0, &name), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("placement"), std::string::npos);
}

TEST_F(EnforceCApi, NullArgumentsAreRefusedNamingTheCall) {
  EXPECT_EQ(bgl_enf_query(enf_, 1, nullptr), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("bgl_enf_query: null argument"),
            std::string::npos);
  EXPECT_EQ(bgl_enf_get_stats(nullptr, nullptr), BGL_ERR_INVALID_ARGUMENT);
  bgl_enf_stats s;
  EXPECT_EQ(bgl_enf_get_stats(nullptr, &s), BGL_ERR_UNKNOWN_HANDLE);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("bgl_enf_get_stats: unknown enforcer handle"),
            std::string::npos);
}

// One call registers the tensor with its need order and consumers (repeats once), as the
// package's pack hook does; a second registration of the pointer is a duplicate.
TEST_F(EnforceCApi, RegisterSavedSetsNeedOrderAndConsumersInOneCall) {
  void* p = bgl_alloc(4096, 0, compute_);
  ASSERT_NE(p, nullptr);
  bgl_enf_tensor_desc d{};
  d.ptr = p;
  d.bytes = 4096;
  d.dtype = BGL_DTYPE_F32;
  d.producer_op = 3;
  d.graph_tensor = -1;
  d.micro_batch = 2;
  d.stream = compute_;
  const int consumers[3] = {7, 9, 7};
  uint64_t h = 0;
  ASSERT_EQ(bgl_enf_register_saved(enf_, &d, 12345, consumers, 3, &h), BGL_OK)
      << bgl_enf_last_error();
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
  EXPECT_EQ(info.need_order, 12345);
  EXPECT_EQ(info.num_consumers, 2);
  EXPECT_EQ(bgl_enf_add_consumer(enf_, h, 9), BGL_ERR_DUPLICATE);
  uint64_t h2 = 0;
  EXPECT_EQ(bgl_enf_register_saved(enf_, &d, 0, nullptr, 0, &h2), BGL_ERR_DUPLICATE);
  d.dtype = 17;
  d.ptr = static_cast<char*>(p) + 64;
  EXPECT_EQ(bgl_enf_register_saved(enf_, &d, 0, nullptr, 0, &h2), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("bgl_enf_register_saved: dtype 17"),
            std::string::npos);
  EXPECT_EQ(bgl_enf_register_saved(enf_, &d, 0, nullptr, 2, &h2), BGL_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(bgl_enf_unregister(enf_, h), BGL_OK);
  bgl_free(p, 4096, 0, compute_);
}

// bgl_enf_offload_saved: registration and offload in one call; a failed offload (the pinned
// pool is full) leaves the tensor registered on the device, its handle returned with the
// error; a failed registration leaves nothing.
TEST_F(EnforceCApi, OffloadSavedRegistersAndOffloadsInOneCall) {
  auto desc = [&](void* p, std::size_t bytes) { return saved_desc(p, bytes); };
  void* p = bgl_alloc(4096, 0, compute_);
  ASSERT_NE(p, nullptr);
  std::memset(p, 0x5a, 4096);
  bgl_enf_tensor_desc d = desc(p, 4096);
  const int consumers[1] = {4};
  uint64_t h = 0;
  ASSERT_EQ(bgl_enf_offload_saved(enf_, &d, 77, consumers, 1, &h), BGL_OK) << bgl_enf_last_error();
  ASSERT_EQ(bgl_enf_wait_tensor(enf_, h), BGL_OK);
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
  EXPECT_EQ(info.placement, BGL_PLACE_HOST);
  EXPECT_EQ(info.need_order, 77);
  EXPECT_EQ(info.num_consumers, 1);

  // Larger than the pinned pool (8 MiB): registered, left on the device, the error returned.
  const std::size_t big = 16 << 20;
  void* q = bgl_alloc(big, 0, compute_);
  ASSERT_NE(q, nullptr);
  bgl_enf_tensor_desc dq = desc(q, big);
  uint64_t hq = 0;
  EXPECT_NE(bgl_enf_offload_saved(enf_, &dq, 0, nullptr, 0, &hq), BGL_OK);
  expect_left_on_device(hq);

  expect_bad_description_rejected(dq, "bgl_enf_offload_saved",
                                  [&](const bgl_enf_tensor_desc* desc, uint64_t* out) {
                                    return bgl_enf_offload_saved(enf_, desc, 0, nullptr, 0, out);
                                  });
  ASSERT_EQ(bgl_enf_unregister(enf_, h), BGL_OK);
  bgl_free(q, big, 0, compute_);
  bgl_free(p, 4096, 0, compute_);
}

// bgl_enf_store_fp8_saved: registration and FP8 cast in one call, the FP8 buffer's bytes
// returned (as bgl_enf_query tells them), the data back within e4m3's error; a failed cast (a
// dtype FP8 does not take) leaves the tensor registered on the device with its handle and the
// error; a failed registration leaves nothing.
TEST_F(EnforceCApi, StoreFp8SavedRegistersAndCastsInOneCall) {
  std::vector<float> data(4096);
  std::mt19937 rng(11);
  for (auto& x : data) x = static_cast<float>(rng() % 1000) / 7.0f;
  const size_t bytes = data.size() * sizeof(float);
  void* p = bgl_alloc(bytes, 0, compute_);
  ASSERT_NE(p, nullptr);
  std::memcpy(p, data.data(), bytes);
  bgl_enf_tensor_desc d = saved_desc(p, bytes);
  const int consumers[2] = {4, 5};
  uint64_t h = 0;
  size_t fp8_bytes = 0;
  ASSERT_EQ(bgl_enf_store_fp8_saved(enf_, &d, 77, consumers, 2, &h, &fp8_bytes), BGL_OK)
      << bgl_enf_last_error();
  ASSERT_NE(h, 0u);
  ASSERT_EQ(bgl_enf_wait_tensor(enf_, h), BGL_OK);
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
  EXPECT_EQ(info.placement, BGL_PLACE_FP8);
  EXPECT_EQ(info.need_order, 77);
  EXPECT_EQ(info.num_consumers, 2);
  EXPECT_EQ(fp8_bytes, info.fp8_bytes);
  EXPECT_GE(fp8_bytes, data.size());  // a byte per element, plus the scales
  EXPECT_LT(fp8_bytes, bytes);
  void* back = nullptr;
  ASSERT_EQ(bgl_enf_acquire(enf_, h, 4, compute_, &back), BGL_OK) << bgl_enf_last_error();
  ASSERT_EQ(bgl_enf_stream_synchronize(enf_, compute_), BGL_OK);
  const float* f = static_cast<const float*>(back);
  for (size_t i = 0; i < data.size(); ++i) ASSERT_NEAR(f[i], data[i], data[i] / 8 + 1e-3);
  ASSERT_EQ(bgl_enf_release(enf_, h, 4, compute_), BGL_OK);
  ASSERT_EQ(bgl_enf_unregister(enf_, h), BGL_OK);

  // Bytes are not a dtype FP8 takes: registered, left on the device, the cast's error returned
  // (the bytes out untouched; null is allowed).
  void* q = bgl_alloc(4096, 0, compute_);
  ASSERT_NE(q, nullptr);
  bgl_enf_tensor_desc dq = d;
  dq.ptr = q;
  dq.bytes = 4096;
  dq.dtype = BGL_DTYPE_BYTES;
  uint64_t hq = 0;
  fp8_bytes = 123;
  EXPECT_EQ(bgl_enf_store_fp8_saved(enf_, &dq, 0, nullptr, 0, &hq, &fp8_bytes),
            BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("FP8 needs an F32/F16/BF16 tensor"),
            std::string::npos)
      << bgl_enf_last_error();
  EXPECT_EQ(fp8_bytes, 123u);
  expect_left_on_device(hq);

  expect_bad_description_rejected(
      dq, "bgl_enf_store_fp8_saved", [&](const bgl_enf_tensor_desc* desc, uint64_t* out) {
        return bgl_enf_store_fp8_saved(enf_, desc, 0, nullptr, 0, out, nullptr);
      });
  bgl_free(q, 4096, 0, compute_);
  bgl_free(p, bytes, 0, compute_);
}

// sync_copies on the host backend: copies and casts run on the calling thread, so an offload,
// a reload and an FP8 round trip are complete when the call returns (nothing pending) and the
// data comes back bit for bit.
TEST_F(EnforceCApi, SyncCopiesCompleteInTheCall) {
  bgl_enf_options o;
  bgl_enf_default_options(&o);
  o.pinned_capacity = 8 << 20;
  o.sync_copies = 1;
  bgl_enforcer* sync = nullptr;
  ASSERT_EQ(bgl_enf_create(&o, &sync), BGL_OK) << bgl_enf_last_error();
  std::vector<float> data(40000);
  std::mt19937 rng(7);
  for (auto& x : data) x = static_cast<float>(rng() % 1000) / 7.0f;
  const size_t bytes = data.size() * sizeof(float);
  for (int strategy : {BGL_STRATEGY_OFFLOAD, BGL_STRATEGY_FP8}) {
    void* p = bgl_alloc(bytes, 0, nullptr);
    ASSERT_NE(p, nullptr);
    std::memcpy(p, data.data(), bytes);
    bgl_enf_tensor_desc d{};
    d.ptr = p;
    d.bytes = bytes;
    d.dtype = BGL_DTYPE_F32;
    d.graph_tensor = -1;
    d.flags = BGL_ENF_OWNED;
    uint64_t h = 0;
    ASSERT_EQ(bgl_enf_register(sync, &d, &h), BGL_OK) << bgl_enf_last_error();
    ASSERT_EQ(bgl_enf_apply(sync, h, strategy), BGL_OK) << bgl_enf_last_error();
    bgl_enf_tensor_info info;
    ASSERT_EQ(bgl_enf_query(sync, h, &info), BGL_OK);
    EXPECT_EQ(info.pending, 0);
    void* back = nullptr;
    ASSERT_EQ(bgl_enf_acquire(sync, h, -1, nullptr, &back), BGL_OK) << bgl_enf_last_error();
    ASSERT_EQ(bgl_enf_query(sync, h, &info), BGL_OK);
    EXPECT_EQ(info.pending, 0);
    if (strategy == BGL_STRATEGY_OFFLOAD) {
      EXPECT_EQ(std::memcmp(back, data.data(), bytes), 0);
    } else {  // FP8: within e4m3's error of the data
      const float* f = static_cast<const float*>(back);
      for (size_t i = 0; i < data.size(); ++i) ASSERT_NEAR(f[i], data[i], data[i] / 8 + 1e-3);
    }
    ASSERT_EQ(bgl_enf_unregister(sync, h), BGL_OK);
  }
  EXPECT_EQ(bgl_enf_destroy(sync), BGL_OK);
}

TEST_F(EnforceCApi, ErrorsHaveCodesAndMessages) {
  std::vector<uint8_t> data;
  const uint64_t h = make(16 << 20, &data);  // larger than the 8 MiB pinned pool
  EXPECT_EQ(bgl_enf_offload(enf_, h + 7), BGL_ERR_UNKNOWN_HANDLE);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("unknown tensor handle"), std::string::npos);
  EXPECT_EQ(bgl_enf_reload(enf_, h), BGL_ERR_INVALID_STATE);
  EXPECT_EQ(bgl_enf_offload(enf_, h), BGL_ERR_PINNED_EXHAUSTED);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("pinned"), std::string::npos);
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(enf_, h, &info), BGL_OK);
  bgl_enf_tensor_desc d{};
  d.ptr = info.device_ptr;
  d.bytes = 16;
  d.stream = compute_;
  uint64_t h2 = 0;
  EXPECT_EQ(bgl_enf_register(enf_, &d, &h2), BGL_ERR_DUPLICATE);
  EXPECT_EQ(bgl_enf_apply(enf_, h, 9), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bgl_enf_offload(reinterpret_cast<bgl_enforcer*>(&d), h), BGL_ERR_UNKNOWN_HANDLE);
  bgl_enf_issue_item bad[2] = {{BGL_CHAIN_OFFLOAD, 1, 0, BGL_RES_D2H, 0, 0},
                               {BGL_CHAIN_OFFLOAD, 0, 0, BGL_RES_D2H, 0, 0}};
  EXPECT_EQ(bgl_enf_schedule_begin(enf_, bad, 2, 0, 1), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bgl_enf_unregister(enf_, h), BGL_OK);
}

int g_calls = 0;
std::vector<uint8_t>* g_data = nullptr;
void* g_stream = nullptr;

int recompute(uint64_t, int producer, int micro_batch, void*, void** out) {
  ++g_calls;
  EXPECT_EQ(producer, 1);
  EXPECT_EQ(micro_batch, 0);
  *out = bgl_alloc(g_data->size(), 0, g_stream);
  std::memcpy(*out, g_data->data(), g_data->size());
  return 0;
}

TEST_F(EnforceCApi, ScheduleRecomputesAndFp8RoundTrip) {
  std::vector<uint8_t> data;
  const uint64_t h = make(8192, &data);
  g_data = &data;
  g_stream = compute_;
  ASSERT_EQ(bgl_enf_set_recompute_callback(enf_, recompute, nullptr), BGL_OK);
  ASSERT_EQ(bgl_enf_apply(enf_, h, BGL_STRATEGY_RECOMPUTE), BGL_OK);
  bgl_enf_issue_item order[2] = {{BGL_CHAIN_BACKWARD, 0, 0, BGL_RES_COMPUTE, 5, 5},
                                 {BGL_CHAIN_RECOVER, 0, 0, BGL_RES_COMPUTE, 0, 3}};
  ASSERT_EQ(bgl_enf_schedule_begin(enf_, order, 2, -1, 0), BGL_OK);
  // The backward's stage 0 runs from operator 5 down: an unpack of operator 6's output (the
  // backward has not reached the stage) issues nothing, one of operator 5's the recompute.
  int passed = -1;
  ASSERT_EQ(bgl_enf_schedule_at(enf_, BGL_CHAIN_BACKWARD, 6, &passed), BGL_OK);
  EXPECT_EQ(passed, 0);
  ASSERT_EQ(bgl_enf_schedule_at(enf_, BGL_CHAIN_BACKWARD, -1, nullptr), BGL_OK);
  ASSERT_EQ(bgl_enf_schedule_at(enf_, BGL_CHAIN_BACKWARD, 5, &passed), BGL_OK);
  EXPECT_EQ(passed, 1);
  ASSERT_EQ(bgl_enf_schedule_at(enf_, BGL_CHAIN_BACKWARD, 4, &passed), BGL_OK);
  EXPECT_EQ(passed, 0);
  EXPECT_EQ(bgl_enf_schedule_at(enf_, BGL_CHAIN_RECOVER, 4, &passed), BGL_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(bgl_enf_last_error()).find("schedule_at: chain must be"), std::string::npos)
      << bgl_enf_last_error();
  EXPECT_EQ(
      bgl_enf_schedule_at(reinterpret_cast<bgl_enforcer*>(&passed), BGL_CHAIN_FORWARD, 0, &passed),
      BGL_ERR_UNKNOWN_HANDLE);
  ASSERT_EQ(bgl_enf_schedule_finish(enf_), BGL_OK);
  EXPECT_EQ(g_calls, 1);
  void* p = nullptr;
  ASSERT_EQ(bgl_enf_acquire(enf_, h, -1, compute_, &p), BGL_OK);
  bgl_enf_stream_synchronize(enf_, compute_);
  EXPECT_EQ(std::memcmp(p, data.data(), data.size()), 0);
  EXPECT_EQ(g_calls, 1);
  ASSERT_EQ(bgl_enf_release(enf_, h, -1, compute_), BGL_OK);

  // FP32 tensor through FP8 and back: within the e4m3 bound.
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i)) * 10.0f;
  void* fp = bgl_alloc(x.size() * 4, 0, compute_);
  std::memcpy(fp, x.data(), x.size() * 4);
  bgl_enf_tensor_desc d{};
  d.ptr = fp;
  d.bytes = x.size() * 4;
  d.dtype = BGL_DTYPE_F32;
  d.stream = compute_;
  d.flags = BGL_ENF_OWNED;
  uint64_t hf = 0;
  ASSERT_EQ(bgl_enf_register(enf_, &d, &hf), BGL_OK);
  size_t bytes = 0, count = 0;
  ASSERT_EQ(bgl_enf_movable(enf_, 0, BGL_STRATEGY_FP8, &bytes, &count), BGL_OK);
  EXPECT_EQ(count, 1u);
  EXPECT_EQ(bytes, 4000u - (1008u + 8 * 4));
  ASSERT_EQ(bgl_enf_store_fp8(enf_, hf), BGL_OK);
  ASSERT_EQ(bgl_enf_acquire(enf_, hf, -1, compute_, &p), BGL_OK);
  bgl_enf_stream_synchronize(enf_, compute_);
  const float* y = static_cast<const float*>(p);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_LE(std::fabs(x[i] - y[i]), std::fabs(x[i]) / 16 + 10.0f / 448 / 1024 + 1e-6f) << i;
  }
  ASSERT_EQ(bgl_enf_release(enf_, hf, -1, compute_), BGL_OK);
}

}  // namespace

namespace {

// An emulated device link (docs/planner.md, "An emulated device link"): a calibration with an
// "emulated_link" section makes the host backend's copies take its rooflines' time, and
// anything else in its place is refused by name, the process going on.
TEST(EnforceCApiEmulatedLink, ACalibrationWithALinkSectionIsTakenAndBadOnesAreNamed) {
  ASSERT_EQ(bgl_alloc_configure("backend:host,capacity:64MiB,page_size:64KiB,log:false"), BGL_OK)
      << bgl_alloc_last_error();
  const char* good =
      R"({"gpu": "host", "rooflines": {"offload": {"peak_GBps": 0.001, "launch_floor_us": 9},
          "reload": {"peak_GBps": 0.001, "launch_floor_us": 9}}, "copy_overlap": 1,
          "emulated_link": {"stands_for": "H200 over PCIe Gen5", "compute_scale": 8e-5}})";
  bgl_enf_options o;
  bgl_enf_default_options(&o);
  EXPECT_EQ(o.emulated_link, nullptr);
  o.pinned_capacity = 8 << 20;
  o.emulated_link = good;
  bgl_enforcer* e = nullptr;
  ASSERT_EQ(bgl_enf_create(&o, &e), BGL_OK) << bgl_enf_last_error();
  // 400 KB over 1 MB/s: 0.4 s between the offload's issue and its completion.
  std::vector<uint8_t> data(400000, 7);
  void* p = bgl_alloc(data.size(), 0, nullptr);
  ASSERT_NE(p, nullptr);
  std::memcpy(p, data.data(), data.size());
  bgl_enf_tensor_desc d{};
  d.ptr = p;
  d.bytes = data.size();
  d.dtype = BGL_DTYPE_BYTES;
  d.graph_tensor = -1;
  d.flags = BGL_ENF_OWNED;
  uint64_t h = 0;
  ASSERT_EQ(bgl_enf_register(e, &d, &h), BGL_OK) << bgl_enf_last_error();
  ASSERT_EQ(bgl_enf_apply(e, h, BGL_STRATEGY_OFFLOAD), BGL_OK) << bgl_enf_last_error();
  bgl_enf_tensor_info info;
  ASSERT_EQ(bgl_enf_query(e, h, &info), BGL_OK);
  EXPECT_EQ(info.pending, 1);  // on the copy thread, still on the emulated link
  void* back = nullptr;
  ASSERT_EQ(bgl_enf_acquire(e, h, -1, nullptr, &back), BGL_OK) << bgl_enf_last_error();
  EXPECT_EQ(std::memcmp(back, data.data(), data.size()), 0);
  EXPECT_EQ(bgl_enf_destroy(e), BGL_OK);

  struct Bad {
    std::string doc;
    int sync;
    const char* says;
  };
  const Bad bad[] = {
      {"{", 0, "not valid JSON"},
      {R"({"gpu": "host"})", 0, "no 'emulated_link' section"},
      {R"({"emulated_link": {"stands_for": "x"}})", 0, "lacks 'compute_scale'"},
      {R"({"emulated_link": {"stands_for": "x", "compute_scale": 1e-3, "speed": 1}})", 0,
       "unknown key 'emulated_link.speed'"},
      {R"({"emulated_link": {"stands_for": "x", "compute_scale": 0}})", 0, "compute_scale"},
      {R"({"emulated_link": {"stands_for": 3, "compute_scale": 1e-3}})", 0, "stands_for"},
      {R"({"emulated_link": {"stands_for": "x", "compute_scale": 1e-3}})", 1, "sync_copies"},
      {std::string(100, '[') + std::string(100, ']'), 0, "nest"},
  };
  for (const Bad& b : bad) {
    o.emulated_link = b.doc.c_str();
    o.sync_copies = b.sync;
    bgl_enforcer* none = nullptr;
    EXPECT_EQ(bgl_enf_create(&o, &none), BGL_ERR_INVALID_ARGUMENT) << b.doc;
    EXPECT_EQ(none, nullptr);
    const std::string err = bgl_enf_last_error();
    EXPECT_NE(err.find("emulated_link"), std::string::npos) << err;
    EXPECT_NE(err.find(b.says), std::string::npos) << err;
  }
}

}  // namespace
