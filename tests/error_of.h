// tests/error_of.h: the message of the error a call throws, for tests that
// check amp's and torch's error texts exactly.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace amp_test {

// The message of the c10::Error that f throws (without LibTorch's backtrace),
// "<not a c10::Error> ..." for another exception, "<no error>" if none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return std::string("<not a c10::Error> ") + e.what();
  }
  return "<no error>";
}

}  // namespace amp_test
