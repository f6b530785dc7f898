// Compile-fail test: True<tf32> on CPU.
// expect: amp: True<tf32> is a tensor-core math mode
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_supported<amp::True<amp::tf32>, amp::CUDA>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_supported<amp::True<amp::tf32>, amp::CPU>());
#endif

int main() { return 0; }
