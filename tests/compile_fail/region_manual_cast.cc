// Compile-fail test: a manual cast to the compute dtype inside a Mixed<bf16, ...> region.
// expect: amp: manual bf16 casts inside a Mixed<bf16
// Passing twin (built without AMP_SHOULD_FAIL): a cast to fp32 is fine.
#include "amp/precision/region.h"

at::Tensor forward(const at::Tensor& x) {
  amp::Region<amp::Mixed<amp::bf16, amp::NoScaler>, amp::CPU> region;
#ifdef AMP_SHOULD_FAIL
  return region.cast<amp::bf16>(x);
#else
  return region.cast<amp::fp32>(x);
#endif
}
