// Compile-fail test: Float8<Recipe, Scaler> with a loss scaler.
// expect: amp: Float8<Recipe, Scaler> takes no loss scaler
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Float8<amp::Tensorwise, amp::NoScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Float8<amp::Tensorwise, amp::DynamicScaler>>());
#endif

int main() { return 0; }
