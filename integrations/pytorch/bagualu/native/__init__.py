"""Native bindings: ctypes declarations of the C ABIs (bgl/alloc.h, bgl/enforce.h, bgl/planner.h)
and the loader of the shared libraries. Nothing here decides anything."""
