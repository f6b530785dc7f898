#!/usr/bin/env bash
# Writes one translation unit that holds several C++ sources, so that a check
# compiles them to the end once (LibTorch's and amp's templates instantiated
# once) instead of once per source: first each source's prologue (its leading
# preprocessor lines, comments and blank lines: its #includes, conditional ones
# with their conditions), then each source's rest in a namespace of its own.
# Errors name each source's own file and line (a source that starts with a
# #line directive keeps its numbering: a documentation block).
#   one_unit.sh SRC... > UNIT.cc
# A source with an #include after its first declaration is refused (it would
# land inside the namespace). A source's main() is a plain function here,
# without main's implicit `return 0`: -Wreturn-type is off inside the sources
# (each one's own unit checks its non-template functions).
set -u
split() {  # prints "CUT" (the prologue's last line) and "FILE LINE" (where the rest starts)
  awk '
    NR == 1 && /^#line / { base = $2 - 2; name = $3; gsub(/"/, "", name); next }
    done { if ($0 ~ /^[[:space:]]*#[[:space:]]*include/) bad = NR; next }
    /^[[:space:]]*(\/\/.*)?$/ { if (depth == 0) cut = NR; next }
    /^[[:space:]]*#/ {
      if ($0 ~ /^[[:space:]]*#[[:space:]]*if/) depth++
      else if ($0 ~ /^[[:space:]]*#[[:space:]]*endif/) depth--
      if (depth == 0) cut = NR
      next
    }
    { done = 1; if (depth != 0) bad = NR }
    END {
      if (bad) { print "BAD " bad; exit }
      if (name == "") { name = FILENAME; base = 0 }
      print "CUT " cut + 0; print "AT " name " " base + cut + 1
    }' "$1"
}
declare -a cuts ats
k=0
for f in "$@"; do
  info=$(split "$f")
  case "$info" in BAD*) echo "one_unit.sh: $f:${info#BAD }: an #include after the first declaration (or inside an #if around one); move it up" >&2; exit 1 ;; esac
  cuts[k]=$(sed -n 's/^CUT //p' <<<"$info")
  ats[k]=$(sed -n 's/^AT //p' <<<"$info")
  k=$((k + 1))
done
k=0
for f in "$@"; do
  head -n "${cuts[k]}" "$f" | grep -v '^#line '
  k=$((k + 1))
done
k=0
for f in "$@"; do
  read -r name line <<<"${ats[k]}"
  echo '_Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wreturn-type\"")'
  echo "namespace amp_unit_part_$((k + 1)) {"
  echo "#line $line \"$name\""
  tail -n +"$((cuts[k] + 1))" "$f"
  echo "}  // namespace amp_unit_part_$((k + 1))"
  echo '_Pragma("GCC diagnostic pop")'
  k=$((k + 1))
done
