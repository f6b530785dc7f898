#!/usr/bin/env bash
# A GradScaler state_dict written by torch::pickle_save, read back by Python.
set -euo pipefail
writer=$1 reader=$2
case "$writer" in /*) ;; *) writer="$PWD/$writer" ;; esac
py=$(command -v python3 || echo /usr/bin/python3)
# Debian's Python when it has torch (python3-torch): then torch.load is tried too.
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then py=/usr/bin/python3; fi
out=${TEST_TMPDIR:-$(mktemp -d)}/scaler_state.pt
"$writer" "$out"
"$py" "$reader" "$out"
