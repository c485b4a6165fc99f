#include "store/wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace pinload::detail {

bool send_message(int socket, const nlohmann::json& body, std::span<const int> fds, int flags) {
  // Any message can be sent: a string that is not UTF-8 (bytes a file or a server put in an error
  // that nothing escaped) is written with U+FFFD in their place instead of throwing.
  const std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (text.size() > kStoreMessageBytes) {
    throw InvalidArgumentError("store message of " + std::to_string(text.size()) + " bytes is over the " +
                               std::to_string(kStoreMessageBytes) + "-byte limit");
  }
  if (fds.size() > kStoreMaxFds) throw InvalidArgumentError("too many descriptors for one store message");
  iovec iov{const_cast<char*>(text.data()), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kStoreMaxFds)] = {};
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    if (::sendmsg(socket, &msg, MSG_NOSIGNAL | flags) >= 0) return true;
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) return false;
    if ((flags & MSG_DONTWAIT) != 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    throw IoError(std::string("sending a store message failed: ") + std::strerror(errno));
  }
}

std::optional<WireMessage> receive_message(int socket) {
  std::string text(kStoreMessageBytes + 1, '\0');
  iovec iov{text.data(), text.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kStoreMaxFds)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  for (;;) {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0) break;
    if (errno == EINTR) continue;
    if (errno == ECONNRESET) return std::nullopt;
    if (errno == EAGAIN || errno == EWOULDBLOCK) throw IoError("the store did not answer in time");
    throw IoError(std::string("receiving a store message failed: ") + std::strerror(errno));
  }
  WireMessage out;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      out.fds.emplace_back(default_env(), fd);
    }
  }
  // An empty record with nothing attached is the peer's orderly close.
  if (n == 0 && out.fds.empty() && (msg.msg_flags & MSG_CTRUNC) == 0) return std::nullopt;
  auto refuse = [&](std::string why) {
    out.fds.clear();
    out.body = nullptr;
    out.malformed = std::move(why);
    return std::optional<WireMessage>(std::move(out));
  };
  if ((msg.msg_flags & MSG_TRUNC) != 0 || static_cast<std::size_t>(n) > kStoreMessageBytes) {
    return refuse("a message over " + std::to_string(kStoreMessageBytes) + " bytes");
  }
  if ((msg.msg_flags & MSG_CTRUNC) != 0) return refuse("more than " + std::to_string(kStoreMaxFds) + " descriptors");
  text.resize(static_cast<std::size_t>(n));
  out.body = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (out.body.is_discarded() || !out.body.is_object()) return refuse("not a JSON object");
  return out;
}

nlohmann::json StoreVariant::to_json() const {
  nlohmann::json j = {{"to", std::string(dtype_name(*dtype.to))}, {"keep", dtype.keep}, {"prefix", name_prefix}};
  if (dtype.keep_to) j["keep_to"] = std::string(dtype_name(*dtype.keep_to));
  return j;
}

StoreVariant StoreVariant::from_json(const nlohmann::json& j) {
  constexpr std::size_t kMaxPatterns = 4096, kMaxPatternBytes = 4096;
  if (!j.is_object()) throw InvalidArgumentError("\"dtype\" must be an object");
  const auto dtype_of = [&](const char* field) -> std::optional<DType> {
    const auto it = j.find(field);
    if (it == j.end() || it->is_null()) return std::nullopt;
    const std::optional<DType> d = it->is_string() ? dtype_from_name(it->get_ref<const std::string&>()) : std::nullopt;
    if (!d || !is_float_dtype(*d)) throw InvalidArgumentError(std::string("\"dtype\": \"") + field + "\" is no floating dtype");
    return d;
  };
  StoreVariant v;
  v.dtype.to = dtype_of("to");
  if (!v.dtype.to) throw InvalidArgumentError("\"dtype\" needs \"to\"");
  v.dtype.keep_to = dtype_of("keep_to");
  if (const auto keep = j.find("keep"); keep != j.end()) {
    if (!keep->is_array() || keep->size() > kMaxPatterns) {
      throw InvalidArgumentError("\"dtype\": \"keep\" must be an array of at most " + std::to_string(kMaxPatterns) +
                                 " patterns");
    }
    for (const auto& pattern : *keep) {
      if (!pattern.is_string() || pattern.get_ref<const std::string&>().size() > kMaxPatternBytes) {
        throw InvalidArgumentError("\"dtype\": a \"keep\" pattern must be a string of at most " +
                                   std::to_string(kMaxPatternBytes) + " bytes");
      }
      v.dtype.keep.push_back(pattern.get<std::string>());
    }
  }
  if (const auto prefix = j.find("prefix"); prefix != j.end()) {
    if (!prefix->is_string()) throw InvalidArgumentError("\"dtype\": \"prefix\" must be a string");
    v.name_prefix = prefix->get<std::string>();
  }
  return v;
}

std::string StoreVariant::describe() const {
  if (!dtype.active()) return {};
  std::string out(dtype_name(*dtype.to));
  if (!dtype.keep.empty()) out += " keep=" + nlohmann::json(dtype.keep).dump();
  if (dtype.keep_to) out += " keep_to=" + std::string(dtype_name(*dtype.keep_to));
  return out;
}

nlohmann::json error_reply(const Error& error) {
  // Bounded, so that the reply fits one record whatever a file or server put in the message.
  constexpr std::size_t kMaxMessage = 8u << 10;
  std::string message = error.message();
  if (message.size() > kMaxMessage) message = message.substr(0, kMaxMessage) + "...";
  nlohmann::json e = {{"code", error_code_name(error.code())}, {"message", std::move(message)}};
  if (!error.context().file.empty()) e["file"] = error.context().file.substr(0, kMaxMessage);
  return {{"ok", false}, {"error", std::move(e)}};
}

void throw_if_error(const nlohmann::json& reply, const std::string& socket) {
  const auto ok = reply.find("ok");
  if (!reply.is_object() || ok == reply.end() || !ok->is_boolean()) {
    throw UnavailableError("the store on " + socket + " sent a reply that is not one");
  }
  if (ok->get<bool>()) return;
  const auto e = reply.find("error");
  auto text = [&](const char* key, const char* otherwise) {
    if (e == reply.end() || !e->is_object()) return std::string(otherwise);
    const auto v = e->find(key);
    return v != e->end() && v->is_string() ? v->get<std::string>() : std::string(otherwise);
  };
  const std::string code = text("code", "io");
  const std::string message = text("message", "unknown error");
  const std::string file = text("file", "");
  for (int c = 0; c < kErrorCodeCount; ++c) {
    if (code == error_code_name(static_cast<ErrorCode>(c))) {
      throw_error(static_cast<ErrorCode>(c), "store: " + message, ErrorContext{file});
    }
  }
  throw IoError("store: " + message, ErrorContext{file});
}

}  // namespace pinload::detail
