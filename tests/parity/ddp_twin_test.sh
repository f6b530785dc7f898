#!/usr/bin/env bash
# The multi-process parity pairs: amp::DataParallel against Python's DDP (ddp_parity, ddp_twin.py) and
# amp::FullyShard against torch's fully_shard (fsdp_parity, fsdp_twin.py), on the same LibTorch.
#   ddp_twin_test.sh CPP_HALF TWIN.py LAUNCH [N ...]      (default N: 2 3 4)
# For each N: `LAUNCH -n N -- CPP_HALF OUT` (rank 0 prints "ddp_parity: LibTorch X.Y on ..." or "fsdp_parity: ..."),
# then `TWIN.py OUT N...` with the first Python whose torch is the same X.Y; the twin
# runs N torch processes per world size and exits 1 on any difference.
set -euo pipefail
cpp_half=$1 twin=$2 launch=$3
shift 3
worlds=("$@")
[ ${#worlds[@]} -gt 0 ] || worlds=(2 3 4)
case "$cpp_half" in /*) ;; *) cpp_half="$PWD/$cpp_half" ;; esac
case "$launch" in /*) ;; *) launch="$PWD/$launch" ;; esac
out=${TEST_TMPDIR:-$(mktemp -d)}
# One thread everywhere: the same reduction order whatever the machine, and no
# OpenMP spinning against the tests Bazel runs beside this one. Collectives
# wait at most AMP_DP_TIMEOUT_MS (a dead peer fails the run, never hangs it).
export OMP_NUM_THREADS=1
export AMP_DP_TIMEOUT_MS=${AMP_DP_TIMEOUT_MS:-120000}
cpp=""
for n in "${worlds[@]}"; do
  rm -f "$out"/cpp_w"$n"_*
  if ! "$launch" -n "$n" -- "$cpp_half" "$out" >"$out/cpp_half_w$n.log" 2>&1; then
    cat "$out/cpp_half_w$n.log"
    echo "FAIL: the C++ half on $n processes"
    exit 1
  fi
  cat "$out/cpp_half_w$n.log"
  cpp=$(sed -n 's/^\[0\] [a-z_]*parity: LibTorch \([0-9.]*\) on .*/\1/p' "$out/cpp_half_w$n.log")
done
. "$(dirname "${BASH_SOURCE[0]}")/twin_python.sh"
twin_python "$cpp" "$twin" torch.distributed
rm -f "$out"/py_w*
"$py" "$twin" "$out" "${worlds[@]}"
