// The Env's write faults (tests/support/fault_env.h) under the remote object
// cache (Note [Remote cache]), for tests/remote/test_cache_write_faults.py:
// each load of URL runs through a FaultEnv that fails one of the cache's
// writes (open, a pwrite, fsync, rename) or shortens them, with an empty
// cache folder (PINLOAD_CACHE_DIR). A failed write never fails the load,
// whose bytes are a clean load's, and leaves nothing in the folder: no .part
// file, no entry, no digest file; short writes commit the entry. Prints "ok
// NAME (N writes)" or "FAIL NAME: why" a case; exits 1 if a case failed.
//
//   pinload_cache_write_faults URL
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <iostream>
#include <string>
#include <vector>

#include "fault_env.h"
#include "pinload/error.h"
#include "source_faults.h"

int main(int argc, char** argv) {
  using namespace pinload;
  using namespace pinload::testing;
  namespace fs = std::filesystem;
  const char* cache_dir = std::getenv("PINLOAD_CACHE_DIR");
  if (argc != 2 || cache_dir == nullptr) {
    std::fprintf(stderr, "usage: PINLOAD_CACHE_DIR=DIR pinload_cache_write_faults URL\n");
    return 2;
  }
  const std::string url = argv[1];
  struct Case {
    const char* name;
    Faults faults;
    bool commits;
  };
  const std::vector<Case> cases = {
      {"short_writes_and_eintr", Faults{.eintr_every_other = true, .short_write_bytes = 4096}, true},
      {"open_for_write_fails", Faults{.refuse_open_write = true}, false},
      {"first_write_fails", Faults{.fail_write_at = 1}, false},
      {"a_later_write_fails", Faults{.fail_write_at = 3}, false},
      {"fsync_fails", Faults{.refuse_sync = true}, false},
      {"rename_fails", Faults{.refuse_rename = true}, false},
  };
  try {
    LoadOptions options;
    options.block_size = 256u << 10;
    options.resolve.remote.connections = 4;
    const SourceFault& clean = source_faults().at(0);
    bool all_ok = true;
    std::map<std::string, std::string> expected;
    for (const Case& c : cases) {
      std::error_code ec;
      fs::remove_all(cache_dir, ec);
      fs::create_directories(cache_dir);
      FaultEnv env(c.faults);
      const FaultOutcome outcome = load_with_fault(url, options, clean, &env);
      std::string why;
      if (outcome.failed) why += "the load failed: " + outcome.what + "; ";
      if (expected.empty()) expected = outcome.digests;
      if (outcome.digests != expected) why += "the bytes differ from the first load's; ";
      std::vector<std::string> left;
      for (const auto& e : fs::directory_iterator(cache_dir)) left.push_back(e.path().filename().string());
      if (c.commits && left.size() != 2) why += "expected an entry and its digests, found " + std::to_string(left.size()) + " files; ";
      if (!c.commits && !left.empty()) why += "left " + left.front() + " (and " + std::to_string(left.size() - 1) + " more); ";
      if (env.writes() == 0 && !c.faults.refuse_open_write) why += "no write reached the Env; ";
      if (why.empty()) {
        std::cout << "ok " << c.name << " (" << env.writes() << " writes)\n";
      } else {
        std::cout << "FAIL " << c.name << ": " << why << '\n';
        all_ok = false;
      }
    }
    for (const auto& [name, digest] : expected) std::cout << name << '\t' << digest << '\n';
    std::cout.flush();
    return all_ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "pinload_cache_write_faults: %s\n", e.what());
    return 1;
  }
}
