// Internal: a client's side of the node store (Note [Store clients] in
// pinload/store.h).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "pinload/env.h"
#include "pinload/file_identity.h"
#include "pinload/pool.h"
#include "store/wire.h"

namespace pinload::detail {

// One connection; requests on it are answered in order. The entries it
// receives are held in the daemon until it closes.
class StoreConnection {
 public:
  // Throws UnavailableError (no daemon, refused, not allowed).
  static std::shared_ptr<StoreConnection> connect(const std::string& socket);

  // Sends `request` (with `fds`) and returns the reply. Throws the error the
  // reply carries, or UnavailableError where the daemon is gone. `received`
  // gets the descriptors the reply carries.
  nlohmann::json request(const nlohmann::json& request, std::span<const int> fds = {},
                         std::vector<ScopedFd>* received = nullptr);

  struct Served {
    ScopedFd memfd;
    std::uint64_t bytes = 0;   // the file's size
    std::uint64_t mapped = 0;  // the memfd's size
    bool hit = false;          // already in the store
    FileIdentity identity;     // of the file the daemon was given
  };
  // The entry for the open file `fd` (named `path` in messages), held by
  // this connection when `hold`; its converted image where `variant` is
  // active (Note [Converted store entries]: `bytes` is the image's size).
  Served get(int fd, const std::string& path, bool hold, const StoreVariant& variant = {});
  // The entry for version `version` (a strong ETag) of the remote object `url`, of `size`
  // bytes, which the daemon fetches on a miss (Note [Remote store entries]); nullopt where the
  // daemon answers that the client reads it itself (the daemon may not fetch it, or cannot pin
  // its version), whatever StoreOptions::required says.
  std::optional<Served> get_remote(const std::string& url, const std::string& version, std::uint64_t size, bool hold);

  const std::string& socket() const noexcept { return socket_; }

  // Ends this connection's holds before it closes (the daemon would see the
  // close a moment later): once a load's tensors are gone, so are its holds.
  ~StoreConnection();

 private:
  // `request` without throwing the error a reply carries.
  nlohmann::json exchange(const nlohmann::json& request, std::span<const int> fds, std::vector<ScopedFd>* received);
  StoreConnection(ScopedFd fd, std::string socket) : fd_(std::move(fd)), socket_(std::move(socket)) {}
  std::mutex mu_;
  ScopedFd fd_;
  std::string socket_;
};

// The name the store shows a file by (status, its log): its absolute path.
std::string store_name(const std::string& path);

// A store entry mapped private (copy-on-write) into this process, keeping its
// connection, and so its hold, alive.
class StoreMapping : public std::enable_shared_from_this<StoreMapping> {
 public:
  // Maps `served` (the memfd is closed once mapped). Throws OutOfMemoryError.
  static std::shared_ptr<StoreMapping> map(std::shared_ptr<StoreConnection> connection, StoreConnection::Served served,
                                           const std::string& path);
  ~StoreMapping();
  StoreMapping(const StoreMapping&) = delete;
  StoreMapping& operator=(const StoreMapping&) = delete;

  const std::byte* data() const noexcept { return base_; }
  std::size_t size() const noexcept { return size_; }  // the file's bytes
  // A Block spanning the file that keeps this mapping alive.
  std::shared_ptr<Block> block();

 private:
  StoreMapping(std::shared_ptr<StoreConnection> connection, std::byte* base, std::size_t size, std::size_t mapped);
  std::shared_ptr<StoreConnection> connection_;
  std::byte* base_;
  std::size_t size_;
  std::size_t mapped_;
  Block block_;
};

}  // namespace pinload::detail
