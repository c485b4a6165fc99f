#include "pinload/numa.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "base/log.h"
#include "pinload/error.h"

namespace pinload {
namespace {

constexpr int kMaxNode = 4095;      // Linux's MAX_NUMNODES is at most 1024
constexpr int kMaxCpu = 1 << 20;    // far above any machine's CPU ids
constexpr std::size_t kMaxSysfsFile = 64u << 10;

std::string_view trim_right(std::string_view text) {
  while (!text.empty() && (std::isspace(static_cast<unsigned char>(text.back())) || text.back() == '\0')) {
    text.remove_suffix(1);
  }
  return text;
}

// A whole decimal number, optionally negative; false for anything else.
bool parse_int(std::string_view text, int* out) {
  if (text.empty() || text.front() == '+') return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

// A small sysfs file; false when it does not exist or cannot be opened.
bool read_small_file(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out->clear();
  char buffer[4096];
  while (in.read(buffer, sizeof buffer) || in.gcount() > 0) {
    out->append(buffer, static_cast<std::size_t>(in.gcount()));
    if (out->size() > kMaxSysfsFile) {
      throw InvalidFileError("sysfs file larger than " + std::to_string(kMaxSysfsFile) + " bytes", ErrorContext{path});
    }
  }
  return true;
}

[[noreturn]] void bad_cpulist(const std::string& why, std::string_view text, const std::string& file) {
  throw InvalidFileError("malformed cpulist \"" + std::string(trim_right(text).substr(0, 80)) + "\": " + why, ErrorContext{file});
}

// 1..max_digits hex digits, at most `max_value`.
bool parse_hex(std::string_view text, std::size_t max_digits, unsigned max_value, unsigned* out) {
  if (text.empty() || text.size() > max_digits) return false;
  for (char c : text) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
  }
  unsigned long value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (ec != std::errc() || end != text.data() + text.size() || value > max_value) return false;
  *out = static_cast<unsigned>(value);
  return true;
}

[[noreturn]] void bad_bus_id(std::string_view id) {
  throw InvalidFileError("malformed PCI bus id \"" + std::string(id.substr(0, 80)) +
                         "\" (expected [domain:]bus:device.function in hex, as \"0000:19:00.0\")");
}

}  // namespace

std::vector<int> parse_cpulist(std::string_view text, const std::string& file) {
  const std::string_view list = trim_right(text);
  std::vector<int> cpus;
  if (list.empty()) return cpus;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    const std::size_t comma = std::min(list.find(',', pos), list.size());
    const std::string_view item = list.substr(pos, comma - pos);
    if (item.empty()) bad_cpulist("empty item", text, file);
    if (item.find_first_of(":/") != std::string_view::npos) bad_cpulist("strided ranges are not supported", text, file);
    const std::size_t dash = item.find('-');
    int first = 0, last = 0;
    if (dash == std::string_view::npos) {
      if (!parse_int(item, &first) || first < 0) bad_cpulist("\"" + std::string(item) + "\" is not a CPU id", text, file);
      last = first;
    } else if (!parse_int(item.substr(0, dash), &first) || !parse_int(item.substr(dash + 1), &last) || first < 0 ||
               last < 0) {
      bad_cpulist("\"" + std::string(item) + "\" is not a range of CPU ids", text, file);
    }
    if (last > kMaxCpu) bad_cpulist("CPU id " + std::to_string(last) + " is out of range", text, file);
    if (first > last) bad_cpulist("descending range \"" + std::string(item) + "\"", text, file);
    for (int cpu = first; cpu <= last; ++cpu) cpus.push_back(cpu);
    pos = comma + 1;
  }
  // The kernel's own parser accepts items in any order; so does this one.
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpulist(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]);
    if (j > i) out += '-' + std::to_string(cpus[j]);
    i = j + 1;
  }
  return out;
}

std::string normalize_pci_bus_id(std::string_view bus_id) {
  const std::string_view id = trim_right(bus_id);
  const std::size_t dot = id.rfind('.');
  if (dot == std::string_view::npos) bad_bus_id(id);
  const std::string_view head = id.substr(0, dot);
  const std::size_t last_colon = head.rfind(':');
  if (last_colon == std::string_view::npos) bad_bus_id(id);
  const std::size_t first_colon = head.find(':');
  const bool has_domain = first_colon != last_colon;
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  if (has_domain && !parse_hex(head.substr(0, first_colon), 8, 0xffffffffu, &domain)) bad_bus_id(id);
  const std::size_t bus_begin = has_domain ? first_colon + 1 : 0;
  if (!parse_hex(head.substr(bus_begin, last_colon - bus_begin), 2, 0xff, &bus) ||
      !parse_hex(head.substr(last_colon + 1), 2, 0x1f, &device) || !parse_hex(id.substr(dot + 1), 1, 7, &function)) {
    bad_bus_id(id);
  }
  char out[32];
  std::snprintf(out, sizeof out, "%04x:%02x:%02x.%x", domain, bus, device, function);
  return out;
}

NumaTopology::NumaTopology(std::vector<NumaNode> nodes, std::string sysfs_root)
    : nodes_(std::move(nodes)), sysfs_root_(std::move(sysfs_root)) {
  std::sort(nodes_.begin(), nodes_.end(), [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
}

NumaTopology NumaTopology::read(const std::string& sysfs_root) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(sysfs_root) / "devices/system/node";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NumaTopology({}, sysfs_root);
  std::vector<NumaNode> nodes;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    int id = -1;
    if (name.size() <= 4 || name.compare(0, 4, "node") != 0 ||
        !std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        !parse_int(std::string_view(name).substr(4), &id) || id > kMaxNode) {
      continue;  // "online", "possible", "power", ...
    }
    const std::string file = (it->path() / "cpulist").string();
    std::string text;
    if (!read_small_file(file, &text)) throw InvalidFileError("cannot read the node's cpulist", ErrorContext{file});
    nodes.push_back(NumaNode{id, parse_cpulist(text, file)});
  }
  if (ec) throw InvalidFileError("cannot list NUMA nodes: " + ec.message(), ErrorContext{dir.string()});
  return NumaTopology(std::move(nodes), sysfs_root);
}

const NumaNode* NumaTopology::node(int id) const noexcept {
  for (const NumaNode& n : nodes_) {
    if (n.id == id) return &n;
  }
  return nullptr;
}

int NumaTopology::node_of_pci_device(std::string_view bus_id) const {
  const std::string file = sysfs_root_ + "/bus/pci/devices/" + normalize_pci_bus_id(bus_id) + "/numa_node";
  std::string text;
  if (!read_small_file(file, &text)) return -1;
  int node = 0;
  if (!parse_int(trim_right(text), &node) || node < -1 || node > kMaxNode) {
    throw InvalidFileError("malformed numa_node \"" + std::string(trim_right(text).substr(0, 80)) +
                           "\" (expected a node id or -1)", ErrorContext{file});
  }
  return node;
}

NumaPlacement place_numa(const NumaTopology& topology, int requested, int device_node) {
  if (requested == kNumaNone) return {};
  if (requested < kNumaAuto) throw InvalidArgumentError("NUMA node " + std::to_string(requested) + " is not auto, none or >= 0");
  if (requested >= 0) {
    // An empty topology stands for one node, 0.
    const bool exists = topology.nodes().empty() ? requested == 0 : topology.node(requested) != nullptr;
    if (!exists) {
      std::vector<int> ids;
      for (const NumaNode& n : topology.nodes()) ids.push_back(n.id);
      throw InvalidArgumentError("NUMA node " + std::to_string(requested) + " does not exist; this machine has node(s) " +
                             (ids.empty() ? std::string("0") : format_cpulist(ids)));
    }
  }
  if (!topology.multi_node()) return {};
  const int node = requested >= 0 ? requested : device_node;
  const NumaNode* chosen = node >= 0 ? topology.node(node) : nullptr;
  if (chosen == nullptr) return {};
  return NumaPlacement{chosen->id, chosen->cpus};
}

ThreadAffinityScope::ThreadAffinityScope(Env* env, const std::vector<int>& cpus) : env_(env) {
  if (cpus.empty()) return;
  if (const int rc = env_->get_thread_affinity(&previous_); rc != 0) {
    log::debug("cannot read the thread's CPU affinity ({}); leaving it", log::errno_text(-rc));
    return;
  }
  std::vector<int> allowed;
  std::set_intersection(cpus.begin(), cpus.end(), previous_.begin(), previous_.end(), std::back_inserter(allowed));
  if (allowed.empty() || allowed == previous_) return;  // nothing usable, or nothing to change
  if (const int rc = env_->set_thread_affinity(allowed); rc != 0) {
    log::debug("cannot pin a reader thread to CPUs {} ({}); leaving it", format_cpulist(allowed),
              log::errno_text(-rc));
    return;
  }
  pinned_ = true;
}

ThreadAffinityScope::~ThreadAffinityScope() {
  if (pinned_) env_->set_thread_affinity(previous_);
}

}  // namespace pinload
