#!/usr/bin/env bash
# README checks: (1) every ```cpp block compiles as its own translation unit
# (-fsyntax-only, -Wall -Wextra -Werror on amp's code); (2) the support matrix
# table printed by tools/support_matrix for this LibTorch appears verbatim.
#   readme_test.sh README.md SUPPORT_MATRIX_BIN FLAGS_FILE
set -u
readme=$1 matrix_bin=$2 flags_file=$3
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")  # -std= comes with them
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
awk -v dir="$tmp" '
  /^```cpp/ { n++; file = sprintf("%s/block_%02d.cc", dir, n); inblock = 1; next }
  /^```/ && inblock { inblock = 0; close(file); next }
  inblock { print > file }
' "$readme"
fails=0 count=0
for f in "$tmp"/block_*.cc; do
  [ -e "$f" ] || continue
  count=$((count + 1))
  if log=$("$cxx" "${torch_flags[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude "$f" 2>&1); then
    echo "ok   README C++ block $(basename "$f")"
  else
    echo "FAIL README C++ block $(basename "$f"):"; sed 's/^/    /' "$f"; echo "$log" | head -20
    fails=$((fails + 1))
  fi
done
[ "$count" -gt 0 ] || { echo "FAIL: no \`\`\`cpp blocks found in $readme"; exit 1; }
while IFS= read -r line; do
  [ -z "$line" ] && continue
  case "$line" in "(computed for"*) continue ;; esac
  # The README shows LibTorch 1.13's matrix; from 2.3 the fp16 rows' CPU
  # column is "yes", and the Float8 rows' columns follow 2.5 (CUDA) and 2.8
  # (CPU) (the README's second table says so).
  older=${line%| yes | yes |}"| no | yes |"
  float8_older=$(sed -E 's/\| (yes|no) \| (yes|no) \|$/| no | no |/' <<<"$line")
  if ! grep -qxF -- "$line" "$readme" && ! { [[ "$line" == *fp16* ]] && grep -qxF -- "$older" "$readme"; } &&
    ! { [[ "$line" == *Float8* ]] && grep -qxF -- "$float8_older" "$readme"; }; then
    echo "FAIL: README's support matrix lacks this computed row: $line"; fails=$((fails + 1))
  fi
done < <("$matrix_bin")
echo "$count C++ blocks checked, $fails failures"
[ "$fails" -eq 0 ]
