#!/usr/bin/env bash
# A GradScaler state_dict written by torch::pickle_save, read back by Python.
set -euo pipefail
writer=$1 reader=$2
case "$writer" in /*) ;; *) writer="$PWD/$writer" ;; esac
py=$(command -v python3 || echo /usr/bin/python3)
out=${TEST_TMPDIR:-$(mktemp -d)}/scaler_state.pt
"$writer" "$out"
"$py" "$reader" "$out"
