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
#include <memory>
#include <string>

#include "pinload/error.h"
#include "remote/remote_client.h"
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
    // The warm-up: the remote client's first connections open here.
    const SourceFault& clean = source_faults().at(0);
    const FaultOutcome first = load_with_fault(path, options, clean);
    if (first.failed) {
      std::fprintf(stderr, "pinload_source_faults: the clean load failed: %s\n", first.what.c_str());
      return 1;
    }
    for (const auto& [name, digest] : first.digests) std::cout << name << '\t' << digest << '\n';
    bool all_ok = true;
    // Between loads the remote client keeps its curl handles, each with its
    // connection and libcurl's wake-up descriptors. A load may leave that many
    // more descriptors for each handle its pool gained (how many it gains
    // depends on how the reads overlapped), and none for anything else; every
    // handle it opened must be back in the pool.
    const std::shared_ptr<remote::RemoteClient> client = remote::client_for(options.resolve.remote);
    constexpr int kPerHandle = remote::RemoteClient::kDescriptorsPerHandle;
    const remote::RemoteClient::HandleCounts handles_at_start = client->handle_counts();
    const int fds_at_start = first.fds_after;
    int fds_at_end = fds_at_start;
    for (const SourceFault& fault : source_faults()) {
      const remote::RemoteClient::HandleCounts before = client->handle_counts();
      const FaultOutcome outcome = load_with_fault(path, options, fault);
      const remote::RemoteClient::HandleCounts after = client->handle_counts();
      fds_at_end = outcome.fds_after;
      const char* cache_dir = std::getenv("PINLOAD_CACHE_DIR");
      std::string why = judge(outcome, fault, path, first.digests, cache_dir != nullptr ? cache_dir : "",
                              kPerHandle * (static_cast<int>(after.pooled) - static_cast<int>(before.pooled)));
      if (after.open != after.pooled) {
        why += "curl handles: " + std::to_string(after.open) + " open, " + std::to_string(after.pooled) + " pooled; ";
      }
      all_ok = all_ok && why.empty();
      if (why.empty()) {
        std::cout << "ok " << fault.name << " (" << outcome.injected << " faults injected)";
        if (outcome.failed) std::cout << " " << outcome.context.file;
        std::cout << '\n';
      } else {
        std::cout << "FAIL " << fault.name << ": " << why << '\n';
      }
    }
    const remote::RemoteClient::HandleCounts handles_at_end = client->handle_counts();
    if (fds_at_end > fds_at_start + kPerHandle * (static_cast<int>(handles_at_end.pooled) - static_cast<int>(handles_at_start.pooled))) {
      std::cout << "FAIL the table: descriptors " << fds_at_start << " -> " << fds_at_end << " over its "
                << source_faults().size() << " loads, pooled curl handles " << handles_at_start.pooled << " -> "
                << handles_at_end.pooled << '\n';
      all_ok = false;
    }
    std::cout.flush();
    return all_ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "pinload_source_faults: %s\n", e.what());
    return 1;
  }
}
