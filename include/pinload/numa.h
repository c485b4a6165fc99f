// pinload/numa.h: which NUMA node a GPU sits on, and which CPUs a node has.
//
// On a machine with several NUMA nodes, a host-to-device copy from memory on
// the GPU's own node avoids the inter-socket link, and reader threads on that
// node's CPUs write the pool's pages without crossing it either. This header
// reads the topology from sysfs and decides the placement; the pool's
// backends bind memory (Env::bind_memory) and the loader pins its readers
// (ThreadAffinityScope). See Note [NUMA placement].
//
// Note [NUMA placement]
// A load places its pool and readers on node N when, in order:
//   - LoadOptions::numa.node is kNumaNone: never;
//   - the machine has at most one node: never (nothing to choose; no mbind,
//     no affinity change, no Env call at all);
//   - numa.node is a node id: that node (one that does not exist is an
//     InvalidArgumentError);
//   - kNumaAuto: the target device's node (Device::numa_node: the PCI
//     device's sysfs `numa_node`), when it is known and is one of the
//     machine's nodes. Host-only loads have no device to be near: the OS's
//     first-touch placement already puts pages near the reader threads.
// Under kNumaAuto a malformed sysfs file never fails a load: the loader warns
// and leaves placement to the OS. Memory is bound with MPOL_PREFERRED, not
// MPOL_BIND: when the node is full, pages come from another node rather than
// the load failing.
//
// Note [sysfs format]
// /sys/devices/system/node/nodeN/cpulist: "0-3,8-11\n" (possibly empty: a
// node with memory and no CPUs). /sys/bus/pci/devices/<bus id>/numa_node: a
// decimal node id, or -1 when the firmware does not say. The kernel never
// writes anything else, so other text (a broken fake tree, a changed kernel)
// is an InvalidFileError naming the file, never a silent guess. A missing
// file or directory means "unknown": no node.
//
// Thread safety: NumaTopology is an immutable value once built; it may be
// shared between threads. No globals: each reader of the topology reads it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "pinload/env.h"

namespace pinload {

// LoadOptions::numa.node values besides a node id (>= 0).
inline constexpr int kNumaAuto = -2;  // the target device's node, if any
inline constexpr int kNumaNone = -1;  // leave placement to the OS

struct NumaNode {
  int id = -1;
  std::vector<int> cpus;  // ascending, no duplicates; empty for a CPU-less node
};

class NumaTopology {
 public:
  // An empty topology: nothing known, treated as one node.
  NumaTopology() = default;
  // For tests and callers that know better; nodes are sorted by id.
  // `sysfs_root` is where node_of_pci_device looks.
  explicit NumaTopology(std::vector<NumaNode> nodes, std::string sysfs_root = "/sys");

  // Reads <sysfs_root>/devices/system/node/node*/cpulist. No such directory
  // (a kernel without NUMA): an empty topology. Throws InvalidFileError
  // naming the file for a malformed or unreadable cpulist (Note [sysfs format]).
  static NumaTopology read(const std::string& sysfs_root = "/sys");

  const std::vector<NumaNode>& nodes() const noexcept { return nodes_; }
  // The node with `id`, or null.
  const NumaNode* node(int id) const noexcept;
  // More than one node: only then does placement matter.
  bool multi_node() const noexcept { return nodes_.size() > 1; }
  const std::string& sysfs_root() const noexcept { return sysfs_root_; }

  // The node of the PCI device `bus_id` (any case, with or without domain:
  // "0000:19:00.0", "00000000:1A:00.0", "19:00.0"), from
  // <sysfs_root>/bus/pci/devices/<normalised id>/numa_node; -1 when the file
  // is missing or says -1. Throws InvalidFileError for a malformed bus id or
  // file.
  int node_of_pci_device(std::string_view bus_id) const;

 private:
  std::vector<NumaNode> nodes_;
  std::string sysfs_root_ = "/sys";
};

// Parses a kernel cpulist ("0-3,8-11", "5", "" or "\n"): ascending CPU ids,
// no duplicates. Throws InvalidFileError, naming `file` and what is wrong
// (an empty item, a descending range, a non-number, a number over 1<<20).
std::vector<int> parse_cpulist(std::string_view text, const std::string& file = {});
// The inverse: "0-3,8-11"; "" for none.
std::string format_cpulist(const std::vector<int>& cpus);

// The PCI address as sysfs spells it: lowercase hex, domain of at least 4
// digits ("0000:19:00.0"). Throws InvalidFileError for anything else.
std::string normalize_pci_bus_id(std::string_view bus_id);

// Where a load's memory and readers go: plain data.
struct NumaPlacement {
  int node = -1;          // -1: leave placement to the OS (no mbind)
  std::vector<int> cpus;  // the readers' CPUs; empty: leave threads alone
  bool active() const noexcept { return node >= 0; }
};

// Decides the placement of Note [NUMA placement]. `requested` is kNumaAuto,
// kNumaNone or a node id; `device_node` the target device's node (-1:
// unknown or no device). Throws InvalidArgumentError for a requested node that
// the topology lacks.
NumaPlacement place_numa(const NumaTopology& topology, int requested, int device_node);

// Pins the calling thread to `cpus` (intersected with the CPUs it may
// already use) for its lifetime, then restores the affinity it had. With
// empty `cpus`, or an empty intersection, it makes no Env call and changes
// nothing. Failures are logged at debug level and ignored: placement is an
// optimisation. *env must outlive it.
class ThreadAffinityScope {
 public:
  ThreadAffinityScope(Env* env, const std::vector<int>& cpus);
  ~ThreadAffinityScope();
  ThreadAffinityScope(const ThreadAffinityScope&) = delete;
  ThreadAffinityScope& operator=(const ThreadAffinityScope&) = delete;

  bool pinned() const noexcept { return pinned_; }

 private:
  Env* env_;
  std::vector<int> previous_;
  bool pinned_ = false;
};

}  // namespace pinload
