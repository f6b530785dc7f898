// Compile-fail test: Mixed<bf16, S> with a loss-scaling S.
// expect: amp: Mixed<bf16, Scaler> with a loss-scaling Scaler is rejected
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Mixed<amp::bf16, amp::NoScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Mixed<amp::bf16, amp::DynamicScaler>>());
#endif

int main() { return 0; }
