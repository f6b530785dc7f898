#!/usr/bin/env bash
# The compile-time layer (every header in include/amp/core/) needs only c10's
# small headers. Checked from the include closure the preprocessor reports (g++ -M), not from a stopwatch, so a busy
# machine gives the same answer: no ATen header, no torch header but
# torch/version.h and torch/headeronly/ (where 2.14 moved c10's small core),
# and fewer than 15% of the headers <torch/torch.h> pulls in
# (compile time follows the headers parsed: 1.13 measured 0.2-0.6 s vs 10.8 s).
#   compile_time_test.sh FLAGS_FILE
set -u
flags_file=$1
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
closure() {  # the headers a TU that includes $1 reads, one per line
  printf '#include <%s>\n' "$1" > "$tmp/tu.cc"
  "$cxx" "${torch_flags[@]}" -M -Iinclude "$tmp/tu.cc" > "$tmp/deps" || { echo "FAIL: $1 does not compile" >&2; exit 1; }
  tr ' \\' '\n\n' < "$tmp/deps" | grep -vE '^$|:$' | sort -u
}
torch_n=$(closure torch/torch.h | wc -l)
echo "torch/torch.h: $torch_n headers"
fails=0
for path in include/amp/core/*.h; do
  h=${path#include/}
  closure "$h" > "$tmp/list"
  n=$(wc -l < "$tmp/list")
  heavy=$(grep -E '/ATen/|/torch/' "$tmp/list" | grep -vE '/torch/version\.h$|/torch/headeronly/' || true)
  verdict=ok
  if [ -n "$heavy" ] || (( n * 100 >= 15 * torch_n )); then verdict=FAIL; fails=$((fails + 1)); fi
  printf '%-4s %-26s %5d headers, %3d%% of torch/torch.h (limit 15%%)\n' "$verdict" "$h" "$n" $(( 100 * n / torch_n ))
  [ -n "$heavy" ] && printf '     pulls in: %s\n' $heavy
done
[ "$fails" -eq 0 ]
