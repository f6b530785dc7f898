// Compile-fail test: Mixed<> with a compute dtype other than fp16/bf16.
// expect: amp: Mixed<Compute, Scaler> needs a 16-bit compute dtype
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Mixed<amp::bf16, amp::NoScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Mixed<amp::fp32, amp::DynamicScaler>>());
#endif

int main() { return 0; }
