// pinload/store.h: the node store. One daemon per machine keeps each model
// file it is asked for in sealed shared memory, and every process on the
// machine maps that one copy instead of reading the file again.
//
// Note [The node store]
// A pool lives and dies with its process: a restarted worker reads the disk
// again, and eight workers on a node hold eight copies. The store is a daemon
// (`pinload store serve`, serve_store below) with a Unix socket:
//  - A client opens the file itself and passes the descriptor over the socket
//    (SCM_RIGHTS), so it never obtains bytes it could not read on its own.
//  - The daemon keys the file by what makes its bytes: its identity (device,
//    inode, size, mtime, ctime and generation: file_identity.h), a SHA-256 of
//    its header, and for files under 64 KiB a SHA-256 of all their bytes. So a
//    changed file (a rewrite with its mtime set back included) or a new file
//    on a deleted one's inode is a new entry, while the old one stays valid
//    for whoever maps it. It reads only through the client's descriptor (a
//    regular file open for reading, not O_PATH), direct where the client
//    opened it O_DIRECT; it never reopens the file.
//  - On a miss it reads the whole file (direct I/O where the file allows it,
//    `threads` readers) into a memfd, in huge pages where the kernel gives
//    them to shared memory, and seals it (F_SEAL_WRITE, SHRINK, GROW): no
//    process can change the bytes that others see. Two clients asking for the
//    same file at once cause one read (single flight).
//  - The reply carries the memfd. The client maps it private (copy-on-write:
//    a client that writes to a tensor changes only its own copy), faults the
//    pages in, and hands out tensors that are views of it, as a zero-copy
//    load does (Note [Zero-copy loads] in loader.h).
//  - An entry is held while a connection that received it is open; a load
//    keeps its connection for as long as any of its tensors lives, so its
//    holds end with its tensors or its process, a crash included. Held
//    entries are never evicted; unheld ones go least recently used first
//    when a new entry needs room within the budget.
//  - A new entry must also fit the memory the daemon may still take
//    (memory_limit.h); otherwise the request fails with OutOfMemoryError and
//    the daemon goes on serving, never OOM-killed.
// The memory is charged to the daemon's memory cgroup (it touches the pages
// first) and is shared: a mapping adds nothing to a client's own usage but
// its page tables. docs/store.md covers deployment, trust and accounting.
//
// Note [Store clients]
// A load with LoadOptions::store set (CLI --store, Python store=, or the
// PINLOAD_STORE variable) asks the store for each local file, and each
// remote object with a strong ETag (Note [Remote store entries]), of a load
// without conversion or verification; what the store does not serve is read
// as usual. Where the daemon cannot be reached, the load warns once per
// process and reads the files itself, unless StoreOptions::required, which
// makes that an UnavailableError. A load to a device takes its host copy from
// the store and copies it to the device from there (no staging copy).
//
// Note [Store device loads]
// A device load whose files the store serves copies each tensor to the
// device straight from the client's mapping of the entry (upload()): no
// staging copy. Before the copies the client registers the mapping with the
// device (Device::register_host: CUDA's cudaHostRegister, read-only, which
// pins the shared pages without breaking their copy-on-write sharing), so
// the copies run as from pinned memory; the registration lasts as long as
// tensors use the mapping (Note [Copies from mapped memory] in
// src/load/device_mapped.h). The pages are the node's one copy, resident in shared
// memory; what each client pays is the registration of its mapping (page
// tables: one entry per huge page where the entry has them). Where the
// device refuses, the copies run from pageable memory;
// PINLOAD_STORE_REGISTER=0 asks for that (scripts/gpu-check.sh measures
// both). The alternative, a daemon that copies into its clients' device
// buffers through CUDA IPC handles (sllm-store), would register once per
// node but give the daemon a CUDA context per GPU; docs/store.md says what
// decides between them.
//
// Note [Remote store entries]
// A remote object (s3://, http(s)://) whose ETag is a strong one is an entry
// too, keyed by its canonical URL (remote::canonical_url: what libcurl
// fetches, query included), its size and that ETag:
//  - The client reads the header itself, with its own credentials, which
//    fixes the ETag (Note [Remote consistency]); only then does it ask the
//    store, naming the URL, the ETag and the size. A client that cannot read
//    the object never learns its ETag and never asks.
//  - The daemon fetches only what it may fetch for any client: an object
//    under one of the operator's --remote-allow prefixes (with the
//    credentials of its own environment, AWS_*). A presigned URL is no
//    licence: the daemon cannot check its signature, and a server that
//    ignores queries would serve the daemon what its client cannot reach
//    (the daemon's network is a privilege too). For any other object it answers
//    "read_yourself", and the client reads the object itself, even under
//    `required`: no confused deputy fetches for a client what only the
//    daemon can reach.
//  - The server's first answer must name the object by the strong ETag the
//    client asked for, at the size it asked for; with no strong ETag it is
//    "read_yourself" too (nothing would pin the version), another ETag or
//    size fails the fill. Every later range is asked If-Match that ETag, so
//    the entry is the version whose header the client parsed, or the fill
//    fails and the client reads the object itself (an error under
//    `required`).
//  - Objects without a strong ETag (nginx's coarse ones, weak ones, none)
//    are read by the client as before: nothing would pin the version.
// docs/store.md says what this means for whose credentials a node trusts.
//
// Note [Converted store entries]
// A load with LoadOptions::dtype (Note [Conversion on load] in convert.h) to
// the host asks the store for the converted variant of each file: an entry
// of its own, keyed by the file's key plus the dtype options and the file's
// name prefix (keep patterns match prefixed names).
//  - On a miss the daemon loads the client's file with a converting Loader
//    (the same conversion a local load does, FP8 scales included) and writes
//    what that load hands out into the entry as a safetensors image: the
//    tensors in load order, the file's __metadata__, the data section at a
//    4096-byte offset. The image's size is planned from the header and the
//    scales before the budget makes room for it; while it is written the
//    daemon holds the converted bytes twice for a moment (the converting
//    load's pool, then the entry).
//  - The client parses the image's header out of its mapping and hands out
//    views of it, in the order and with the metadata of a local conversion.
//  - Only where every file is served, and no FP8 weight's scale lies in
//    another file than the weight; otherwise the load converts locally.
//    Device loads with a dtype convert on the device as before (the stored
//    bytes cross the bus, fewer for FP8), and remote objects are converted by
//    their client.
// `pinload store warm --dtype` fills converted entries ahead.
//
// Note [Huge pages for the store]
// A client's mapping of an entry costs a page-table entry per page. In 4 KiB
// pages that is about 5 GB/s on this project's VM (MADV_POPULATE_READ of a
// private mapping); in 2 MiB pages, one entry per huge page, over 1000 GB/s.
// The daemon asks for huge pages (MADV_HUGEPAGE), which the kernel gives
// shared memory only where transparent_hugepage/shmem_enabled is "advise",
// "within_size" or "always"; the default "never" makes the daemon warn at
// start, and `pinload store status` shows the setting and the bytes in huge
// pages. Entries are sized in whole huge pages from 2 MiB up. docs/store.md
// says how a deployment sets it.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pinload/convert.h"
#include "pinload/env.h"
#include "pinload/file_identity.h"

namespace pinload {

// "PINLOAD_STORE": a socket path, or "1"/"default" for default_store_socket().
inline constexpr const char* kStoreVariable = "PINLOAD_STORE";

// $XDG_RUNTIME_DIR/pinload/store.sock where XDG_RUNTIME_DIR is set, else
// /run/pinload/store.sock.
std::string default_store_socket();

// How a load uses the store (Note [Store clients]).
struct StoreOptions {
  std::string socket;     // "" = no store (unless PINLOAD_STORE is set)
  bool required = false;  // an unreachable store is an UnavailableError, not a local load
  bool disabled = false;  // never the store, whatever PINLOAD_STORE says (the daemon's own loads)
  bool active() const noexcept { return !disabled && !socket.empty(); }
  // `socket`, else PINLOAD_STORE (not where `disabled`) ("1", "default", "true": the default socket;
  // "", "0", "off": none). Never throws.
  static StoreOptions from_environment(StoreOptions given);
};

struct StoreServerOptions {
  std::string socket;              // "" = default_store_socket()
  std::uint64_t budget_bytes = 0;  // 0 = kDefaultStoreShare of the memory left at start
  int numa_node = -1;              // where entries' memory goes; -1 = anywhere
  unsigned threads = 8;            // readers per miss
  unsigned socket_mode = 0660;     // the socket file's permissions
  // Peers served besides the daemon's own uid and root (SO_PEERCRED).
  std::vector<std::uint32_t> allowed_uids;
  bool allow_any_uid = false;      // every peer the socket's permissions let in
  // Connections served at once, in all and per uid; a peer over either gets a
  // "busy" UnavailableError and is closed. Refused peers count toward neither.
  std::size_t max_connections = 1024;
  std::size_t max_connections_per_uid = 256;
  // URL prefixes (canonical: remote::canonical_url) under which the daemon
  // fetches remote objects with its own credentials for any client
  // (Note [Remote store entries]); other objects are read by their clients.
  std::vector<std::string> remote_allow;
  Env* env = nullptr;              // null: the POSIX env (tests inject faults here)
  const std::atomic<bool>* stop = nullptr;  // serve_store returns once it is true
  // Called once the socket listens (tests, --ready-file).
  void (*on_ready)(void* context) = nullptr;
  void* on_ready_context = nullptr;
};

// The default budget: this share of the memory the daemon could take at
// start (memory_limit.h), so a node keeps room for its workers.
inline constexpr double kDefaultStoreShare = 0.5;

// Serves until *options.stop: binds the socket (replacing a stale one that no
// daemon answers on; another live daemon on it is an error), accepts clients
// that SO_PEERCRED allows and answers their requests. Returns 0, or throws
// pinload::Error for a socket it cannot bind.
int serve_store(const StoreServerOptions& options);

struct StoreEntryStatus {
  std::string path;  // as the first client named it
  std::string dtype;  // "" as stored; a converted entry's dtype options: "BF16 keep=[...]"
  std::uint64_t bytes = 0;
  std::uint64_t holders = 0;  // connections holding it
  std::uint64_t hits = 0;
};

struct StoreStatus {
  std::uint64_t budget_bytes = 0;
  std::uint64_t bytes = 0;          // held in entries (what the node pays)
  std::uint64_t huge_page_bytes = 0;  // of those, in huge pages (ShmemHugePages at fill)
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t reads = 0;          // files the daemon read (misses that filled)
  std::uint64_t bytes_read = 0;
  std::uint64_t evictions = 0;
  std::uint64_t clients = 0;        // connections open now
  std::uint64_t refused = 0;        // peers refused by SO_PEERCRED
  std::uint64_t busy = 0;           // peers turned away over the connection limits
  std::uint64_t errors = 0;         // malformed or failed requests
  int numa_node = -1;
  std::string shmem_huge_pages;  // transparent_hugepage/shmem_enabled's choice (docs/store.md)
  std::vector<StoreEntryStatus> entries;  // most recently used first
};

// One connection to a store. Throws UnavailableError where the daemon cannot
// be reached or goes away mid-request; the daemon's own refusals come back as
// the pinload::Error it sent (IoError, OutOfMemoryError, ...).
class StoreConnection;

// The store's commands for the CLI and tools.
StoreStatus store_status(const std::string& socket);
// Puts each local file of `paths` (files, indexes, folders) in the store
// without holding it, converted where `dtype` is active (Note [Converted
// store entries]). Returns the bytes now in the store for them.
std::uint64_t store_warm(const std::string& socket, const std::vector<std::string>& paths, Env* env = nullptr,
                         const DTypeOptions& dtype = {});
// Drops unheld entries: those of `paths`, or all where empty. Returns how
// many were dropped.
std::uint64_t store_evict(const std::string& socket, const std::vector<std::string>& paths, Env* env = nullptr);

}  // namespace pinload
