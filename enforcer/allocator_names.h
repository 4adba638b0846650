// The allocator's names the enforcer speaks (bgl::enf works on the allocator's pool): its status
// vocabulary (one enum, the C ABIs' bgl_status), streams and events, the pool, and the calling
// thread's error slot.
#pragma once

#include "allocator/backend.h"
#include "allocator/error.h"
#include "allocator/pool.h"

namespace bgl::enf {

using alloc::Event;
using alloc::last_error;
using alloc::Pool;
using alloc::report_error;
using alloc::Status;
using alloc::Stream;

}  // namespace bgl::enf
