// A C++ program that loads through the process's session (pinload/session.h)
// from the node store, for tests/store: prints one line per tensor, name and
// the SHA-256 of its bytes (tab-separated, name order), then "store N" (the
// files mapped from the store), and holds its tensors until stdin closes.
//
//   pinload_store_client MODEL SOCKET
#include <cstdio>
#include <iostream>
#include <map>
#include <span>
#include <string>

#include "cli/command.h"
#include "pinload/error.h"
#include "pinload/session.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: pinload_store_client MODEL SOCKET\n");
    return 2;
  }
  try {
    pinload::LoadOptions options;
    options.store.socket = argv[2];
    options.store.required = true;
    pinload::LoadHandle handle = pinload::Session::process().start("cpu", options, {argv[1]});
    const pinload::StateDict sd = handle.wait();
    std::map<std::string, std::string> digests;
    for (const pinload::Tensor& t : sd) digests[t.name()] = pinload::cli::sha256_hex(t.bytes());
    for (const auto& [name, digest] : digests) std::cout << name << '\t' << digest << '\n';
    std::cout << "store " << handle.progress().files_store << std::endl;
    for (std::string line; std::getline(std::cin, line);) {
    }
    return 0;
  } catch (const pinload::Error& e) {
    std::fprintf(stderr, "pinload_store_client: %s\n", e.what());
    return 1;
  }
}
