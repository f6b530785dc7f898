// Compile-fail test: a block-scaled recipe before LibTorch 2.1 (built only against such a
// LibTorch: the _libtorch_lt_2_1 suffix tells Bazel and CMake).
// expect: amp: Float8's block-scaled recipes (MXFP8, NVFP4) need LibTorch 2.1 or newer
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_supported<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_supported<amp::Float8<amp::MXFP8<>>, amp::CPU>());
#endif

int main() { return 0; }
