// Caller: who is calling the daemon, as read from the connection (SO_PEERCRED on the unix
// socket), never from the request. Authorisation in GovernorCore is decided on this alone.
#pragma once

#include <cstdint>
#include <string>

namespace bgl::gov {

// uid given to callers without credentials (TCP): they see only what they created over TCP.
inline constexpr uint32_t kUnauthenticatedUid = 0xfffffffeu;

struct Caller {
  uint32_t uid = kUnauthenticatedUid;
  int32_t pid = -1;    // -1: unknown (TCP); sessions without a pid are never reaped
  bool admin = false;  // root, the daemon's uid or the admin group: may read every session
  std::string user;    // login name, for dashboards ("" when unknown)
};

}  // namespace bgl::gov
