#include "store/client.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "base/log.h"
#include "pinload/checkpoint.h"
#include "pinload/error.h"
#include "pinload/store.h"
#include "remote/remote_url.h"
#include "source/sources.h"
#include "store/socket_path.h"
#include "store/wire.h"

namespace pinload {
namespace detail {

std::string store_name(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

std::shared_ptr<StoreConnection> StoreConnection::connect(const std::string& socket) {
  return std::shared_ptr<StoreConnection>(new StoreConnection(connect_to(socket), socket));
}

nlohmann::json StoreConnection::request(const nlohmann::json& request, std::span<const int> fds,
                                        std::vector<ScopedFd>* received) {
  nlohmann::json reply = exchange(request, fds, received);
  throw_if_error(reply, socket_);
  return reply;
}

nlohmann::json StoreConnection::exchange(const nlohmann::json& request, std::span<const int> fds,
                                         std::vector<ScopedFd>* received) {
  std::lock_guard lock(mu_);
  std::optional<WireMessage> reply;
  try {
    // A daemon that turns the peer away (not allowed, busy) answers and closes at once, maybe
    // before the request arrives: its answer is read even where the send found the peer gone.
    (void)send_message(fd_.get(), request, fds);
    reply = receive_message(fd_.get());
  } catch (const IoError& e) {
    throw UnavailableError(std::string("the store connection failed: ") + e.message(), ErrorContext{socket_});
  }
  if (!reply) throw UnavailableError("the store closed the connection (the daemon stopped?)", ErrorContext{socket_});
  if (!reply->malformed.empty()) throw UnavailableError("the store sent " + reply->malformed, ErrorContext{socket_});
  if (received != nullptr) *received = std::move(reply->fds);
  return std::move(reply->body);
}

StoreConnection::~StoreConnection() {
  // A bounded wait: a daemon that does not answer within a second gets the
  // close alone, which ends the holds too.
  const timeval second{1, 0};
  (void)::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &second, sizeof(second));
  try {
    (void)request({{"op", "release"}});
  } catch (const std::exception&) {
  }
}

namespace {

// The entry a "get" or "get_remote" reply carries.
StoreConnection::Served served_from(const nlohmann::json& reply, std::vector<ScopedFd>& fds, bool has_identity,
                                    const std::string& socket) {
  StoreConnection::Served out;
  try {
    out.bytes = reply.at("bytes").get<std::uint64_t>();
    out.mapped = reply.at("mapped").get<std::uint64_t>();
    out.hit = reply.at("hit").get<bool>();
    if (has_identity) {
      const auto& id = reply.at("identity");
      out.identity = FileIdentity{id.at("device").get<std::uint64_t>(),   id.at("inode").get<std::uint64_t>(),
                                  id.at("size").get<std::uint64_t>(),     id.at("mtime_ns").get<std::int64_t>(),
                                  id.at("ctime_ns").get<std::int64_t>(),  id.at("generation").get<std::uint64_t>()};
    }
  } catch (const nlohmann::json::exception& e) {
    throw UnavailableError(std::string("the store's reply lacks a field: ") + e.what(), ErrorContext{socket});
  }
  if (fds.size() != 1 || out.mapped < out.bytes) {
    throw UnavailableError("the store's reply carries no entry", ErrorContext{socket});
  }
  out.memfd = std::move(fds[0]);
  return out;
}

}  // namespace

namespace {

// Files from this size up that are mostly not in the page cache are passed to the daemon opened
// O_DIRECT, so that a miss fills at the disk's speed (Note [The node store]).
constexpr std::uint64_t kDirectFromBytes = 4u << 20;

// A second descriptor of the open file `fd`, O_DIRECT, for the daemon's fill where it would read
// the file from the disk:
// large, mostly not cached, not on a network filesystem, and the filesystem takes O_DIRECT.
// Invalid otherwise (the daemon reads `fd` buffered). The client reopens its own descriptor: it
// can read the file, and the daemon never opens anything.
ScopedFd direct_descriptor(int fd, const std::string& path) {
  Env* env = default_env();
  FileStat st;
  if (env->stat(fd, &st) != 0 || st.type != FileType::kRegular || st.size < kDirectFromBytes) return {};
  if (on_network_filesystem(env, fd, path)) return {};
  const double resident = env->resident_fraction(fd, st.size, kResidencySamples);
  if (resident < 0 || resident >= 0.5) return {};
  const int direct = ::open(("/proc/self/fd/" + std::to_string(fd)).c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (direct < 0) return {};
  ScopedFd out(env, direct);
  FileStat again;  // the same file, not whatever the link names now
  if (env->stat(direct, &again) != 0 || again.inode != st.inode || again.device != st.device) return {};
  return out;
}

}  // namespace

StoreConnection::Served StoreConnection::get(int fd, const std::string& path, bool hold, const StoreVariant& variant) {
  std::vector<ScopedFd> fds;
  // A converting fill reads through the planner's buffered reads: the plain descriptor.
  const ScopedFd direct = variant.active() ? ScopedFd() : direct_descriptor(fd, path);
  const int both[2] = {fd, direct.get()};
  const std::span<const int> send(both, direct.get() >= 0 ? 2 : 1);
  nlohmann::json message = {{"op", "get"}, {"path", path}, {"hold", hold}};
  if (variant.active()) message["dtype"] = variant.to_json();
  const nlohmann::json reply = request(message, send, &fds);
  return served_from(reply, fds, /*has_identity=*/true, socket_);
}

std::optional<StoreConnection::Served> StoreConnection::get_remote(const std::string& url, const std::string& version,
                                                                   std::uint64_t size, bool hold) {
  std::vector<ScopedFd> fds;
  const nlohmann::json reply =
      exchange({{"op", "get_remote"}, {"url", url}, {"version", version}, {"size", size}, {"hold", hold}}, {}, &fds);
  // Note [Remote store entries]: not the store's to fetch (no --remote-allow prefix, no presigned
  // URL) or to pin (no strong ETag): the client reads it.
  if (reply.is_object() && reply.value("read_yourself", false) == true) {
    std::string why = "refused";
    if (const auto e = reply.find("error"); e != reply.end() && e->is_object()) {
      if (const auto m = e->find("message"); m != e->end() && m->is_string()) why = m->get<std::string>();
    }
    log::info("{}: {}; reading it without the store", remote::display_url(url), why);
    return std::nullopt;
  }
  throw_if_error(reply, socket_);
  Served out = served_from(reply, fds, /*has_identity=*/false, socket_);
  if (out.bytes != size) {
    throw UnavailableError("the store's entry for an object of " + std::to_string(size) + " bytes has " +
                               std::to_string(out.bytes),
                           ErrorContext{socket_});
  }
  return out;
}

StoreMapping::StoreMapping(std::shared_ptr<StoreConnection> connection, std::byte* base, std::size_t size,
                           std::size_t mapped)
    : connection_(std::move(connection)), base_(base), size_(size), mapped_(mapped),
      block_(base, size, mapped, /*locked=*/false, nullptr) {}

StoreMapping::~StoreMapping() { ::munmap(base_, mapped_); }

std::shared_ptr<StoreMapping> StoreMapping::map(std::shared_ptr<StoreConnection> connection,
                                                StoreConnection::Served served, const std::string& path) {
  // Private and writable: a client that writes to a tensor gets its own copy
  // of that page; the sealed entry never changes.
  void* p = ::mmap(nullptr, served.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE, served.memfd.get(), 0);
  if (p == MAP_FAILED) {
    throw OutOfMemoryError(std::string("mapping the store's entry failed: ") + std::strerror(errno), ErrorContext{path});
  }
  return std::shared_ptr<StoreMapping>(
      new StoreMapping(std::move(connection), static_cast<std::byte*>(p), served.bytes, served.mapped));
}

std::shared_ptr<Block> StoreMapping::block() { return std::shared_ptr<Block>(shared_from_this(), &block_); }

namespace {

struct LocalFile {
  std::string path;  // store_name
  std::string name_prefix;
};

// Each path resolved on its own: they may be different models.
std::vector<LocalFile> local_files(Env* env, const std::vector<std::string>& paths) {
  std::vector<LocalFile> files;
  for (const std::string& path : paths) {
    for (const CheckpointFile& f : open_checkpoint(env, {path}).files) {
      if (!f.version.empty()) {
        throw InvalidArgumentError("the store keeps local files; a remote object is not one", ErrorContext{f.path});
      }
      files.push_back({store_name(f.path), f.name_prefix});
    }
  }
  return files;
}

}  // namespace
}  // namespace detail

StoreStatus store_status(const std::string& socket) {
  const auto connection = detail::StoreConnection::connect(socket);
  const nlohmann::json reply = connection->request({{"op", "status"}});
  StoreStatus s;
  try {
    const auto& j = reply.at("status");
    s.budget_bytes = j.at("budget_bytes");
    s.bytes = j.at("bytes");
    s.huge_page_bytes = j.at("huge_page_bytes");
    s.hits = j.at("hits");
    s.misses = j.at("misses");
    s.reads = j.at("reads");
    s.bytes_read = j.at("bytes_read");
    s.evictions = j.at("evictions");
    s.clients = j.at("clients");
    s.refused = j.at("refused");
    s.busy = j.value("busy", std::uint64_t{0});
    s.errors = j.at("errors");
    s.numa_node = j.at("numa_node");
    s.shmem_huge_pages = j.at("shmem_huge_pages");
    for (const auto& e : j.at("entries")) {
      s.entries.push_back({e.at("path"), e.value("dtype", std::string()), e.at("bytes"), e.at("holders"), e.at("hits")});
    }
  } catch (const nlohmann::json::exception& e) {
    throw UnavailableError(std::string("the store's status lacks a field: ") + e.what(), ErrorContext{socket});
  }
  // This connection is one of the clients counted; the caller asked about the others.
  if (s.clients > 0) --s.clients;
  return s;
}

std::uint64_t store_warm(const std::string& socket, const std::vector<std::string>& paths, Env* env,
                         const DTypeOptions& dtype) {
  if (env == nullptr) env = default_env();
  const std::vector<detail::LocalFile> files = detail::local_files(env, paths);
  const auto connection = detail::StoreConnection::connect(socket);
  std::uint64_t bytes = 0;
  for (const detail::LocalFile& f : files) {
    ScopedFd fd = open_or_throw(env, f.path);
    bytes += connection->get(fd.get(), f.path, /*hold=*/false, detail::StoreVariant{dtype, f.name_prefix}).bytes;
  }
  return bytes;
}

std::uint64_t store_evict(const std::string& socket, const std::vector<std::string>& paths, Env* env) {
  if (env == nullptr) env = default_env();
  const auto connection = detail::StoreConnection::connect(socket);
  if (paths.empty()) return connection->request({{"op", "evict"}}).at("evicted").get<std::uint64_t>();
  std::uint64_t count = 0;
  for (const detail::LocalFile& f : detail::local_files(env, paths)) {
    ScopedFd fd = open_or_throw(env, f.path);
    const int send[1] = {fd.get()};
    count += connection->request({{"op", "evict"}}, send).at("evicted").get<std::uint64_t>();
  }
  return count;
}

}  // namespace pinload
