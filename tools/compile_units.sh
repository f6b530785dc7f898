#!/usr/bin/env bash
# Compiles C++ sources as a compile-only check (-fsyntax-only, -Wall -Wextra
# -Werror on amp's code) at the cost of about one unit: each SRC is parsed to
# its end as its own unit, where a static assertion stops the compiler
# (-Wfatal-errors) before it instantiates templates, so every name it uses
# must be declared by what it includes (side by side, one per core); then all
# of them in one unit (tools/one_unit.sh), compiled to the end: the templates
# they use instantiated, warning-free. A source that starts with a #line
# directive (a documentation block) is named by it.
#   compile_units.sh [--unit-only] [--pch=HEADER] FLAGS_FILE SRC...
# --unit-only: the one unit alone (the compile-fail rules' passing twins, whose
# includes each rule's failing build checks). Prints a line per source parsed
# and one for the unit, then "N sources, F failed"; exits 1 when F > 0.
set -u
unit_only=0 pch=()
case "${1:-}" in --unit-only) unit_only=1; shift ;; esac
case "${1:-}" in --pch=*) pch=(-include "${1#--pch=}"); shift ;; esac
flags_file=$1; shift
cxx=${CXX:-g++}
read -r -a torch_flags < <(tr '\n' ' ' < "$flags_file")  # -std= comes with them
read -r -a more_flags <<<"${AMP_CXXFLAGS:-}"; torch_flags+=("${more_flags[@]}")  # the build's --copt (compile_check_run.sh)
common=("${torch_flags[@]}" "${pch[@]}" -fsyntax-only -Wall -Wextra -Werror -Iinclude)
for src in "$@"; do common+=(-iquote "$(dirname "$src")"); done  # their "..." includes, from a copy
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
sentinel="amp compile check: parsed to the end"
name_of() {  # "doc.md:LINE" for a source that starts with `#line LINE "doc.md"`, else its path
  sed -nE '1s/^#line ([0-9]+) "(.*)"$/\2:\1/p' "$1" | grep . || echo "$1"
}
jobs_max=$(nproc 2>/dev/null || echo 2) i=0
[ "$unit_only" -eq 1 ] || for src in "$@"; do
  while [ "$(jobs -pr | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  i=$((i + 1))
  { head -n 1 "$src" | grep -q '^#line ' || printf '#line 1 "%s"\n' "$src"
    cat "$src"; printf 'static_assert(sizeof(char) == 0, "%s");\n' "$sentinel"; } >"$tmp/$i.cc"
  ( "$cxx" "${common[@]}" -Wfatal-errors "$tmp/$i.cc" >"$tmp/$i.log" 2>&1
    grep -m1 -E 'error:' "$tmp/$i.log" | grep -qF "$sentinel"; echo $? >"$tmp/$i.status" ) &
done
bash "$(dirname "$0")/one_unit.sh" "$@" >"$tmp/all.cc" 2>"$tmp/all.log"
wait
fails=0 i=0
[ "$unit_only" -eq 1 ] || for src in "$@"; do
  i=$((i + 1))
  if [ "$(cat "$tmp/$i.status")" = 0 ]; then
    echo "ok   $(name_of "$src")"
  else
    echo "FAIL $(name_of "$src"):"; grep -v "$sentinel" "$tmp/$i.log" | head -20; fails=$((fails + 1))
  fi
done
if [ $# -gt 0 ] && [ ! -s "$tmp/all.log" ] && "$cxx" "${common[@]}" "$tmp/all.cc" >>"$tmp/all.log" 2>&1; then
  echo "ok   the $# sources in one unit, compiled to the end"
elif [ $# -gt 0 ]; then
  echo "FAIL: the $# sources in one unit, compiled to the end:"; head -40 "$tmp/all.log"; fails=$((fails + 1))
fi
echo "$# sources, $fails failed"
[ "$fails" -eq 0 ]
