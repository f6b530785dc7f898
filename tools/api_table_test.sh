#!/usr/bin/env bash
# The public-API table (docs/api.md) and the headers agree: every public name
# that tools/public_api.py finds in include/ is a row of the table, with the
# same header, and every row names a public name of that header. Rows are the
# table lines `| `NAME` | `HEADER` | what it is |`.
#   api_table_test.sh [PUBLIC_API_PY [API_MD_OR_DOCS... [HEADER...]]]
# With no arguments (from the repository root): tools/public_api.py,
# docs/api.md, include/. Bazel passes the script, //:docs (the table is the
# argument that ends in docs/api.md) and //:amp_headers (include/ is the
# folder above their amp/). It also counts the rows per tier (the `## Core`,
# `## Features` and `## Extension points` headings) against the budget that
# docs/api.md states ("more than N core names or more than M in all", and the
# Core section's "At most N names"), every row in a tier.
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

# The tiers (issue 49): every row under one of the headings `## Core`,
# `## Features`, `## Extension points`; at most max_core core names and
# max_total in all (the public surface is a budget, not a log). The budget is
# the one the page states, read from it (the page says why it grew).
read -r max_core max_total < <(tr '\n' ' ' < "$table" | tr -s ' ' |
  sed -nE 's/.*more than ([0-9]+) core names or more than ([0-9]+) in all.*/\1 \2/p')
if [ -z "${max_total:-}" ]; then
  echo "FAIL: $table states no budget (\"more than N core names or more than M in all\")"; exit 1
fi
core_stated=$(awk '/^## / { tier = substr($0, 4); next } tier == "Core"' "$table" | tr '\n' ' ' | tr -s ' ' |
  grep -oE 'At most [0-9]+ names' | head -1 | tr -dc '0-9')
if [ "$core_stated" != "$max_core" ]; then
  echo "FAIL: $table's Core section says at most '${core_stated:-(nothing)}' names, its budget $max_core"; exit 1
fi
# shellcheck disable=SC2016  # the backticks are Markdown's
awk -F'|' '/^## / { tier = substr($0, 4) }
  /^\|/ && $2 ~ /^ *`[^`]+` *$/ && $3 ~ /^ *`[^`]+` *$/ { name = $2; gsub(/[ `]/, "", name); print (tier == "" ? "(none)" : tier) "\t" name }' \
  "$table" > "$tmp/tiers"
count() { awk -F'\t' -v t="$1" '$1 == t' "$tmp/tiers" | wc -l; }
core=$(count Core) features=$(count Features) extension=$(count "Extension points") total=$(wc -l < "$tmp/table")
untiered=0
while IFS=$'\t' read -r tier name; do
  case "$tier" in
    Core | Features | "Extension points") ;;
    *) echo "in no tier (## Core, ## Features, ## Extension points): $name (under '$tier')"; untiered=$((untiered + 1)) ;;
  esac
done < "$tmp/tiers"
over=0
if [ "$core" -gt "$max_core" ]; then
  echo "FAIL: $core core names, more than $max_core: move one to Features or Extension points, or to detail"; over=1
fi
if [ "$total" -gt "$max_total" ]; then
  echo "FAIL: $total public names, more than $max_total: move names a user never writes to a detail namespace"; over=1
fi
echo "tiers: $core core (at most $max_core), $features features, $extension extension points;" \
  "$total in all (at most $max_total); $untiered in no tier"
[ $((missing + stale + twice + untiered + over)) -eq 0 ]
