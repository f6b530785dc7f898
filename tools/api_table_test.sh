#!/usr/bin/env bash
# The public-API table (docs/api.md) and the headers agree: every public name
# that tools/public_api.py finds in include/ is a row of the table, with the
# same header, and every row names a public name of that header. Rows are the
# table lines `| `NAME` | `HEADER` | what it is |`.
#   api_table_test.sh [PUBLIC_API_PY [API_MD_OR_DOCS... [HEADER...]]]
# With no arguments (from the repository root): tools/public_api.py,
# docs/api.md, include/. Bazel passes the script, //:docs (the table is the
# argument that ends in docs/api.md) and //:amp_headers (include/ is the
# folder above their amp/).
set -u
export LC_ALL=C  # one collation for sort and comm
script=${1:-tools/public_api.py}
[ $# -gt 0 ] && shift
table="" include=""
for arg in "$@"; do
  case "$arg" in
    */docs/api.md | docs/api.md) table=$arg ;;
    *.h) [ -z "$include" ] && include=${arg%/amp/*} ;;
  esac
done
table=${table:-docs/api.md} include=${include:-include}
[ -f "$table" ] || { echo "FAIL: no table: $table"; exit 1; }
[ -d "$include/amp" ] || { echo "FAIL: no headers: $include/amp"; exit 1; }

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if ! python3 "$script" "$include" > "$tmp/headers.raw"; then
  echo "FAIL: $script $include failed"; exit 1
fi
sort -u "$tmp/headers.raw" > "$tmp/headers"
# The rows: first cell a `name`, second cell a `header`; sorted, and repeats kept
# (a name listed twice is a difference too).
# shellcheck disable=SC2016  # the backticks are Markdown's
awk -F'|' '/^\|/ && $2 ~ /^ *`[^`]+` *$/ && $3 ~ /^ *`[^`]+` *$/ {
  name = $2; header = $3; gsub(/[ `]/, "", name); gsub(/[ `]/, "", header); print name "\t" header
}' "$table" | sort > "$tmp/table"
[ -s "$tmp/table" ] || { echo "FAIL: $table has no rows (| \`name\` | \`header\` | ... |)"; exit 1; }

missing=0 stale=0 twice=0
while IFS=$'\t' read -r name header; do
  echo "in the headers, not in docs/api.md: $name ($header)"; missing=$((missing + 1))
done < <(comm -23 "$tmp/headers" <(sort -u "$tmp/table"))
while IFS=$'\t' read -r name header; do
  echo "in docs/api.md, not in the headers: $name ($header)"; stale=$((stale + 1))
done < <(comm -13 "$tmp/headers" <(sort -u "$tmp/table"))
while IFS= read -r name; do
  echo "in docs/api.md more than once: $name"; twice=$((twice + 1))
done < <(cut -f1 "$tmp/table" | uniq -d)
echo "$(wc -l < "$tmp/headers") public names in $include, $(wc -l < "$tmp/table") rows in $table:" \
  "$missing missing from the table, $stale not in the headers, $twice listed twice"
[ $((missing + stale + twice)) -eq 0 ]
