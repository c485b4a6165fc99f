// Internal: the node store's Unix socket, for the daemon and its clients.
#pragma once

#include <string>

#include "pinload/env.h"

namespace pinload::detail {

struct ListeningSocket {
  ScopedFd fd;
  std::string path;
  ListeningSocket() = default;
  ListeningSocket(ListeningSocket&&) = default;
  ~ListeningSocket();  // unlinks the path it bound
};

// Binds and listens on `path` (SOCK_SEQPACKET) with mode `mode`, creating its
// folder (0755) if missing. A socket file left by a daemon that died (nothing
// answers on it) is replaced; a live daemon on it, or a path that is not a
// socket, is an IoError naming the path.
ListeningSocket listen_on(const std::string& path, unsigned mode);

// Connects to the daemon on `path`; throws UnavailableError naming the path
// and the reason (absent, refused, permission).
ScopedFd connect_to(const std::string& path);

}  // namespace pinload::detail
