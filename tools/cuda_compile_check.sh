#!/usr/bin/env bash
# Compiles amp's CUDA code (-fsyntax-only; nothing runs: for machines without
# a GPU) against a CUDA LibTorch's headers and the CUDA toolkit's:
#   tools/cuda_compile_check.sh TORCH_INCLUDE CUDA_INCLUDE
# TORCH_INCLUDE: e.g. Debian 13's libtorch-cuda-dev unpacked (tools/dev does
# that); CUDA_INCLUDE: cuda_runtime_api.h and nccl.h. Each translation unit
# that has CUDA-only code (under AMP_DETAIL_WITH_CUDA / AMP_DETAIL_HAS_NCCL) is one test;
# prints "CUDA code, compile only (...): N passed, M failed" to fd 3 (or stdout).
set -u
torch_inc=$1 cuda_inc=$2
cd "$(dirname "$0")/.."
if ! { true >&3; } 2>/dev/null; then exec 3>&1; fi
flags=(-std=c++17 -fsyntax-only -Wall -Wextra -Werror -Iinclude -isystem "$torch_inc"
       -isystem "$torch_inc/torch/csrc/api/include" -isystem "$cuda_inc" -DUSE_C10D_GLOO -DUSE_C10D_NCCL)
on=$(mktemp --suffix=.cc)
trap 'rm -f "$on"' EXIT
printf '#include <amp/amp.h>
#if !AMP_DETAIL_WITH_CUDA
#error AMP_DETAIL_WITH_CUDA is 0 with CUDA headers on the path
#endif
int main() {}
' >"$on"
units=("$on" tests/capture/capture_cuda_test.cc tests/train/activation_meter_test.cc tests/parity/parity.cc "bench/fused_step_bench.cc -DAMP_LIBTORCH_HAS_CUDA=1"
       "bench/float8_ffn_bench.cc -DAMP_LIBTORCH_HAS_CUDA=1")
for f in tests/*/*_test.cc; do
  grep -q 'AMP_DETAIL_HAS_NCCL' "$f" && units+=("$f")
done
passed=0 failed=0
for unit in "${units[@]}"; do
  read -r -a args <<<"$unit"
  name=${args[0]}
  [ "$name" = "$on" ] && name="amp.h with AMP_DETAIL_WITH_CUDA"
  if log=$(${CXX:-g++} "${flags[@]}" "${args[@]}" 2>&1); then
    passed=$((passed + 1))
    echo "PASS: $name" >&2
  else
    failed=$((failed + 1))
    echo "FAIL: $name" >&2
    printf '%s\n' "$log" | grep -m20 -E 'error' >&2
  fi
done
echo "CUDA code, compile only (LibTorch CUDA headers in $torch_inc): $passed passed, $failed failed" >&3
[ "$failed" -eq 0 ]
