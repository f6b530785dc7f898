#!/usr/bin/env bash
# The compile-time layer (dtype.h, device.h, policy.h, traits.h,
# experiment.h) needs only c10's small headers: each must compile in under
# 15% of <torch/torch.h>'s time, measured side by side in this run (the best of
# 3 for each, so that a busy machine slows both alike).
#   compile_time_test.sh FLAGS_FILE
set -u
flags_file=$1
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
best_ms() {  # best of 3 -fsyntax-only compiles of a TU that includes $1
  printf '#include <%s>\n' "$1" > "$tmp/tu.cc"
  local best=999999999 i start end ms
  for i in 1 2 3; do
    start=$(date +%s%N)
    "$cxx" -std=c++17 -fsyntax-only -Iinclude "${torch_flags[@]}" "$tmp/tu.cc" || { echo "FAIL: $1 does not compile" >&2; exit 1; }
    end=$(date +%s%N)
    ms=$(( (end - start) / 1000000 ))
    (( ms < best )) && best=$ms
  done
  echo "$best"
}
torch_ms=$(best_ms torch/torch.h)
echo "torch/torch.h: ${torch_ms} ms"
fails=0
for h in amp/dtype.h amp/device.h amp/policy.h amp/traits.h amp/experiment.h; do
  ms=$(best_ms "$h")
  pct=$(( 100 * ms / torch_ms ))
  verdict=ok; (( ms * 100 >= 15 * torch_ms )) && { verdict=FAIL; fails=$((fails + 1)); }
  printf '%-4s %-18s %6d ms  %3d%% of torch/torch.h (limit 15%%)\n' "$verdict" "$h" "$ms" "$pct"
done
[ "$fails" -eq 0 ]
