// Compile-fail test: Float8<Recipe> with something that is not a float8 recipe.
// expect: amp: Float8<Recipe> needs a float8 recipe
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Float8<amp::Delayed<16, 0>>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Float8<amp::Delayed<0, 0>>>());
#endif

int main() { return 0; }
