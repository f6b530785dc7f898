// Compile-fail test: Autocast<fp16, CPU> before LibTorch 2.3 (CPU fp16 autocast
// arrived in 2.3, where the pair is valid: the _libtorch_lt_2_3 suffix makes Bazel
// and CMake build this test only against an older LibTorch).
// expect: amp: Autocast<fp16, CPU> needs LibTorch 2.3
// Passing twin (built without AMP_SHOULD_FAIL): Autocast<bf16, CPU>.
#include "amp/precision/autocast.h"

bool run() {
#ifdef AMP_SHOULD_FAIL
  amp::Autocast<amp::fp16, amp::CPU> autocast;
#else
  amp::Autocast<amp::bf16, amp::CPU> autocast;
#endif
  return autocast.enabled();
}
