// tests/distributed/process_case.h: one case of a multi-process test program (run through
// tools/launch by distributed_test.sh): its name and rank, fail()/check(),
// which print "FAIL <case> (rank r): why" and exit 1, and the process group
// with AMP_DP_TIMEOUT_MS's timeout (default 20000).
#pragma once

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "amp/distributed/process_group.h"

namespace test_case {

inline std::string name;
inline int rank = -1;

[[noreturn]] inline void fail(const std::string& why) {
  std::cout << "FAIL " << name << " (rank " << rank << "): " << why << std::endl;
  std::exit(1);
}
inline void check(bool ok, const std::string& why) {
  if (!ok) fail(why);
}

inline std::chrono::milliseconds timeout() {
  const char* v = std::getenv("AMP_DP_TIMEOUT_MS");
  return std::chrono::milliseconds(v ? std::atol(v) : 20000);
}

// A file's bytes ("" when it cannot be read).
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Fails if a temporary file of an atomic write of `path` (path.tmp.*) is left beside it.
inline void check_no_temp_file(const std::string& path) {
  const std::string dir = path.substr(0, path.find_last_of('/') + 1);
  const std::string base = path.substr(dir.size());
  for (const auto& entry : std::filesystem::directory_iterator(dir.empty() ? "." : dir)) {
    const std::string name = entry.path().filename().string();
    check(name.rfind(base + ".tmp", 0) != 0, "a temporary file was left: " + name);
  }
}

inline amp::ProcessGroup init() {
  auto pg = amp::init_process_group(amp::ProcessGroupOptions().timeout(timeout()).threads(1));
  rank = pg.rank();
  return pg;
}

}  // namespace test_case
