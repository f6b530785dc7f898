// Compile-fail test: Autocast to a dtype autocast cannot compute in (any LibTorch version).
// expect: amp: Autocast<Dtype, Device> computes in a 16-bit dtype
// Passing twin (built without AMP_SHOULD_FAIL): Autocast<bf16, CPU>.
#include "amp/precision/autocast.h"

bool run() {
#ifdef AMP_SHOULD_FAIL
  amp::Autocast<amp::fp32, amp::CPU> autocast;
#else
  amp::Autocast<amp::bf16, amp::CPU> autocast;
#endif
  return autocast.enabled();
}
