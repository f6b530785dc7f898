// Compile-fail test: a user-defined Scaler without a name (kName).
// expect: amp: a user-defined Scaler needs a name for the policy's precision string
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/scaler/no_scaler.h>
#include <amp/core/rules.h>

// The passing twin: the same scaler with a name.
struct Named : amp::NoScaler {
  static constexpr const char* kName = "named";
};
static_assert(amp::detail::check_policy<amp::Mixed<amp::bf16, Named>>());

#ifdef AMP_SHOULD_FAIL
struct Unnamed : amp::NoScaler {};
static_assert(amp::detail::check_policy<amp::Mixed<amp::bf16, Unnamed>>());
#endif

int main() { return 0; }
