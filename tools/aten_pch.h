// <ATen/ATen.h>, precompiled once per LibTorch line (//tools:aten_pch) for the
// header self-containment check: a header that includes ATen first has its
// unit load this instead of parsing ATen (tools/header_test.sh says when).
#include <ATen/ATen.h>
