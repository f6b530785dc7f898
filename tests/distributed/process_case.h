// tests/distributed/process_case.h: one case of a multi-process test program (run through
// tools/launch by distributed_test.sh): its name and rank, fail()/check(),
// which print "FAIL <case> (rank r): why" and exit 1, and the process group
// with AMP_DP_TIMEOUT_MS's timeout (default 20000).
#pragma once

#include <chrono>
#include <cstdlib>
#include <iostream>
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

inline amp::ProcessGroup init() {
  auto pg = amp::init_process_group(amp::ProcessGroupOptions().timeout(timeout()).threads(1));
  rank = pg.rank();
  return pg;
}

}  // namespace test_case
