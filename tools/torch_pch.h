// <torch/torch.h>, precompiled once per LibTorch line (//tools:torch_pch) for
// the compile-only checks that may see all of LibTorch first: the compile-fail
// rules, the documentation's blocks and the benchmarks' syntax check. Not the
// header self-containment check, which must see only what each header includes.
#include <torch/torch.h>
