// Compile-fail test: True<D> with D not a dtype tag.
// expect: amp: True<Dtype> needs a dtype tag
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::True<amp::bf16>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::True<float>>());
#endif

int main() { return 0; }
