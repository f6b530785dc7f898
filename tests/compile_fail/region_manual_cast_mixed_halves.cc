// Compile-fail test: a manual cast to the OTHER 16-bit dtype inside a Mixed<bf16, ...>
// region (fp16 and bf16 in one forward make autocast's promote ops throw).
// expect: amp: manual fp16 casts inside a Mixed<bf16
// Passing twin (built without AMP_SHOULD_FAIL): a cast to fp64 is fine.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x) {
  amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
#ifdef AMP_SHOULD_FAIL
  return region.cast<amp::fp16>(x);
#else
  return region.cast<amp::fp64>(x);
#endif
}
