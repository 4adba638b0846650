// Fault injection (docs/operations.md, "Fault injection"): fails the Nth device, pinned or copy
// operation of the process, or stalls its Nth copy, so tests can check that every failure ends
// cleanly; and the bound on every host-side wait for stream work (BGL_WAIT_TIMEOUT_MS).
// Off unless BGL_FAULT is set or bgl_alloc_fault_configure (bgl/alloc.h) is called.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "allocator/export.h"

namespace bgl::alloc::detail {

// The operations counted. kDevice: the allocator's device memory growth (Backend::map,
// allocate_segment); kPinned: the enforcer's page-locked host allocations (the only host memory
// it takes besides its bookkeeping); kCopy: the enforcer's stream copies and FP8 casts.
enum class FaultKind : int { kDevice = 0, kPinned = 1, kCopy = 2 };
inline constexpr int kFaultKinds = 3;

enum class FaultAction { kNone, kFail, kStall };

// What the current operation of `kind` must do; counts it. One relaxed atomic load when off.
// Thread safe (atomics).
BGL_ALLOC_INTERNAL FaultAction fault_point(FaultKind kind);

// "device:N", "pinned:N", "copy:N" (fail the Nth operation of that kind, counted from 1 after
// this call; "KIND:N+" fails the Nth and every later one), "stall:N" (the Nth copy waits in
// stall() before it runs), several separated by commas; "count" counts without failing; ""
// turns injection off. Resets the counters and releases stalled copies. False with `error`
// naming the bad part. Thread safe.
BGL_ALLOC_INTERNAL bool configure_faults(const std::string& spec, std::string* error);

// What is wrong with BGL_FAULT, BGL_WAIT_TIMEOUT_MS or BGL_FAULT_STALL_MS, naming the variable
// ("" when each is unset, empty or good). Read once per process; a bad value is also printed
// on stderr then, and bgl_enf_create refuses to start with it. Thread safe.
BGL_ALLOC_INTERNAL const std::string& environment_error();

// Operations of `kind` seen since the last configure_faults (0 while injection is off), and
// faults that fired.
BGL_ALLOC_INTERNAL std::uint64_t fault_operations(FaultKind kind);
BGL_ALLOC_INTERNAL std::uint64_t faults_fired();
BGL_ALLOC_INTERNAL const char* fault_kind_name(FaultKind kind);

// Page-locked host blocks handed out and not yet given back, counted by every enforcer's
// FaultInjectingOps whether injection is on or not (the fault sweep's leak check). Thread safe.
BGL_ALLOC_INTERNAL void count_pinned_blocks(int delta);
BGL_ALLOC_INTERNAL std::int64_t pinned_blocks_live();

// The longest a host thread waits for stream work before it reports an error
// (BGL_WAIT_TIMEOUT_MS, default 60000), and how long a stalled copy waits (BGL_FAULT_STALL_MS,
// default twice the wait timeout). Thread safe.
BGL_ALLOC_INTERNAL std::chrono::milliseconds wait_timeout();
BGL_ALLOC_INTERNAL void set_wait_timeout(std::chrono::milliseconds timeout);
BGL_ALLOC_INTERNAL std::chrono::milliseconds stall_duration();
BGL_ALLOC_INTERNAL void set_stall_duration(std::chrono::milliseconds stall);
// A stalled copy's wait: returns after stall_duration() or at release_stalls(), which comes
// first (tests release it when they have seen the bounded wait give up). A release after the
// stall fired in fault_point counts even when it comes before the stream reaches stall().
BGL_ALLOC_INTERNAL void stall();
BGL_ALLOC_INTERNAL void release_stalls();

// "stream work did not complete within 60000 ms (BGL_WAIT_TIMEOUT_MS)": the text of a timeout.
BGL_ALLOC_INTERNAL std::string wait_timeout_message(const char* what);

}  // namespace bgl::alloc::detail
