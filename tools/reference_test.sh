#!/usr/bin/env bash
# The class reference (docs/reference.md) and the headers agree: for each
# class the page has a section for (a heading with `amp::Name`), the public
# members tools/reference_members.py finds in the class's header are the
# members the section's table rows name, no more, no fewer. The classes below
# must have a section.
#   reference_test.sh [REFERENCE_MEMBERS_PY [REFERENCE_MD_OR_DOCS... [HEADER...]]]
# With no arguments (from the repository root): tools/reference_members.py,
# docs/reference.md, include/. Bazel passes the script, //:docs (the page is
# the argument that ends in docs/reference.md) and //:amp_headers (include/ is
# the folder above their amp/).
set -u
export LC_ALL=C  # one collation for sort and comm
required="amp::Trainer amp::TrainerOptions amp::FitOptions amp::History amp::StepMetrics amp::StepResult
  amp::StepOptions amp::Stepper amp::GradientSync amp::UserState amp::Fabric amp::FabricOptions amp::Region
  amp::RegionOptions amp::Autocast amp::AutocastDisabled amp::PrecisionMap amp::DynamicScaler
  amp::DynamicScalerOptions amp::StaticScaler amp::StaticScalerOptions amp::NoScaler amp::LossScalerBase
  amp::detail::LowBitAdam amp::LowBitOptions amp::ShardedOptimizer amp::CheckpointOptions amp::ActivationMeter"
script=${1:-tools/reference_members.py}
[ $# -gt 0 ] && shift
page="" include=""
for arg in "$@"; do
  case "$arg" in
    */docs/reference.md | docs/reference.md) page=$arg ;;
    *.h) [ -z "$include" ] && include=${arg%/amp/*} ;;
  esac
done
page=${page:-docs/reference.md} include=${include:-include}
[ -f "$page" ] || { echo "FAIL: no reference page: $page"; exit 1; }
[ -d "$include/amp" ] || { echo "FAIL: no headers: $include/amp"; exit 1; }

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 "$script" doc "$page" | sort -u > "$tmp/doc" || { echo "FAIL: $script doc $page failed"; exit 1; }
cut -f1 "$tmp/doc" | sort -u > "$tmp/classes"
fails=0
for c in $required; do
  grep -qxF "$c" "$tmp/classes" || { echo "no section in $page: $c"; fails=$((fails + 1)); }
done
# shellcheck disable=SC2046  # one argument per class
if ! python3 "$script" headers "$include" $(cat "$tmp/classes") | sort -u > "$tmp/headers"; then
  echo "FAIL: $script headers $include failed (a section names a class no header defines)"; exit 1
fi
missing=0 stale=0
while IFS=$'\t' read -r class member; do
  echo "in the headers, not in $page: $class::$member"; missing=$((missing + 1))
done < <(comm -23 "$tmp/headers" "$tmp/doc")
while IFS=$'\t' read -r class member; do
  echo "in $page, not in the headers: $class::$member"; stale=$((stale + 1))
done < <(comm -13 "$tmp/headers" "$tmp/doc")
echo "$(wc -l < "$tmp/classes") classes, $(wc -l < "$tmp/headers") public members in $include:" \
  "$missing missing from $page, $stale not in the headers, $fails required classes without a section"
[ $((missing + stale + fails)) -eq 0 ]
