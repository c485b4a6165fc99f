// Internal: the node store's messages (Note [The node store] in
// pinload/store.h). One message is one SOCK_SEQPACKET record: a JSON object
// of at most kStoreMessageBytes, with up to kStoreMaxFds descriptors
// attached (SCM_RIGHTS). A request names its "op"; a reply has "ok" and,
// when false, "error": {"code": error_code_name, "message", "file"}.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "pinload/env.h"
#include "pinload/error.h"

namespace pinload::detail {

inline constexpr std::size_t kStoreMessageBytes = 64u << 10;
inline constexpr std::size_t kStoreMaxFds = 4;

struct WireMessage {
  nlohmann::json body;        // an object
  std::vector<ScopedFd> fds;  // received descriptors, owned
  std::string malformed;      // why the record is not a message; body is null then
};

// Sends one message. False where the peer is gone (EPIPE, ECONNRESET);
// throws IoError for any other failure and InvalidArgumentError for a body
// over kStoreMessageBytes.
bool send_message(int socket, const nlohmann::json& body, std::span<const int> fds = {});

// Receives one message; nullopt once the peer has closed (or reset) the
// connection. A record that is not a message (truncated, too many
// descriptors, not a JSON object) comes back with `malformed` set and its
// descriptors closed. Retries EINTR; throws IoError for other failures.
std::optional<WireMessage> receive_message(int socket);

// {"ok": false, "error": {...}} for `error`.
nlohmann::json error_reply(const Error& error);
// Throws the pinload::Error a reply carries, if it carries one; a reply that
// is not an object with "ok" is an UnavailableError naming `socket`.
void throw_if_error(const nlohmann::json& reply, const std::string& socket);

}  // namespace pinload::detail
