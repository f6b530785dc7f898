// Compile-fail test: a block-scaled recipe given to Mixed (or True) as a dtype.
// expect: amp: MXFP8 and NVFP4 are Float8 recipes
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Float8<amp::NVFP4<>>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Mixed<amp::NVFP4<>, amp::NoScaler>>());
#endif

int main() { return 0; }
