#include "store/socket_path.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "base/log.h"
#include "pinload/error.h"
#include "pinload/store.h"

namespace pinload {

std::string default_store_socket() {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  if (runtime != nullptr && runtime[0] != '\0') return std::string(runtime) + "/pinload/store.sock";
  return "/run/pinload/store.sock";
}

StoreOptions StoreOptions::from_environment(StoreOptions given) {
  if (given.active() || given.disabled) return given;
  const char* value = std::getenv(kStoreVariable);
  if (value == nullptr) return given;
  const std::string v = value;
  if (v.empty() || v == "0" || v == "off" || v == "false") return given;
  given.socket = v == "1" || v == "default" || v == "true" || v == "on" ? default_store_socket() : v;
  return given;
}

namespace detail {
namespace {

sockaddr_un address_of(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(a.sun_path)) {
    throw InvalidArgumentError("a store socket path must be 1.." + std::to_string(sizeof(a.sun_path) - 1) +
                               " bytes long", ErrorContext{path});
  }
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

// 0 connected, else errno.
int try_connect(int fd, const sockaddr_un& a) {
  for (;;) {
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) return 0;
    if (errno != EINTR) return errno;
  }
}

}  // namespace

ListeningSocket::~ListeningSocket() {
  if (fd.valid() && !path.empty()) ::unlink(path.c_str());
}

ListeningSocket listen_on(const std::string& path, unsigned mode) {
  const sockaddr_un a = address_of(path);
  std::error_code ec;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (!folder.empty() && !std::filesystem::exists(folder, ec)) {
    std::filesystem::create_directories(folder, ec);
    if (ec) throw IoError("creating the socket's folder failed: " + ec.message(), ErrorContext{folder.string()});
  }
  ListeningSocket out;
  out.fd = ScopedFd(default_env(), ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!out.fd.valid()) throw IoError(std::string("socket() failed: ") + std::strerror(errno), ErrorContext{path});
  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) throw IoError("exists and is not a socket; not replacing it", ErrorContext{path});
    ScopedFd probe(default_env(), ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    const int err = try_connect(probe.get(), a);
    if (err == 0) throw IoError("another store is serving on this socket", ErrorContext{path});
    if (err != ECONNREFUSED) {
      throw IoError(std::string("cannot tell whether a store serves on this socket: ") + std::strerror(err), ErrorContext{path});
    }
    log::warn("store: replacing the stale socket {} (no daemon answers on it)", path);
    ::unlink(path.c_str());
  }
  // Bound with no permissions, then opened to `mode`: never reachable by
  // more peers than asked, even for an instant.
  const mode_t old = ::umask(0777);
  const int rc = ::bind(out.fd.get(), reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  const int err = errno;
  ::umask(old);
  if (rc != 0) throw IoError(std::string("bind failed: ") + std::strerror(err), ErrorContext{path});
  out.path = path;
  if (::chmod(path.c_str(), mode) != 0) throw IoError(std::string("chmod failed: ") + std::strerror(errno), ErrorContext{path});
  if (::listen(out.fd.get(), 128) != 0) throw IoError(std::string("listen failed: ") + std::strerror(errno), ErrorContext{path});
  return out;
}

ScopedFd connect_to(const std::string& path) {
  const sockaddr_un a = address_of(path);
  ScopedFd fd(default_env(), ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw UnavailableError(std::string("socket() failed: ") + std::strerror(errno), ErrorContext{path});
  if (const int err = try_connect(fd.get(), a); err != 0) {
    throw UnavailableError(std::string("no store answers on this socket: ") + std::strerror(err), ErrorContext{path});
  }
  return fd;
}

}  // namespace detail
}  // namespace pinload
