// tests/tmp_path.h: a file name in the test's own temporary directory
// (Bazel's TEST_TMPDIR, else the system's).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace amp_test {

inline std::string tmp_path(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return (std::filesystem::path(dir ? dir : std::filesystem::temp_directory_path().string()) / name).string();
}

}  // namespace amp_test
