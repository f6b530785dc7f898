// Compile-fail test: a Scaler without the scaler interface.
// expect: amp: the Scaler of Mixed<Compute, Scaler> lacks the scaler interface
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Mixed<amp::fp16, amp::StaticScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Mixed<amp::fp16, int>>());
#endif

int main() { return 0; }
