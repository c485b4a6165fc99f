// Test support: one table of byte-source faults (Note [Byte sources] in
// byte_source.h), run against whatever source a load opens. The same table
// runs on local files read direct, buffered and from their mappings
// (tests/unit/source_faults_test.cc) and on remote objects behind nginx and
// SeaweedFS (tests/remote/test_source_faults.py, through the
// pinload_source_faults program).
//
// A FaultSource wraps each source of a load (LoadOptions::wrap_source). A
// failing read throws IoError naming the file and the range (from a mapping:
// the mapping cannot serve the range, and its read fails); an open throws as
// a vanished file would; a mapping that cannot serve makes the load read
// instead. What every case checks: a failed load is the typed error of the
// failed read, returns nothing, and leaves no descriptor, thread or pool
// block behind; a load that did not fail holds the file's bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "pinload/byte_source.h"
#include "pinload/error.h"
#include "pinload/loader.h"

namespace pinload::testing {

enum class SourceFaultKind {
  kNone,          // reads as they are
  kReadFails,     // the read covering a byte fails (EIO)
  kOpenFails,     // opening the source fails (the file vanished)
  kMappingFails,  // the mapping serves nothing: every range is read instead
};

struct SourceFault {
  std::string name;
  SourceFaultKind kind = SourceFaultKind::kNone;
  // kReadFails: where the failing read is, as a fraction of the file's
  // tensor data (0: its first byte; 1: its last).
  double where = 0;
};

// The table.
const std::vector<SourceFault>& source_faults();

// Injects `fault` into the source it wraps; counts what it did.
class FaultSource final : public ByteSourceWrapper {
 public:
  struct Counts {
    std::atomic<std::uint64_t> reads{0}, mapped_copies{0}, refused_copies{0}, injected{0}, direct_reads{0};
  };
  // `target_byte`: the byte whose read fails (kReadFails).
  FaultSource(std::unique_ptr<ByteSource> target, SourceFault fault, std::uint64_t target_byte,
              std::shared_ptr<Counts> counts);
  void open() override;
  void read(std::uint64_t offset, std::uint64_t bytes, std::byte* dest, std::uint64_t capacity) override;
  bool copy_mapped(std::uint64_t offset, std::uint64_t bytes, std::byte* dest) override;

 private:
  SourceFault fault_;
  std::uint64_t target_byte_;
  std::shared_ptr<Counts> counts_;
};

struct FaultOutcome {
  bool failed = false;
  ErrorCode code = ErrorCode::kIo;
  ErrorContext context;
  std::string what;
  std::uint64_t target_byte = 0;                // the byte whose read was to fail
  // The file was cut at target_byte (FaultEnv's truncation), so any read at
  // or past it may be the one that fails first: the error's range starts
  // there or later.
  bool cut_at_target = false;
  std::map<std::string, std::string> digests;  // name -> SHA-256 of its bytes, when the load did not fail
  std::uint64_t reads = 0, mapped_copies = 0, refused_copies = 0, injected = 0;
  std::uint64_t direct_reads = 0;  // reads while the source was direct
  int fds_before = 0, fds_after = 0;
  int threads_before = 0, threads_after = 0;
  std::uint64_t pool_in_use_after = 0;  // bytes of the load's pool still in blocks after it ended
};

// The byte whose read fails under a kReadFails fault at `where`.
std::uint64_t fault_target_byte(const std::string& path, const LoadOptions& options, double where);

// Loads `path` (one file, local or remote) on the host with `options` and
// `fault` injected into its source, reading through `env` (null: the
// default; a FaultEnv injects faults below the source instead, with `fault`
// then kNone).
FaultOutcome load_with_fault(const std::string& path, LoadOptions options, const SourceFault& fault,
                             Env* env = nullptr);

// What is wrong with `outcome` for `fault` on `path`: "" where nothing is.
// `expected`: the digests of a clean read (the independent reader's), checked
// wherever the load did not fail. An error names `path`, or a file under
// `cache_dir` where that is set (a remote object's cached copy is read as a
// local file: Note [Remote cache]). `fd_allowance`: descriptors a load may
// leave open (a remote client's pool growing to its connections).
std::string judge(const FaultOutcome& outcome, const SourceFault& fault, const std::string& path,
                  const std::map<std::string, std::string>& expected, const std::string& cache_dir = "",
                  int fd_allowance = 0);

}  // namespace pinload::testing
