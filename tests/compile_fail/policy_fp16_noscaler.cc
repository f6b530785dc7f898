// Compile-fail test: Mixed<fp16, NoScaler> (fp16 gradients underflow).
// expect: amp: Mixed<fp16, NoScaler> would let fp16 gradients underflow
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Mixed<amp::fp16, amp::DynamicScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Mixed<amp::fp16, amp::NoScaler>>());
#endif

int main() { return 0; }
