// The byte-source fault table (tests/support/source_faults.h) on one file,
// for tests/remote/test_source_faults.py: a remote object behind nginx or
// SeaweedFS. Prints the clean load's tensors (name and SHA-256 of its bytes,
// tab-separated, name order), then one line per case of the table, "ok NAME
// (N faults injected) [the file the error names]" or "FAIL NAME: why"; exits 1 if a case failed. With PINLOAD_CACHE_DIR set,
// the cases read the object cache's copy, and errors may name it.
//
//   pinload_source_faults PATH_OR_URL
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "pinload/error.h"
#include "source_faults.h"

int main(int argc, char** argv) {
  using namespace pinload;
  using namespace pinload::testing;
  if (argc != 2) {
    std::fprintf(stderr, "usage: pinload_source_faults PATH_OR_URL\n");
    return 2;
  }
  const std::string path = argv[1];
  try {
    LoadOptions options;
    options.block_size = 256u << 10;
    options.resolve.remote.connections = 4;
    // The warm-up: the remote client's pooled connections open here, so the
    // cases count only what a load leaves behind.
    const SourceFault& clean = source_faults().at(0);
    const FaultOutcome first = load_with_fault(path, options, clean);
    if (first.failed) {
      std::fprintf(stderr, "pinload_source_faults: the clean load failed: %s\n", first.what.c_str());
      return 1;
    }
    for (const auto& [name, digest] : first.digests) std::cout << name << '\t' << digest << '\n';
    bool all_ok = true;
    // The remote client's pool may still grow to its connections: allowed
    // per case, and over the whole table, where a descriptor leaked per load
    // would exceed it.
    const int connections = static_cast<int>(options.resolve.remote.connections);
    const int fds_at_start = first.fds_after;
    int fds_at_end = fds_at_start;
    for (const SourceFault& fault : source_faults()) {
      const FaultOutcome outcome = load_with_fault(path, options, fault);
      fds_at_end = outcome.fds_after;
      const char* cache_dir = std::getenv("PINLOAD_CACHE_DIR");
      const std::string why =
          judge(outcome, fault, path, first.digests, cache_dir != nullptr ? cache_dir : "", connections);
      all_ok = all_ok && why.empty();
      if (why.empty()) {
        std::cout << "ok " << fault.name << " (" << outcome.injected << " faults injected)";
        if (outcome.failed) std::cout << " " << outcome.context.file;
        std::cout << '\n';
      } else {
        std::cout << "FAIL " << fault.name << ": " << why << '\n';
      }
    }
    if (fds_at_end > fds_at_start + connections) {
      std::cout << "FAIL the table: descriptors " << fds_at_start << " -> " << fds_at_end << " over its "
                << source_faults().size() << " loads\n";
      all_ok = false;
    }
    std::cout.flush();
    return all_ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "pinload_source_faults: %s\n", e.what());
    return 1;
  }
}
