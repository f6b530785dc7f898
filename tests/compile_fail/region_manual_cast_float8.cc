// Compile-fail test: a manual bf16 cast inside a Float8 region (what is not a
// float8 linear autocasts to bf16). Checked through the rule Region::cast
// runs, so that it holds on every LibTorch (a Float8 Region needs 2.5/2.8).
// expect: amp: manual bf16 casts inside a Mixed<bf16, ...> or Float8 region
// Passing twin (built without AMP_SHOULD_FAIL): a cast to fp32 is fine.
#include "amp/precision/region.h"

static_assert(amp::detail::check_region_cast<amp::Float8<amp::Tensorwise>, amp::fp32>());

#ifdef AMP_SHOULD_FAIL
static_assert(amp::detail::check_region_cast<amp::Float8<amp::Tensorwise>, amp::bf16>());
#endif

int main() { return 0; }
