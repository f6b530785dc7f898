// Compile-fail test: a block-scaled recipe (MXFP8, NVFP4) with a loss scaler.
// expect: amp: Float8<MXFP8<...> or NVFP4<...>, Scaler> takes no loss scaler
// Built twice: as is, with the other rules' twins (//tests:cf_twins, must compile),
// and with -DAMP_SHOULD_FAIL (tools/compile_fail_test.sh, must fail with the rule's amp: message).
#include <amp/core/rules.h>

// The passing twin: a valid use of the same entry point.
static_assert(amp::detail::check_policy<amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>, amp::NoScaler>>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_policy<amp::Float8<amp::MXFP8<amp::MxScaleMode::kFloor>, amp::DynamicScaler>>());
#endif

int main() { return 0; }
