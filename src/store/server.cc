// The node store's daemon: Note [The node store] in pinload/store.h.
//
// One thread accepts; each connection gets a thread that answers its
// requests in order. Entries live in `Store`, under one mutex; a miss is
// filled outside it, by the connection that caused it, while the others that
// ask for the same key wait on `filled` (single flight).
#include <fcntl.h>
#include <openssl/evp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "base/log.h"
#include "base/parallel_for.h"
#include "pinload/memory_limit.h"
#include "pinload/remote.h"
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
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;  // safetensors' own cap
constexpr std::size_t kMaxConnections = 1024;

std::string sha256_hex(const void* bytes, std::size_t size) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes, size, digest, &length, EVP_sha256(), nullptr) != 1) throw std::bad_alloc();
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < length; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

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
};

class Store {
 public:
  Store(const StoreServerOptions& options, Env* env, const detail::ImagePlanner& planner)
      : options_(options), env_(env), planner_(planner) {}

  // Answers one request of a connection whose held entries are `held`.
  json handle(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held, std::vector<int>* fds_out);
  void release(std::vector<std::shared_ptr<Entry>>& held);
  json status();

  std::atomic<std::uint64_t> clients{0};
  std::atomic<std::uint64_t> refused{0};
  std::atomic<std::uint64_t> errors{0};

 private:
  json get(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held, std::vector<int>* fds_out);
  json get_remote(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held,
                  std::vector<int>* fds_out);
  // What get and get_remote share: the entry for `key` (made by `fill` on a miss, once however
  // many ask at once), held by the connection when `hold`, its memfd added to `fds_out`.
  json serve(const std::string& key, const std::string& path, const std::string& variant, const FileIdentity& identity,
             std::uint64_t bytes, bool hold, const std::function<void(Entry&)>& fill, std::vector<std::shared_ptr<Entry>>* held,
             std::vector<int>* fds_out);
  json evict(const detail::WireMessage& message);
  // Makes room for `charge` bytes: the budget first (evicting), then the
  // memory the daemon can still take. Called with mu_ held; throws
  // OutOfMemoryError.
  void make_room(std::uint64_t charge, const std::string& path);
  void fill(Entry& entry, int fd);
  void fill_remote(Entry& entry, const std::string& url, const std::string& version);
  void fill_image(Entry& entry, int fd, detail::ConvertedImage& image);

  const StoreServerOptions& options_;
  Env* env_;
  const detail::ImagePlanner& planner_;
  std::mutex mu_;
  std::condition_variable filled_;
  std::map<std::string, std::shared_ptr<Entry>> entries_;
  std::uint64_t bytes_ = 0;  // charges of entries filling or ready
  std::uint64_t tick_ = 0;
  std::uint64_t hits_ = 0, misses_ = 0, reads_ = 0, bytes_read_ = 0, evictions_ = 0;
};

json Store::handle(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held,
                   std::vector<int>* fds_out) {
  const auto op = message.body.find("op");
  if (op == message.body.end() || !op->is_string()) throw InvalidArgumentError("a request without an \"op\"");
  const std::string name = op->get<std::string>();
  if (name == "get") return get(message, held, fds_out);
  if (name == "get_remote") return get_remote(message, held, fds_out);
  if (name == "status") return {{"ok", true}, {"status", status()}};
  if (name == "evict") return evict(message);
  if (name == "release") {
    release(*held);
    return {{"ok", true}};
  }
  throw InvalidArgumentError("unknown op \"" + name + "\"");
}

json Store::get(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held,
                std::vector<int>* fds_out) {
  if (message.fds.size() != 1) throw InvalidArgumentError("\"get\" takes exactly one file descriptor");
  const int fd = message.fds[0].get();
  std::string path = "(unnamed)";
  if (const auto p = message.body.find("path"); p != message.body.end() && p->is_string()) path = p->get<std::string>();
  bool hold = true;
  if (const auto h = message.body.find("hold"); h != message.body.end() && h->is_boolean()) hold = h->get<bool>();
  FileStat st;
  if (const int rc = env_->stat(fd, &st); rc != 0) {
    throw IoError(std::string("stat of the client's file failed: ") + std::strerror(-rc), ErrorContext{path});
  }
  if (st.type != FileType::kRegular) {
    throw InvalidFileError(std::string("not a regular file but a ") + file_type_name(st.type), ErrorContext{path});
  }
  const int access = ::fcntl(fd, F_GETFL);
  if (access < 0 || (access & O_ACCMODE) == O_WRONLY) {
    throw InvalidArgumentError("the client's descriptor is not open for reading", ErrorContext{path});
  }
  // The key: the file's identity and its header's digest.
  std::uint64_t header_bytes = 0;
  unsigned char prefix[8] = {};
  if (st.size >= 8) {
    if (read_fully(env_, fd, reinterpret_cast<std::byte*>(prefix), 8, 0) != 0) {
      throw IoError("reading the header's length failed", ErrorContext{path, {}, 0, 8});
    }
    for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | prefix[i];
  }
  if (header_bytes > kMaxHeaderBytes || header_bytes > st.size - std::min<std::uint64_t>(st.size, 8)) {
    throw InvalidFileError("header length " + std::to_string(header_bytes) + " does not fit the file", ErrorContext{path, {}, 0, 8});
  }
  std::string header(header_bytes, '\0');
  if (header_bytes > 0 && read_fully(env_, fd, reinterpret_cast<std::byte*>(header.data()), header.size(), 8) != 0) {
    throw IoError("reading the header failed", ErrorContext{path, {}, 8, 8 + header_bytes});
  }
  const FileIdentity identity = FileIdentity::of(st);
  std::string key = std::to_string(identity.device) + ":" + std::to_string(identity.inode) + ":" +
                    std::to_string(identity.size) + ":" + std::to_string(identity.mtime_ns) + ":" +
                    sha256_hex(header.data(), header.size());
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
    const std::unique_ptr<detail::ConvertedImage> image = planner_(env_, fd, path, variant, options_.threads);
    reply = serve(key, path, variant.describe(), identity, image->bytes(), hold,
                  [&](Entry& e) { fill_image(e, fd, *image); }, held, fds_out);
  } else {
    reply = serve(key, path, {}, identity, st.size, hold, [&](Entry& e) { fill(e, fd); }, held, fds_out);
  }
  if (reply.value("ok", false)) {
    reply["identity"] = {{"device", identity.device}, {"inode", identity.inode}, {"size", identity.size},
                         {"mtime_ns", identity.mtime_ns}};
  }
  return reply;
}

// Note [Remote store entries] in pinload/store.h.
json Store::get_remote(const detail::WireMessage& message, std::vector<std::shared_ptr<Entry>>* held,
                       std::vector<int>* fds_out) {
  if (!message.fds.empty()) throw InvalidArgumentError("\"get_remote\" takes no file descriptor");
  const auto text = [&](const char* field) {
    const auto it = message.body.find(field);
    if (it == message.body.end() || !it->is_string() || it->get_ref<const std::string&>().empty()) {
      throw InvalidArgumentError(std::string("\"get_remote\" needs a non-empty string \"") + field + "\"");
    }
    return it->get<std::string>();
  };
  const std::string url = text("url");
  const std::string version = text("version");
  const auto size = message.body.find("size");
  if (size == message.body.end() || !size->is_number_unsigned()) {
    throw InvalidArgumentError("\"get_remote\" needs the object's \"size\"");
  }
  bool hold = true;
  if (const auto h = message.body.find("hold"); h != message.body.end() && h->is_boolean()) hold = h->get<bool>();
  const std::string shown = remote::display_url(url);
  if (!is_remote_path(url)) throw InvalidArgumentError("not an s3:// or http(s):// URL", ErrorContext{shown});
  if (remote::classify_validator(version, 0) != remote::Validator::kStrong) {
    throw InvalidArgumentError("a remote entry needs the object's strong ETag, not " + version, ErrorContext{shown});
  }
  // The object's name without a query (a presigned URL's signature changes; the object does not).
  const std::string key = "remote " + shown + " " + version;
  return serve(key, shown, {}, FileIdentity{}, size->get<std::uint64_t>(), hold,
               [&](Entry& e) { fill_remote(e, url, version); }, held, fds_out);
}

json Store::serve(const std::string& key, const std::string& path, const std::string& variant,
                  const FileIdentity& identity, std::uint64_t bytes, bool hold, const std::function<void(Entry&)>& fill_entry,
                  std::vector<std::shared_ptr<Entry>>* held, std::vector<int>* fds_out) {
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
    if (hold) {
      ++entry->holders;
      held->push_back(entry);
    }
  }
  if (!hit) {
    json failure;
    try {
      fill_entry(*entry);
    } catch (const Error& e) {
      failure = detail::error_reply(e);
    } catch (const std::bad_alloc&) {
      failure = detail::error_reply(OutOfMemoryError("no memory for the entry", ErrorContext{path}));
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
  EntryWriter(Entry& entry, int numa_node, Env* env) : entry_(entry) {
    const std::string& path = entry.path;
    const int memfd = ::memfd_create("pinload-store", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (memfd < 0) throw OutOfMemoryError(std::string("memfd_create failed: ") + std::strerror(errno), ErrorContext{path});
    entry.memfd = ScopedFd(default_env(), memfd);
    if (::ftruncate(memfd, static_cast<off_t>(entry.charge)) != 0) {
      throw OutOfMemoryError(std::string("sizing the entry failed: ") + std::strerror(errno), ErrorContext{path});
    }
    void* map = ::mmap(nullptr, entry.charge, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    if (map == MAP_FAILED) {
      throw OutOfMemoryError(std::string("mapping the entry failed: ") + std::strerror(errno), ErrorContext{path});
    }
    base_ = static_cast<std::byte*>(map);
    (void)::madvise(map, entry.charge, MADV_HUGEPAGE);
    if (numa_node >= 0) (void)env->bind_memory(map, entry.charge, numa_node);
  }
  ~EntryWriter() {
    if (base_ != nullptr) ::munmap(base_, entry_.charge);
  }
  EntryWriter(const EntryWriter&) = delete;
  EntryWriter& operator=(const EntryWriter&) = delete;

  std::byte* data() const noexcept { return base_; }

  // Sealed: no process can write, grow or shrink what others map.
  void seal() {
    entry_.huge_bytes = huge_page_bytes_at(base_);
    ::munmap(base_, entry_.charge);
    base_ = nullptr;
    if (::fcntl(entry_.memfd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
      throw IoError(std::string("sealing the entry failed: ") + std::strerror(errno), ErrorContext{entry_.path});
    }
  }

 private:
  Entry& entry_;
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
  // The client's file through a source (Note [Byte sources]): buffered
  // reads through the client's descriptor, direct ones through a reopen of
  // it in /proc (so the client's descriptor keeps its flags), where the file
  // allows them and is neither cached nor on a network filesystem.
  SourceOptions reads;
  reads.direct = DirectIo::kAuto;
  detail::LocalFileSource source(env_, "/proc/self/fd/" + std::to_string(fd), &entry.identity, reads, fd);
  try {
    source.open();
    fill_in_chunks(entry.bytes, options_.threads, [&](std::uint64_t at, std::size_t n) {
      // Whole 4 KiB pages: the memfd is sized past the file's end.
      source.read(at, n, base + at, (n + 4095) / 4096 * 4096);
    });
  } catch (const Error& e) {  // name the client's path, not /proc's
    ErrorContext context = e.context();
    context.file = path;
    throw_error(e.code(), e.message(), std::move(context));
  }
  FileStat after;
  if (env_->stat(fd, &after) != 0 || !(FileIdentity::of(after) == entry.identity)) {
    throw IoError("the file was modified while the store read it", ErrorContext{path});
  }
  out.seal();
  log::info("store: read {} ({} bytes, {} direct, {} in huge pages)", path, entry.bytes, source.direct() ? "" : "not",
            entry.huge_bytes);
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
// environment's credentials, or the URL's presigned query), every range asked If-Match the
// client's ETag, so the entry is the version the client's header came from or the fill fails.
void Store::fill_remote(Entry& entry, const std::string& url, const std::string& version) {
  EntryWriter out(entry, options_.numa_node, env_);
  std::byte* base = out.data();
  RemoteOptions remote_options;
  remote_options.connections = std::max(options_.threads, 1u);
  const std::shared_ptr<remote::RemoteClient> client = remote::client_for(remote_options);
  remote::ObjectInfo object;
  object.path = url;
  object.size = entry.bytes;
  object.etag = version;
  fill_in_chunks(entry.bytes, options_.threads,
                 [&](std::uint64_t at, std::size_t n) { client->read(object, at, n, base + at); });
  out.seal();
  log::info("store: fetched {} ({} bytes, ETag {}, {} in huge pages)", entry.path, entry.bytes, version,
            entry.huge_bytes);
}

json Store::evict(const detail::WireMessage& message) {
  if (message.fds.size() > 1) throw InvalidArgumentError("\"evict\" takes at most one file descriptor");
  std::optional<FileIdentity> only;
  if (message.fds.size() == 1) {
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
    if (e.state == Entry::State::kReady && e.holders == 0 && (!only || e.identity == *only)) {
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

json Store::status() {
  std::lock_guard lock(mu_);
  std::vector<std::shared_ptr<Entry>> ready;
  std::uint64_t huge = 0;
  for (const auto& [key, e] : entries_) {
    if (e->state != Entry::State::kReady) continue;
    ready.push_back(e);
    huge += e->huge_bytes;
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
          {"refused", refused.load()},             {"errors", errors.load()}, {"numa_node", options_.numa_node},
          {"shmem_huge_pages", shmem_huge_pages()},
          {"entries", std::move(entries)}};
}

bool peer_allowed(int fd, const StoreServerOptions& options, std::uint32_t* uid) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  *uid = cred.uid;
  if (options.allow_any_uid || cred.uid == 0 || cred.uid == ::geteuid()) return true;
  return std::find(options.allowed_uids.begin(), options.allowed_uids.end(), cred.uid) != options.allowed_uids.end();
}

// Answers a connection's requests in order until it closes. A peer that
// SO_PEERCRED does not allow (`refusal` set) gets that error for each.
void serve_connection(Store& store, int fd, const std::optional<IoError>& refusal) {
  std::vector<std::shared_ptr<Entry>> held;
  for (;;) {
    std::optional<detail::WireMessage> message;
    try {
      message = detail::receive_message(fd);
    } catch (const Error& e) {
      log::debug("store: a connection failed: {}", e.what());
      break;
    }
    if (!message) break;
    json reply;
    std::vector<int> fds;
    if (refusal) {
      reply = detail::error_reply(*refusal);
    } else if (!message->malformed.empty()) {
      ++store.errors;
      reply = detail::error_reply(InvalidArgumentError("malformed request: " + message->malformed));
    } else {
      try {
        reply = store.handle(*message, &held, &fds);
      } catch (const Error& e) {
        reply = detail::error_reply(e);
      } catch (const std::bad_alloc&) {
        reply = detail::error_reply(OutOfMemoryError("the store ran out of memory answering a request"));
      } catch (const std::exception& e) {  // nlohmann::json's type errors on a hostile body
        reply = detail::error_reply(InvalidArgumentError(std::string("malformed request: ") + e.what()));
      }
      if (!reply.value("ok", false)) ++store.errors;
    }
    try {
      if (!detail::send_message(fd, reply, fds)) break;
    } catch (const Error& e) {
      log::debug("store: a reply failed: {}", e.what());
      break;
    }
  }
  store.release(held);
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
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::list<Client> clients;
  std::mutex clients_mu;
  if (options.on_ready != nullptr) options.on_ready(options.on_ready_context);
  auto reap = [&] {
    std::lock_guard lock(clients_mu);
    for (auto it = clients.begin(); it != clients.end();) {
      if (it->done->load()) {
        it->thread.join();
        ::close(it->fd);
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
    if (ready <= 0) continue;
    const int fd = ::accept4(listener.fd.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::uint32_t uid = 0;
    std::optional<IoError> refusal;
    if (!peer_allowed(fd, options, &uid)) {
      ++store.refused;
      log::warn("store: refused a client of uid {} (allowed: the daemon's uid, root, --allow-uid)", uid);
      refusal.emplace("uid " + std::to_string(uid) + " is not allowed to use the store (pinload store serve --allow-uid)",
                      ErrorContext{options.socket});
    }
    if (store.clients.load() >= kMaxConnections) {
      (void)detail::send_message(fd, detail::error_reply(UnavailableError("the store serves " +
                                                                           std::to_string(kMaxConnections) + " connections already")));
      ::close(fd);
      continue;
    }
    ++store.clients;
    auto done = std::make_shared<std::atomic<bool>>(false);
    std::lock_guard lock(clients_mu);
    clients.push_back(Client{std::jthread([&store, fd, done, refusal] {
                               serve_connection(store, fd, refusal);
                               --store.clients;
                               done->store(true);
                             }),
                             fd, done});
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
