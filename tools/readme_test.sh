#!/usr/bin/env bash
# Documentation checks: (1) every ```cpp block of README.md and of each other
# .md file given is parsed as its own translation unit, and all of them
# compile together to the end (tools/compile_units.sh: -fsyntax-only, -Wall
# -Wextra -Werror on amp's code); (2) every relative link to a .md file points
# at a file that exists; (3) the support matrix table printed by
# tools/support_matrix for this LibTorch appears verbatim in README.md.
#   readme_test.sh [--pch=HEADER] README.md SUPPORT_MATRIX_BIN FLAGS_FILE [DOC.md ...]
# --pch=HEADER: each block first loads HEADER's precompiled .gch
# (//tools:torch_pch, <torch/torch.h>, which nearly every block includes).
set -u
pch=()
case "${1:-}" in --pch=*) pch=("$1"); shift ;; esac
readme=$1 matrix_bin=$2 flags_file=$3
shift 3
docs=("$readme" "$@")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fails=0 count=0 blocks=() block_docs=()
for doc in "${docs[@]}"; do
  [ -f "$doc" ] || { echo "FAIL: $doc: no such file"; fails=$((fails + 1)); continue; }
  # One directory per document; its blocks are block_01.cc, block_02.cc, ...
  dir="$tmp/$(printf '%03d' "${#block_docs[@]}")_$(basename "$doc" .md)"
  block_docs+=("$doc")
  mkdir -p "$dir"
  awk -v dir="$dir" -v doc="$doc" '
    /^```cpp/ { n++; file = sprintf("%s/block_%02d.cc", dir, n); inblock = 1
                printf "#line %d \"%s\"\n", NR + 1, doc > file; next }
    /^```/ && inblock { inblock = 0; close(file); next }
    inblock { print > file }
  ' "$doc"
  for f in "$dir"/block_*.cc; do
    [ -e "$f" ] && blocks+=("$f")
  done
  # Relative links to .md files: [text](path.md) or [text](path.md#anchor).
  base=$(dirname "$doc")
  while IFS= read -r target; do
    case "$target" in http*) continue ;; esac
    [ -f "$base/$target" ] || { echo "FAIL: $doc links to $target, which does not exist"; fails=$((fails + 1)); }
  done < <(grep -o '](\([^)#]*\.md\)' "$doc" | sed 's/^](//' | sort -u)
done
# The blocks: each parsed alone, then all compiled to the end in one unit
# (tools/compile_units.sh); errors name the document and its line.
count=${#blocks[@]}
if [ "$count" -gt 0 ]; then
  bash "$(dirname "$0")/compile_units.sh" "${pch[@]}" "$flags_file" "${blocks[@]}" >"$tmp/blocks.log"
  sed '$d' "$tmp/blocks.log"
  fails=$((fails + $(tail -n 1 "$tmp/blocks.log" | awk '{print $(NF-1)}')))
fi
[ "$count" -gt 0 ] || { echo "FAIL: no \`\`\`cpp blocks found in ${docs[*]}"; exit 1; }
while IFS= read -r line; do
  [ -z "$line" ] && continue
  case "$line" in "(computed for"*) continue ;; esac
  # The README shows LibTorch 1.13's matrix; from 2.3 the fp16 rows' CPU
  # column is "yes", and the Float8 rows' columns follow 2.5 (CUDA) and 2.8
  # (CPU), the block-scaled ones' (MXFP8, NVFP4) 2.1 (the README's version
  # table says so).
  older=${line%| yes | yes |}"| no | yes |"
  float8_older=$(sed -E 's/\| (yes|no) \| (yes|no) \|$/| no | no |/' <<<"$line")
  if ! grep -qxF -- "$line" "$readme" && ! { [[ "$line" == *fp16* ]] && grep -qxF -- "$older" "$readme"; } &&
    ! { [[ "$line" == *Float8* ]] && grep -qxF -- "$float8_older" "$readme"; }; then
    echo "FAIL: README's support matrix lacks this computed row: $line"; fails=$((fails + 1))
  fi
done < <("$matrix_bin")
echo "$count C++ blocks checked in ${#docs[@]} files, $fails failures"
[ "$fails" -eq 0 ]
