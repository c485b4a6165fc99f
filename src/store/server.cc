// The node store's daemon: Note [The node store] in pinload/store.h.
//
// One thread accepts; each connection of an allowed peer gets a thread that
// answers its requests in order (refused and surplus peers get their reply and
// are closed by the accepting thread). Entries live in `Store`, under one
// mutex; a miss is filled outside it, by the connection that caused it, while
// the others that ask for the same key wait on `filled` (single flight).
//
// Note [The store's security boundary]
// What one client puts in, another receives; so no request, server or other
// user may crash the daemon, poison an entry or read through it:
//  - Every reply can be sent (send_message writes bytes that are not UTF-8
//    as U+FFFD), and every exception of a connection's handling becomes that
//    connection's typed reply; the accepting thread survives its own too.
//  - A local entry's key is what makes its bytes: the file's identity (device,
//    inode, size, mtime, ctime, generation: file_identity.h) and its header's
//    SHA-256, and for files under kSmallFile the SHA-256 of all their bytes.
//    The daemon reads only through the client's descriptor, which must be a
//    regular file opened for reading (no O_PATH); it never reopens a file.
//  - A remote entry's key is the canonical URL (remote::canonical_url: what
//    libcurl fetches), the size and the strong ETag, each checked against
//    the server's first answer. The daemon fetches only under an operator's
//    --remote-allow prefix (a presigned query is no licence); otherwise, and where the
//    server gives no strong ETag equal to the one asked, the reply says
//    "read_yourself" and the client reads the object itself.
//  - Connections are bounded per uid and in total ("busy"); header bytes in
//    flight are bounded by a quarter of the budget (Store::Reservation).
//  - A uid sees in `status`, and may evict, only the entries it was served,
//    unless it is root or the daemon's own.
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "base/log.h"
#include "base/parallel_for.h"
#include "base/printable.h"
#include "base/sha256.h"
#include "pinload/memory_limit.h"
#include "pinload/remote.h"
#include "pinload/safetensors.h"
#include "pinload/store.h"
#include "os/read_full.h"
#include "remote/remote_client.h"
#include "remote/remote_url.h"
#include "source/sources.h"
#include "store/server.h"
#include "store/socket_path.h"
#include "store/wire.h"

namespace pinload {
namespace {

using nlohmann::json;

constexpr std::size_t kFillChunk = 8u << 20;
constexpr std::size_t kHugePage = 2u << 20;
// Files under this size are keyed by the SHA-256 of all their bytes too.
constexpr std::uint64_t kSmallFile = 64u << 10;

// Reads [offset, offset + bytes) fully (os/read_full.h); 0 or -errno
// (-ENODATA: the file ended first).
int read_fully(Env* env, int fd, std::byte* into, std::size_t bytes, std::uint64_t offset) {
  const ReadResult r = read_full(env, fd, into, bytes, offset);
  if (r.error != 0) return -r.error;
  return r.bytes < bytes ? -ENODATA : 0;
}

// Kilobytes of huge pages (ShmemPmdMapped) in this process's mapping at `address`.
std::uint64_t huge_page_bytes_at(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool in = false;
  std::ostringstream want;
  want << std::hex << reinterpret_cast<std::uintptr_t>(address) << "-";
  while (std::getline(smaps, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') != std::string::npos &&
        line.find(':') > line.find(' ')) {
      in = line.rfind(want.str(), 0) == 0;
      continue;
    }
    if (in && line.rfind("ShmemPmdMapped:", 0) == 0) return std::stoull(line.substr(15)) * 1024;
  }
  return 0;
}

// The kernel's choice for huge pages in shared memory: "always", "within_size",
// "advise", "never", "deny" or "force" (the bracketed word of shmem_enabled);
// "" where it cannot be read.
std::string shmem_huge_pages() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string text;
  std::getline(f, text);
  const auto open = text.find('['), close = text.find(']');
  return open != std::string::npos && close > open ? text.substr(open + 1, close - open - 1) : std::string();
}

struct Entry {
  std::string key;
  std::string path;             // as the first client named it
  std::string variant;          // a converted entry's dtype options (StoreVariant::describe)
  FileIdentity identity;
  std::uint64_t bytes = 0;      // the file's size
  std::uint64_t charge = 0;     // the memfd's size: bytes rounded up
  std::uint64_t huge_bytes = 0;
  ScopedFd memfd;
  enum class State { kFilling, kReady, kFailed } state = State::kFilling;
  json failure;                 // the error reply of a failed fill
  std::uint64_t holders = 0;
  std::uint64_t hits = 0;
  std::uint64_t last_used = 0;
  std::set<std::uint32_t> users;  // uids it was served to: what status shows them
};

// Who sent a request: SO_PEERCRED's uid; `privileged` for root and the daemon's own uid.
struct Peer {
  std::uint32_t uid = 0;
  bool privileged = false;
};

// A refusal that is not a failure: the client reads the object itself, whatever
// store_required says (a remote object the daemon may not fetch, or cannot verify).
struct ReadYourself {
  InvalidArgumentError error;
};

json read_yourself_reply(const Error& e) {
  json reply = detail::error_reply(e);
  reply["read_yourself"] = true;
  return reply;
}

// Note [The store's security boundary]: the client's descriptor must be a
// regular file opened for reading. An O_PATH descriptor (which opens a file
// its holder may not read) or a write-only one is refused.
void check_client_descriptor(int fd, const std::string& path) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw InvalidArgumentError("the client's descriptor cannot be inspected", ErrorContext{path});
  if ((flags & O_PATH) != 0) {
    throw InvalidArgumentError("the client's descriptor is an O_PATH one, not open for reading", ErrorContext{path});
  }
  if ((flags & O_ACCMODE) == O_WRONLY) {
    throw InvalidArgumentError("the client's descriptor is not open for reading", ErrorContext{path});
  }
}

// Whether `url` (canonical) lies under one of the operator's --remote-allow
// prefixes: the prefix ends in '/', or the URL goes on with '/' or '?' after it (or ends).
bool under_prefix(const std::string& url, const std::vector<std::string>& prefixes) {
  for (const std::string& prefix : prefixes) {
    if (prefix.empty() || !url.starts_with(prefix)) continue;
    if (prefix.back() == '/' || url.size() == prefix.size() || url[prefix.size()] == '/' || url[prefix.size()] == '?') {
      return true;
    }
  }
  return false;
}

class Store {
 public:
  Store(const StoreServerOptions& options, Env* env, const detail::ImagePlanner& planner)
      : options_(options), env_(env), planner_(planner) {}

  // Answers one request of a connection whose held entries are `held`.
  json handle(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
              std::vector<int>* fds_out);
  void release(std::vector<std::shared_ptr<Entry>>& held);
  json status(const Peer& peer);

  std::atomic<std::uint64_t> clients{0};
  std::atomic<std::uint64_t> refused{0};
  std::atomic<std::uint64_t> busy{0};
  std::atomic<std::uint64_t> errors{0};

 private:
  json get(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
           std::vector<int>* fds_out);
  json get_remote(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
                  std::vector<int>* fds_out);
  // What get and get_remote share: the entry for `key` (made by `fill` on a miss, once however
  // many ask at once), held by the connection when `hold`, its memfd added to `fds_out`.
  json serve(const std::string& key, const std::string& path, const std::string& variant, const FileIdentity& identity,
             std::uint64_t bytes, bool hold, const Peer& peer, const std::function<void(Entry&)>& fill,
             std::vector<std::shared_ptr<Entry>>* held, std::vector<int>* fds_out);
  json evict(const detail::WireMessage& message, const Peer& peer);
  // Makes room for `charge` bytes: the budget first (evicting), then the
  // memory the daemon can still take. Called with mu_ held; throws
  // OutOfMemoryError.
  void make_room(std::uint64_t charge, const std::string& path);
  void fill(Entry& entry, int fd);
  void fill_remote(Entry& entry, const std::string& url, const std::string& version);
  void fill_image(Entry& entry, int fd, detail::ConvertedImage& image);

  // Bytes a request reads before its entry exists (a header, a small file):
  // at most a quarter of the budget in flight at once (one request alone may
  // take up to the whole budget), so that concurrent requests for large
  // headers cannot take memory beyond the budget's measure. A request waits
  // for its turn up to kReservationWait, then fails with OutOfMemoryError.
  class Reservation {
   public:
    Reservation(Store& store, std::uint64_t bytes, const std::string& path) : store_(store), bytes_(bytes) {
      const std::uint64_t budget = store_.options_.budget_bytes;
      if (bytes > budget) {
        throw OutOfMemoryError("reading " + std::to_string(bytes) + " bytes of the file takes more than the store's budget",
                               ErrorContext{path});
      }
      std::unique_lock lock(store_.flight_mu_);
      if (!store_.flight_cv_.wait_for(lock, kReservationWait, [&] {
            return store_.in_flight_ == 0 || store_.in_flight_ + bytes <= budget / 4;
          })) {
        throw OutOfMemoryError("the store is busy reading " + std::to_string(store_.in_flight_) +
                                   " bytes of other clients' headers; try again",
                               ErrorContext{path});
      }
      store_.in_flight_ += bytes;
    }
    ~Reservation() {
      std::lock_guard lock(store_.flight_mu_);
      store_.in_flight_ -= bytes_;
      store_.flight_cv_.notify_all();
    }
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;

   private:
    static constexpr std::chrono::seconds kReservationWait{30};
    Store& store_;
    std::uint64_t bytes_;
  };

  const StoreServerOptions& options_;
  Env* env_;
  const detail::ImagePlanner& planner_;
  std::mutex mu_;
  std::condition_variable filled_;
  std::map<std::string, std::shared_ptr<Entry>> entries_;
  std::uint64_t bytes_ = 0;  // charges of entries filling or ready
  std::mutex flight_mu_;
  std::condition_variable flight_cv_;
  std::uint64_t in_flight_ = 0;  // Reservation's bytes
  std::uint64_t tick_ = 0;
  std::uint64_t hits_ = 0, misses_ = 0, reads_ = 0, bytes_read_ = 0, evictions_ = 0;
};

json Store::handle(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
                   std::vector<int>* fds_out) {
  const auto op = message.body.find("op");
  if (op == message.body.end() || !op->is_string()) throw InvalidArgumentError("a request without an \"op\"");
  const std::string& name = op->get_ref<const std::string&>();
  if (name == "get") return get(message, peer, held, fds_out);
  if (name == "get_remote") return get_remote(message, peer, held, fds_out);
  if (name == "status") return {{"ok", true}, {"status", status(peer)}};
  if (name == "evict") return evict(message, peer);
  if (name == "release") {
    release(*held);
    return {{"ok", true}};
  }
  throw InvalidArgumentError("unknown op \"" + printable_text(name, 64) + "\"");
}

json Store::get(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
                std::vector<int>* fds_out) {
  // The file, and optionally a second descriptor of it opened O_DIRECT, for the fill.
  if (message.fds.empty() || message.fds.size() > 2) {
    throw InvalidArgumentError("\"get\" takes one file descriptor, or two (the second O_DIRECT)");
  }
  const int fd = message.fds[0].get();
  std::string path = "(unnamed)";
  if (const auto p = message.body.find("path"); p != message.body.end() && p->is_string()) {
    path = p->get<std::string>();
  }
  bool hold = true;
  if (const auto h = message.body.find("hold"); h != message.body.end() && h->is_boolean()) hold = h->get<bool>();
  check_client_descriptor(fd, path);
  FileStat st;
  if (const int rc = env_->stat(fd, &st); rc != 0) {
    throw IoError(std::string("stat of the client's file failed: ") + std::strerror(-rc), ErrorContext{path});
  }
  if (st.type != FileType::kRegular) {
    throw InvalidFileError(std::string("not a regular file but a ") + file_type_name(st.type), ErrorContext{path});
  }
  int fill_fd = fd;
  if (message.fds.size() == 2) {
    fill_fd = message.fds[1].get();
    check_client_descriptor(fill_fd, path);
    FileStat direct;
    if (env_->stat(fill_fd, &direct) != 0 || !(FileIdentity::of(direct) == FileIdentity::of(st))) {
      throw InvalidArgumentError("the client's second descriptor is not of the same file", ErrorContext{path});
    }
  }
  // The key: the file's identity and its header's digest; a small file's bytes' digest too.
  std::byte prefix[kHeaderPrefixSize] = {};
  if (st.size >= kHeaderPrefixSize && read_fully(env_, fd, prefix, kHeaderPrefixSize, 0) != 0) {
    throw IoError("reading the header's length failed", ErrorContext{path, {}, 0, kHeaderPrefixSize});
  }
  const std::uint64_t header_bytes = parse_header_prefix(prefix, st.size, path);  // the loader's own checks and cap
  const FileIdentity identity = FileIdentity::of(st);
  std::string key = "file " + std::to_string(identity.device) + ":" + std::to_string(identity.inode) + ":" +
                    std::to_string(identity.size) + ":" + std::to_string(identity.mtime_ns) + ":" +
                    std::to_string(identity.ctime_ns) + ":" + std::to_string(identity.generation);
  {
    // The header (a small file: all its bytes), charged to the budget while it is held.
    const bool small = st.size < kSmallFile;
    const std::uint64_t read_ahead = small ? st.size : header_bytes;
    const Reservation reservation(*this, read_ahead, path);
    std::string bytes(read_ahead, '\0');
    const std::uint64_t from = small ? 0 : 8;
    if (read_ahead > 0 && read_fully(env_, fd, reinterpret_cast<std::byte*>(bytes.data()), bytes.size(), from) != 0) {
      throw IoError(small ? "reading the file failed" : "reading the header failed",
                    ErrorContext{path, {}, from, from + read_ahead});
    }
    const std::string_view header =
        small ? std::string_view(bytes).substr(std::min<std::uint64_t>(st.size, 8), header_bytes) : std::string_view(bytes);
    key += " header " + detail::sha256_hex(header.data(), header.size());
    if (small) key += " bytes " + detail::sha256_hex(bytes.data(), bytes.size());
  }
  // Note [Converted store entries]: a variant of its own, planned (header and scales) before the
  // budget makes room for it.
  detail::StoreVariant variant;
  if (const auto d = message.body.find("dtype"); d != message.body.end() && !d->is_null()) {
    variant = detail::StoreVariant::from_json(*d);
  }
  json reply;
  if (variant.active()) {
    if (!planner_) throw InvalidArgumentError("this store keeps no converted entries", ErrorContext{path});
    key += " as " + variant.describe() + " prefix " + nlohmann::json(variant.name_prefix).dump();
    std::unique_ptr<detail::ConvertedImage> image;
    {
      const Reservation planning(*this, header_bytes, path);  // the planner parses the header again
      image = planner_(env_, fd, path, variant, options_.threads);
    }
    reply = serve(key, path, variant.describe(), identity, image->bytes(), hold, peer,
                  [&](Entry& e) { fill_image(e, fd, *image); }, held, fds_out);
  } else {
    reply = serve(key, path, {}, identity, st.size, hold, peer, [&](Entry& e) { fill(e, fill_fd); }, held, fds_out);
  }
  if (reply.value("ok", false)) {
    reply["identity"] = {{"device", identity.device}, {"inode", identity.inode},       {"size", identity.size},
                         {"mtime_ns", identity.mtime_ns}, {"ctime_ns", identity.ctime_ns}, {"generation", identity.generation}};
  }
  return reply;
}

// Note [Remote store entries] in pinload/store.h.
json Store::get_remote(const detail::WireMessage& message, const Peer& peer, std::vector<std::shared_ptr<Entry>>* held,
                       std::vector<int>* fds_out) {
  if (!message.fds.empty()) throw InvalidArgumentError("\"get_remote\" takes no file descriptor");
  const auto text = [&](const char* field) {
    const auto it = message.body.find(field);
    if (it == message.body.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
      throw InvalidArgumentError(std::string("\"get_remote\" needs a non-empty string \"") + field + "\"");
    }
    return it->get<std::string>();
  };
  const std::string given = text("url");
  const std::string version = text("version");
  const auto size = message.body.find("size");
  if (size == message.body.end() || !size->is_number_unsigned()) {
    throw InvalidArgumentError("\"get_remote\" needs the object's \"size\"");
  }
  const std::uint64_t bytes = size->get<std::uint64_t>();
  bool hold = true;
  if (const auto h = message.body.find("hold"); h != message.body.end() && h->is_boolean()) hold = h->get<bool>();
  if (!is_remote_path(given)) {
    throw InvalidArgumentError("not an s3:// or http(s):// URL", ErrorContext{printable_text(remote::display_url(given))});
  }
  // One parser for the key and the fetch (Note [Canonical URLs] in remote_url.h): throws for a URL
  // that cannot be keyed safely (user information, a fragment, ...).
  const std::string url = remote::canonical_url(given);
  const std::string shown = printable_text(remote::display_url(url));
  if (remote::classify_validator(version, 0) != remote::Validator::kStrong) {
    throw InvalidArgumentError("a remote entry needs the object's strong ETag, not " + printable_text(version, 256),
                               ErrorContext{shown});
  }
  // No confused deputy: the daemon fetches only what the operator let every client read. Its
  // network position is a privilege too, so a URL's own credentials (a presigned query, which the
  // daemon cannot verify: a server that ignores queries serves anyone) are no licence.
  if (!under_prefix(url, options_.remote_allow)) {
    return read_yourself_reply(InvalidArgumentError(
        "the store fetches objects only under its --remote-allow prefixes: read by the client", ErrorContext{shown}));
  }
  // The canonical URL, query included (a presigned URL's entry is its own), its size and its ETag.
  const std::string key = "remote " + url + " size " + std::to_string(bytes) + " version " + version;
  return serve(key, shown, {}, FileIdentity{}, bytes, hold, peer, [&](Entry& e) { fill_remote(e, url, version); },
               held, fds_out);
}

json Store::serve(const std::string& key, const std::string& path, const std::string& variant,
                  const FileIdentity& identity, std::uint64_t bytes, bool hold, const Peer& peer,
                  const std::function<void(Entry&)>& fill_entry, std::vector<std::shared_ptr<Entry>>* held,
                  std::vector<int>* fds_out) {
  // Checked before any rounding: a size near 2^64 would wrap to a small charge.
  if (bytes > options_.budget_bytes) {
    throw OutOfMemoryError("the file takes " + std::to_string(bytes) + " bytes, more than the store's budget of " +
                               std::to_string(options_.budget_bytes) + " (pinload store serve --budget)",
                           ErrorContext{path});
  }
  std::shared_ptr<Entry> entry;
  bool hit = false;
  {
    std::unique_lock lock(mu_);
    // Present and ready, being filled (wait for it), or absent. A fill that
    // failed gave its error to its own client; the others look again.
    for (auto it = entries_.find(key); it != entries_.end(); it = entries_.find(key)) {
      entry = it->second;
      filled_.wait(lock, [&] { return entry->state != Entry::State::kFilling; });
      if (entry->state == Entry::State::kReady) {
        hit = true;
        break;
      }
      entry.reset();
    }
    if (hit) {
      ++hits_;
      ++entry->hits;
    } else {
      ++misses_;
      entry = std::make_shared<Entry>();
      entry->key = key;
      entry->path = path;
      entry->variant = variant;
      entry->identity = identity;
      entry->bytes = bytes;
      const std::size_t round = bytes >= kHugePage ? kHugePage : 4096;
      entry->charge = std::max<std::uint64_t>((bytes + round - 1) / round * round, 4096);
      make_room(entry->charge, path);
      bytes_ += entry->charge;
      entries_.emplace(key, entry);
    }
    entry->last_used = ++tick_;
    entry->users.insert(peer.uid);
    if (hold) {
      ++entry->holders;
      held->push_back(entry);
    }
  }
  if (!hit) {
    json failure;
    try {
      fill_entry(*entry);
    } catch (const ReadYourself& r) {
      failure = read_yourself_reply(r.error);
    } catch (const Error& e) {
      failure = detail::error_reply(e);
    } catch (const std::bad_alloc&) {
      failure = detail::error_reply(OutOfMemoryError("no memory for the entry", ErrorContext{path}));
    } catch (const std::exception& e) {  // whatever it is, the waiters must not wait forever
      failure = detail::error_reply(IoError(std::string("filling the entry failed: ") + e.what(), ErrorContext{path}));
    } catch (...) {
      failure = detail::error_reply(IoError("filling the entry failed", ErrorContext{path}));
    }
    std::lock_guard lock(mu_);
    if (failure.is_null()) {
      entry->state = Entry::State::kReady;
      ++reads_;
      bytes_read_ += entry->bytes;
    } else {
      entry->state = Entry::State::kFailed;
      entry->failure = failure;
      bytes_ -= entry->charge;
      entry->memfd.reset();
      if (auto it = entries_.find(key); it != entries_.end() && it->second == entry) entries_.erase(it);
    }
    filled_.notify_all();
  }
  if (entry->state == Entry::State::kFailed) {
    if (hold) {
      std::lock_guard lock(mu_);
      --entry->holders;
      held->pop_back();
    }
    return entry->failure;
  }
  fds_out->push_back(entry->memfd.get());
  return {{"ok", true}, {"bytes", entry->bytes}, {"mapped", entry->charge}, {"hit", hit}};
}


void Store::make_room(std::uint64_t charge, const std::string& path) {
  const std::uint64_t budget = options_.budget_bytes;
  if (charge > budget) {
    throw OutOfMemoryError("the file takes " + std::to_string(charge) + " bytes, more than the store's budget of " +
                           std::to_string(budget) + " (pinload store serve --budget)", ErrorContext{path});
  }
  while (bytes_ + charge > budget) {
    std::shared_ptr<Entry> oldest;
    for (const auto& [key, e] : entries_) {
      if (e->state == Entry::State::kReady && e->holders == 0 && (!oldest || e->last_used < oldest->last_used)) oldest = e;
    }
    if (!oldest) {
      throw OutOfMemoryError("the store's budget of " + std::to_string(budget) + " bytes holds " +
                             std::to_string(bytes_) + " bytes that clients hold; " + std::to_string(charge) +
                             " more do not fit", ErrorContext{path});
    }
    log::info("store: evicting {} ({} bytes) for {}", oldest->path, oldest->charge, path);
    bytes_ -= oldest->charge;
    ++evictions_;
    entries_.erase(oldest->key);
  }
  // Note [Memory limits]: the daemon is never OOM-killed for an entry. A
  // cgroup's estimate counts shared memory as reclaimable cache, which the
  // store's entries are not: they are taken off it.
  if (const std::optional<HostMemoryLimit> limit = read_host_memory_limit(env_)) {
    std::uint64_t left = limit->available_bytes;
    if (limit->source.find("cgroup") != std::string::npos) left -= std::min(left, bytes_);
    if (charge > left) {
      throw OutOfMemoryError("the file takes " + std::to_string(charge) + " bytes of shared memory; the store can take " +
                             std::to_string(left) + " more (" + limit->source + ")", ErrorContext{path});
    }
  }
}

// An entry's memory while it is filled: a memfd of the entry's charge, mapped writable, in huge
// pages where shmem_enabled allows and on the store's NUMA node; seal() ends the writing.
class EntryWriter {
 public:
  EntryWriter(Entry& entry, int numa_node, Env* env) : entry_(entry), env_(env) {
    const std::string& path = entry.path;
    const int memfd = env->memory_file("pinload-store");
    if (memfd < 0) throw OutOfMemoryError(std::string("memfd_create failed: ") + std::strerror(-memfd), ErrorContext{path});
    entry.memfd = ScopedFd(default_env(), memfd);  // the entry may outlive a test's Env
    if (const int rc = env->truncate(memfd, entry.charge); rc != 0) {
      throw OutOfMemoryError(std::string("sizing the entry failed: ") + std::strerror(-rc), ErrorContext{path});
    }
    int err = 0;
    void* map = env->map_file_shared(memfd, entry.charge, &err);
    if (map == nullptr) {
      throw OutOfMemoryError(std::string("mapping the entry failed: ") + std::strerror(err), ErrorContext{path});
    }
    base_ = static_cast<std::byte*>(map);
    (void)env->advise(map, entry.charge, MADV_HUGEPAGE);
    if (numa_node >= 0) (void)env->bind_memory(map, entry.charge, numa_node);
  }
  ~EntryWriter() {
    if (base_ != nullptr) env_->unmap(base_, entry_.charge);
  }
  EntryWriter(const EntryWriter&) = delete;
  EntryWriter& operator=(const EntryWriter&) = delete;

  std::byte* data() const noexcept { return base_; }

  // Sealed: no process can write, grow or shrink what others map.
  void seal() {
    entry_.huge_bytes = huge_page_bytes_at(base_);
    env_->unmap(base_, entry_.charge);
    base_ = nullptr;
    if (const int rc = env_->seal_memory_file(entry_.memfd.get()); rc != 0) {
      throw IoError(std::string("sealing the entry failed: ") + std::strerror(-rc), ErrorContext{entry_.path});
    }
  }

 private:
  Entry& entry_;
  Env* env_;
  std::byte* base_ = nullptr;
};

// Runs work(at, n) for each kFillChunk of `bytes` on `threads` threads; stops at the first
// failure, which it rethrows.
void fill_in_chunks(std::uint64_t bytes, unsigned threads, const std::function<void(std::uint64_t, std::size_t)>& work) {
  const std::size_t chunks = static_cast<std::size_t>((bytes + kFillChunk - 1) / kFillChunk);
  detail::parallel_for(chunks, threads, [&](std::size_t k) {
    const std::uint64_t at = k * kFillChunk;
    work(at, static_cast<std::size_t>(std::min<std::uint64_t>(kFillChunk, bytes - at)));
  });
}

void Store::fill(Entry& entry, int fd) {
  const std::string& path = entry.path;
  EntryWriter out(entry, options_.numa_node, env_);
  std::byte* base = out.data();
  // Through the client's descriptor only (Note [The store's security boundary]): the daemon never
  // reopens the file. A descriptor the client opened O_DIRECT is read direct, in whole 4 KiB
  // pages into the page-aligned entry; where the file refuses that (EINVAL), buffered.
  const int flags = ::fcntl(fd, F_GETFL);
  std::atomic<bool> direct = flags >= 0 && (flags & O_DIRECT) != 0;
  std::mutex refuse_direct;
  fill_in_chunks(entry.bytes, options_.threads, [&](std::uint64_t at, std::size_t n) {
    const std::uint64_t whole = (n + 4095) / 4096 * 4096;  // the memfd is sized past the file's end
    ReadResult r;
    if (direct.load()) {
      r = read_full(env_, fd, base + at, n, at, whole, 4096);
      if (r.error == EINVAL) {
        std::lock_guard lock(refuse_direct);
        if (direct.exchange(false)) (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_DIRECT);
      }
      if (r.error == 0 && r.bytes >= n) return;
      if (r.error != 0 && r.error != EINVAL) {
        throw IoError(std::string("reading the client's file failed: ") + std::strerror(r.error),
                      ErrorContext{path, {}, at, at + n});
      }
      at += r.bytes;  // the short, unaligned tail: buffered
      n -= std::min<std::size_t>(n, r.bytes);
    }
    r = read_full(env_, fd, base + at, n, at);
    if (r.error != 0) {
      throw IoError(std::string("reading the client's file failed: ") + std::strerror(r.error),
                    ErrorContext{path, {}, at, at + n});
    }
    if (r.bytes < n) throw IoError("the file ended early: it was truncated while the store read it", ErrorContext{path, {}, at, at + n});
  });
  FileStat after;
  if (env_->stat(fd, &after) != 0 || !(FileIdentity::of(after) == entry.identity)) {
    throw IoError("the file was modified while the store read it", ErrorContext{path});
  }
  out.seal();
  log::info("store: read {} ({} bytes, {}, {} in huge pages)", path, entry.bytes,
            direct.load() ? "direct" : "buffered", entry.huge_bytes);
}

// Note [Converted store entries]: the image of what a converting load hands out.
void Store::fill_image(Entry& entry, int fd, detail::ConvertedImage& image) {
  EntryWriter out(entry, options_.numa_node, env_);
  image.write(out.data());
  FileStat after;
  if (env_->stat(fd, &after) != 0 || !(FileIdentity::of(after) == entry.identity)) {
    throw IoError("the file was modified while the store converted it", ErrorContext{entry.path});
  }
  out.seal();
  log::info("store: converted {} as {} ({} bytes, {} in huge pages)", entry.path, entry.variant, entry.bytes,
            entry.huge_bytes);
}

// Note [Remote store entries]: the daemon reads the object with its own remote client (its own
// environment's credentials, or the URL's presigned query). Its first range fixes the version it
// reads: unless the server names it by the strong ETag the client asked for, at the size the
// client asked for, nothing is stored (no strong ETag: the client reads it itself). Every later
// range is asked If-Match that ETag, and an answer with another ETag fails the fill.
void Store::fill_remote(Entry& entry, const std::string& url, const std::string& version) {
  EntryWriter out(entry, options_.numa_node, env_);
  std::byte* base = out.data();
  RemoteOptions remote_options;
  remote_options.connections = std::max(options_.threads, 1u);
  const std::shared_ptr<remote::RemoteClient> client = remote::client_for(remote_options);
  const std::uint64_t first = std::min<std::uint64_t>(entry.bytes, kFillChunk);
  std::uint64_t got = 0;
  remote::ObjectInfo object = client->open(url, base, first, &got);
  if (object.validator() != remote::Validator::kStrong) {
    throw ReadYourself{InvalidArgumentError("the server names no version of the object by a strong ETag (it sent " +
                                                (object.etag.empty() ? std::string("none") : printable_text(object.etag, 256)) +
                                                "), so no entry could be pinned to the version asked",
                                            ErrorContext{entry.path})};
  }
  if (object.etag != version) {
    throw IoError("the object's ETag is " + printable_text(object.etag, 256) + ", not " + printable_text(version, 256) +
                      " as asked (changed since the client read its header?)",
                  ErrorContext{entry.path});
  }
  if (object.size != entry.bytes || got < first) {
    throw IoError("the object has " + std::to_string(object.size) + " bytes, not " + std::to_string(entry.bytes) +
                      " as asked",
                  ErrorContext{entry.path});
  }
  if (entry.bytes > first) {
    // The rest through the object's source (Note [Byte sources]), at the version its first range named.
    const std::unique_ptr<ByteSource> source = detail::open_remote_object(client, object);
    fill_in_chunks(entry.bytes - first, options_.threads, [&](std::uint64_t at, std::size_t n) {
      source->read(first + at, n, base + first + at, n);
    });
  }
  out.seal();
  log::info("store: fetched {} ({} bytes, ETag {}, {} in huge pages)", entry.path, entry.bytes, printable_text(version, 256),
            entry.huge_bytes);
}

json Store::evict(const detail::WireMessage& message, const Peer& peer) {
  if (message.fds.size() > 1) throw InvalidArgumentError("\"evict\" takes at most one file descriptor");
  std::optional<FileIdentity> only;
  if (message.fds.size() == 1) {
    check_client_descriptor(message.fds[0].get(), {});
    FileStat st;
    if (const int rc = env_->stat(message.fds[0].get(), &st); rc != 0) {
      throw IoError(std::string("stat of the client's file failed: ") + std::strerror(-rc));
    }
    only = FileIdentity::of(st);
  }
  std::lock_guard lock(mu_);
  std::uint64_t count = 0, bytes = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = *it->second;
    // Without a descriptor, a uid that is neither root nor the daemon's drops only what it was served.
    const bool may = only ? e.identity == *only : peer.privileged || e.users.contains(peer.uid);
    if (e.state == Entry::State::kReady && e.holders == 0 && may) {
      bytes_ -= e.charge;
      bytes += e.charge;
      ++count;
      ++evictions_;
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  return {{"ok", true}, {"evicted", count}, {"bytes", bytes}};
}

void Store::release(std::vector<std::shared_ptr<Entry>>& held) {
  std::lock_guard lock(mu_);
  for (const auto& e : held) --e->holders;
  held.clear();
}

json Store::status(const Peer& peer) {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Entry>> ready;
  std::uint64_t huge = 0;
  for (const auto& [key, e] : entries_) {
    if (e->state != Entry::State::kReady) continue;
    huge += e->huge_bytes;
    // The entries a uid sees: those it was served, unless it is root or the daemon's own.
    if (peer.privileged || e->users.contains(peer.uid)) ready.push_back(e);
  }
  std::sort(ready.begin(), ready.end(), [](const auto& a, const auto& b) { return a->last_used > b->last_used; });
  json entries = json::array();
  for (const auto& e : ready) {
    entries.push_back({{"path", e->path},
                       {"dtype", e->variant},
                       {"bytes", e->bytes},
                       {"holders", e->holders},
                       {"hits", e->hits}});
  }
  return {{"budget_bytes", options_.budget_bytes}, {"bytes", bytes_},     {"huge_page_bytes", huge},
          {"hits", hits_},                         {"misses", misses_},   {"reads", reads_},
          {"bytes_read", bytes_read_},             {"evictions", evictions_}, {"clients", clients.load()},
          {"refused", refused.load()},             {"busy", busy.load()},
          {"errors", errors.load()},               {"numa_node", options_.numa_node},
          {"shmem_huge_pages", shmem_huge_pages()},
          {"entries", std::move(entries)}};
}

// SO_PEERCRED's uid of `fd`, and whether the daemon serves it; false where it cannot be read.
bool peer_allowed(int fd, const StoreServerOptions& options, Peer* peer) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  peer->uid = cred.uid;
  peer->privileged = cred.uid == 0 || cred.uid == ::geteuid();
  if (options.allow_any_uid || peer->privileged) return true;
  return std::find(options.allowed_uids.begin(), options.allowed_uids.end(), cred.uid) != options.allowed_uids.end();
}

// Answers a connection's requests in order until it closes. Whatever is
// thrown while a request is answered becomes that request's typed reply.
void serve_connection(Store& store, int fd, const Peer& peer) {
  std::vector<std::shared_ptr<Entry>> held;
  for (;;) {
    std::optional<detail::WireMessage> message;
    try {
      message = detail::receive_message(fd);
    } catch (const std::exception& e) {
      log::debug("store: a connection failed: {}", e.what());
      break;
    } catch (...) {
      break;
    }
    if (!message) break;
    json reply;
    std::vector<int> fds;
    if (!message->malformed.empty()) {
      reply = detail::error_reply(InvalidArgumentError("malformed request: " + message->malformed));
    } else {
      try {
        reply = store.handle(*message, peer, &held, &fds);
      } catch (const Error& e) {
        reply = detail::error_reply(e);
      } catch (const std::bad_alloc&) {
        reply = detail::error_reply(OutOfMemoryError("the store ran out of memory answering a request"));
      } catch (const nlohmann::json::exception& e) {  // a hostile body's wrong types
        reply = detail::error_reply(InvalidArgumentError(std::string("malformed request: ") + e.what()));
      } catch (const std::exception& e) {
        reply = detail::error_reply(IoError(std::string("the store failed to answer: ") + e.what()));
      } catch (...) {
        reply = detail::error_reply(IoError("the store failed to answer"));
      }
    }
    if (!reply.value("ok", false)) ++store.errors;
    try {
      if (!detail::send_message(fd, reply, fds)) break;
    } catch (const Error& e) {  // a reply over one record's size: its error instead
      ++store.errors;
      try {
        if (!detail::send_message(fd, detail::error_reply(e))) break;
      } catch (const std::exception&) {
        break;
      }
    } catch (const std::exception& e) {
      log::debug("store: a reply failed: {}", e.what());
      break;
    }
  }
  store.release(held);
}

// Whatever a peer sent, read and dropped (descriptors closed) without waiting.
void drain(int fd) {
  for (;;) {
    char byte;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * detail::kStoreMaxFds)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    if (::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) <= 0) return;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      for (std::size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); ++i) {
        int received;
        std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        ::close(received);
      }
    }
  }
}

// Peers that are not served (refused, or over a connection limit) get one reply and are closed
// by the accepting thread: they hold no thread and no connection slot. Each stays open for
// kLinger first, its requests read and dropped, so that the close finds nothing unread (a close
// with unread data resets the peer before it reads the reply); at most kMaxLingering at once.
class TurnedAway {
 public:
  void add(int fd, const Error& why) {
    try {
      (void)detail::send_message(fd, detail::error_reply(why), {}, MSG_DONTWAIT);
    } catch (const std::exception&) {
    }
    if (waiting_.size() >= kMaxLingering) {
      drain(fd);
      ::close(fd);
      return;
    }
    try {
      waiting_.push_back({fd, std::chrono::steady_clock::now() + kLinger});
    } catch (...) {
      ::close(fd);
    }
  }
  // Closes those whose time is up (all of them where `all`).
  void settle(bool all = false) {
    const auto now = std::chrono::steady_clock::now();
    while (!waiting_.empty() && (all || waiting_.front().until <= now)) {
      drain(waiting_.front().fd);
      ::close(waiting_.front().fd);
      waiting_.pop_front();
    }
  }
  ~TurnedAway() { settle(true); }

 private:
  static constexpr std::chrono::milliseconds kLinger{200};
  static constexpr std::size_t kMaxLingering = 256;
  struct Waiting {
    int fd;
    std::chrono::steady_clock::time_point until;
  };
  std::deque<Waiting> waiting_;
};

// As many descriptors as the hard limit allows: each connection holds one.
void raise_descriptor_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

}  // namespace

int detail::serve_store_with(const StoreServerOptions& given, const detail::ImagePlanner& planner) {
  StoreServerOptions options = given;
  Env* env = options.env != nullptr ? options.env : default_env();
  if (options.socket.empty()) options.socket = default_store_socket();
  if (options.budget_bytes == 0) {
    const std::optional<HostMemoryLimit> limit = read_host_memory_limit(env);
    if (!limit) throw InvalidArgumentError("the machine's memory cannot be read: give the store a budget (--budget)");
    options.budget_bytes = static_cast<std::uint64_t>(static_cast<double>(limit->available_bytes) * kDefaultStoreShare);
    log::info("store: budget {} bytes ({} of what {} leaves)", options.budget_bytes, kDefaultStoreShare, limit->source);
  }
  if (options.max_connections == 0) options.max_connections = 1;
  if (options.max_connections_per_uid == 0) options.max_connections_per_uid = 1;
  for (std::string& prefix : options.remote_allow) prefix = remote::canonical_url(prefix);
  raise_descriptor_limit();
  detail::ListeningSocket listener = detail::listen_on(options.socket, options.socket_mode);
  // Note [Huge pages for the store] (docs/store.md): a client maps a 4 KiB-page entry at
  // about 5 GB/s (a page-table entry per page), a huge-page one at memory speed.
  if (const std::string huge = shmem_huge_pages(); huge == "never" || huge == "deny") {
    log::warn("store: shared memory gets no huge pages here (transparent_hugepage/shmem_enabled is {}): clients "
              "map entries page by page; set it to advise (docs/store.md)", huge);
  }
  Store store(options, env, planner);
  struct Client {
    std::jthread thread;
    int fd;
    std::uint32_t uid;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Client> clients;
  std::map<std::uint32_t, std::size_t> per_uid;  // open connections of each uid
  std::set<std::uint32_t> warned;                // uids whose refusal was logged as a warning
  TurnedAway turned_away;
  std::mutex clients_mu;
  if (options.on_ready != nullptr) options.on_ready(options.on_ready_context);
  auto reap = [&] {
    std::lock_guard lock(clients_mu);
    for (auto it = clients.begin(); it != clients.end();) {
      if (it->done->load()) {
        it->thread.join();
        ::close(it->fd);
        if (--per_uid[it->uid] == 0) per_uid.erase(it->uid);
        it = clients.erase(it);
      } else {
        ++it;
      }
    }
  };
  while (options.stop == nullptr || !options.stop->load()) {
    pollfd p{listener.fd.get(), POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    reap();
    turned_away.settle();
    if (ready <= 0) continue;
    const int fd = ::accept4(listener.fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) ::usleep(10'000);  // until a connection closes
      continue;
    }
    try {
      Peer peer;
      if (!peer_allowed(fd, options, &peer)) {
        ++store.refused;
        if (warned.insert(peer.uid).second) {
          log::warn("store: refused a client of uid {} (allowed: the daemon's uid, root, --allow-uid)", peer.uid);
        } else {
          log::debug("store: refused a client of uid {}", peer.uid);
        }
        turned_away.add(fd, IoError("uid " + std::to_string(peer.uid) +
                                  " is not allowed to use the store (pinload store serve --allow-uid)",
                              ErrorContext{options.socket}));
        continue;
      }
      std::unique_lock lock(clients_mu);
      const std::size_t of_uid = per_uid.contains(peer.uid) ? per_uid[peer.uid] : 0;
      if (clients.size() >= options.max_connections || of_uid >= options.max_connections_per_uid) {
        const bool total = clients.size() >= options.max_connections;
        lock.unlock();
        ++store.busy;
        turned_away.add(fd, UnavailableError("the store is busy: it serves " +
                                           (total ? std::to_string(options.max_connections) + " connections"
                                                  : std::to_string(options.max_connections_per_uid) +
                                                        " connections of uid " + std::to_string(peer.uid)) +
                                           " already (--max-connections" + (total ? "" : "-per-uid") + ")",
                                       ErrorContext{options.socket}));
        continue;
      }
      auto done = std::make_shared<std::atomic<bool>>(false);
      ++store.clients;
      try {
        clients.push_back(Client{std::jthread([&store, fd, done, peer] {
                                   serve_connection(store, fd, peer);
                                   --store.clients;
                                   done->store(true);
                                 }),
                                 fd, peer.uid, done});
      } catch (...) {
        --store.clients;
        throw;
      }
      ++per_uid[peer.uid];
    } catch (const std::exception& e) {  // no thread for it (the process's limit): it is closed
      log::warn("store: a connection could not be served: {}", e.what());
      turned_away.add(fd, UnavailableError("the store is busy: " + std::string(e.what()), ErrorContext{options.socket}));
    }
  }
  {
    std::lock_guard lock(clients_mu);
    for (Client& c : clients) ::shutdown(c.fd, SHUT_RDWR);
  }
  for (Client& c : clients) {
    c.thread.join();
    ::close(c.fd);
  }
  return 0;
}

}  // namespace pinload
