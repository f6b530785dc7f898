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
printf '#include <torch/torch.h>
#include <amp/amp.h>
#if !AMP_DETAIL_WITH_CUDA
#error AMP_DETAIL_WITH_CUDA is 0 with CUDA headers on the path
#endif
int main() {}
' >"$on"
units=("$on" tests/capture/capture_cuda_test.cc tests/train/activation_meter_test.cc tests/float8/block_scaled_test.cc tests/parity/parity.cc "bench/fused_step_bench.cc -DAMP_LIBTORCH_HAS_CUDA=1"
       "bench/float8_ffn_bench.cc -DAMP_LIBTORCH_HAS_CUDA=1")
for f in tests/*/*_test.cc; do
  grep -q 'AMP_DETAIL_HAS_NCCL' "$f" && units+=("$f")
done
# <torch/torch.h> with these flags, precompiled once per compiler and flags
# (every unit includes it; kept in $AMP_CUDA_PCH_CACHE, default
# ~/.cache/amp/cuda-pch): each unit loads it instead of parsing LibTorch again
# (2m01s -> 40 s with it, 1m12s when it is made).
key=$({ ${CXX:-g++} --version; printf '%s\n' "${flags[@]}"; ls -l --time-style=+%s "$torch_inc/torch/torch.h" "$cuda_inc/cuda_runtime_api.h"; } |
  sha256sum | cut -c1-16)
pch_dir=${AMP_CUDA_PCH_CACHE:-$HOME/.cache/amp/cuda-pch}/$key
if [ ! -f "$pch_dir/torch_pch.h.gch" ]; then
  rm -rf "$(dirname "$pch_dir")"/*  # one at a time: a .gch is about 600 MB
  pch_flags=()
  for f in "${flags[@]}"; do [ "$f" = -fsyntax-only ] || pch_flags+=("$f"); done
  mkdir -p "$pch_dir" && printf '#include <torch/torch.h>\n' >"$pch_dir/torch_pch.h" &&
    ${CXX:-g++} "${pch_flags[@]}" -x c++-header "$pch_dir/torch_pch.h" -o "$pch_dir/torch_pch.h.gch.tmp" &&
    mv "$pch_dir/torch_pch.h.gch.tmp" "$pch_dir/torch_pch.h.gch"
fi
pch=()
[ -f "$pch_dir/torch_pch.h.gch" ] && pch=(-include "$pch_dir/torch_pch.h" -Winvalid-pch -Wno-error=invalid-pch)
# The units side by side (one per core), reported in order.
tmp=$(mktemp -d); trap 'rm -f "$on"; rm -rf "$tmp"' EXIT
jobs_max=$(nproc 2>/dev/null || echo 2) i=0
for unit in "${units[@]}"; do
  while [ "$(jobs -pr | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  i=$((i + 1))
  read -r -a args <<<"$unit"
  ( ${CXX:-g++} "${flags[@]}" "${pch[@]}" "${args[@]}" >"$tmp/$i.log" 2>&1; echo $? >"$tmp/$i.status" ) &
done
wait
passed=0 failed=0 i=0
for unit in "${units[@]}"; do
  i=$((i + 1))
  read -r -a args <<<"$unit"
  name=${args[0]}
  [ "$name" = "$on" ] && name="amp.h with AMP_DETAIL_WITH_CUDA"
  if [ "$(cat "$tmp/$i.status")" = 0 ]; then
    passed=$((passed + 1))
    echo "PASS: $name" >&2
  else
    failed=$((failed + 1))
    echo "FAIL: $name" >&2
    grep -m20 -E 'error' "$tmp/$i.log" >&2
  fi
done
echo "CUDA code, compile only (LibTorch CUDA headers in $torch_inc): $passed passed, $failed failed" >&3
[ "$failed" -eq 0 ]
