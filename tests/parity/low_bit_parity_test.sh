#!/usr/bin/env bash
# low_bit_parity on CPU, then its Python twin (torchao's low-bit Adam written
# in plain torch, eager) on the same LibTorch: losses, scales, parameters and
# quantized states bit for bit.
set -euo pipefail
parity=$1 twin=$2
case "$parity" in /*) ;; *) parity="$PWD/$parity" ;; esac
out=${TEST_TMPDIR:-$(mktemp -d)}
export OMP_NUM_THREADS=1  # the same reduction order in both programs
"$parity" "$out" | tee "$out/parity.log"
cpp=$(sed -n 's/^low_bit_parity: LibTorch \([0-9.]*\) on .*/\1/p' "$out/parity.log")
py=""
for cand in "${AMP_PYTHON:-}" /usr/bin/python3 "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && "$cand" -c 'import torch' 2>/dev/null; then py=$cand; break; fi
done
[ -n "$py" ] || { echo "amp: low_bit_parity_test needs Python's torch on the same LibTorch $cpp (Debian: python3-torch)"; exit 1; }
pyv=$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
[ "$pyv" = "$cpp" ] || { echo "amp: Python's torch is $pyv but amp was built against LibTorch $cpp"; exit 1; }
"$py" "$twin" "$out"
