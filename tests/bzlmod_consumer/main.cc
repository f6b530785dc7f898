// Built against amp as a Bazel module by tests/bzlmod_consumer_test.sh.
#include <amp/amp.h>

#include <iostream>

int main() {
  static_assert(amp::is_supported_v<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>);
  amp::dispatch_precision<amp::CPU>(
      "bf16-mixed", [](auto p) { std::cout << amp::precision_name<typename decltype(p)::type>() << "\n"; });
  return 0;
}
