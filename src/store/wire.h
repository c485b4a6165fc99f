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

#include "pinload/convert.h"
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

// Sends one message; strings that are not UTF-8 go with U+FFFD in place of
// their bad bytes, so every reply can be sent. False where the peer is gone
// (EPIPE, ECONNRESET), or with MSG_DONTWAIT in `flags` where it would block;
// throws IoError for any other failure and InvalidArgumentError for a body
// over kStoreMessageBytes.
bool send_message(int socket, const nlohmann::json& body, std::span<const int> fds = {}, int flags = 0);

// Receives one message; nullopt once the peer has closed (or reset) the
// connection. A record that is not a message (truncated, too many
// descriptors, not a JSON object) comes back with `malformed` set and its
// descriptors closed. Retries EINTR; throws IoError for other failures.
std::optional<WireMessage> receive_message(int socket);

// A converted entry's request (Note [Converted store entries] in
// pinload/store.h): the load's dtype options and the file's name prefix.
// On the wire: "dtype": {"to", "keep", "keep_to", "prefix"}.
struct StoreVariant {
  DTypeOptions dtype;
  std::string name_prefix;

  bool active() const noexcept { return dtype.active(); }
  nlohmann::json to_json() const;
  // Throws InvalidArgumentError for a field of the wrong type, an unknown
  // dtype, or more keep patterns (or longer ones) than a load takes.
  static StoreVariant from_json(const nlohmann::json& j);
  // "BF16", "BF16 keep=[a, b] keep_to=F32": the entry's name in status; with
  // the prefix, its key.
  std::string describe() const;
};

// {"ok": false, "error": {...}} for `error`.
nlohmann::json error_reply(const Error& error);
// Throws the pinload::Error a reply carries, if it carries one; a reply that
// is not an object with "ok" is an UnavailableError naming `socket`.
void throw_if_error(const nlohmann::json& reply, const std::string& socket);

}  // namespace pinload::detail
