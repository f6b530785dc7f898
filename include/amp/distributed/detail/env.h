// amp/distributed/detail/env.h: torchrun's environment variables read with
// errors that say what to set, and small string helpers of the process group.
#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <string>

namespace amp {
namespace detail {
// An exception's message without what follows its first line (a c10::Error's backtrace).
inline std::string first_line(const std::exception& e) {
  std::string msg = e.what();
  const auto nl = msg.find('\n');
  if (nl != std::string::npos) msg.resize(nl);
  return msg;
}

inline std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

inline int env_int(const char* name, long lo, long hi, const char* hint) {
  const std::string s = env_or_empty(name);
  TORCH_CHECK(!s.empty(), "amp: environment variable ", name, " is not set; ", hint);
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(s.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != s.c_str() && *end == '\0', "amp: environment variable ", name, "=\"", s,
              "\" is not an integer; ", hint);
  TORCH_CHECK(v >= lo && v <= hi, "amp: environment variable ", name, "=", v, " is out of range [", lo, ", ", hi, "]; ",
              hint);
  return static_cast<int>(v);
}

inline bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0;
}
}  // namespace detail
}  // namespace amp
