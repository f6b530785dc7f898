# Sourced by the parity pairs' scripts (twin_test.sh, ddp_twin_test.sh):
#   twin_python VERSION TWIN.py MODULE   sets $py to the first Python whose
# `import MODULE` works and whose torch is LibTorch VERSION (X.Y), or exits 1
# saying why: CMake's (AMP_PYTHON), Debian's (python3-torch), the one on PATH.
twin_python() {
  local cpp=$1 twin=$2 module=$3 cand pyv
  py=""
  for cand in "${AMP_PYTHON:-}" /usr/bin/python3 "$(command -v python3 || true)"; do
    if [ -n "$cand" ] && "$cand" -c "import $module" 2>/dev/null; then py=$cand; break; fi
  done
  if [ -z "$py" ]; then
    echo "amp: $(basename "$twin") needs Python's torch built on the same LibTorch $cpp (Debian: python3-torch)"
    exit 1
  fi
  pyv=$("$py" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))')
  if [ "$pyv" != "$cpp" ]; then
    echo "amp: Python's torch is $pyv but amp was built against LibTorch $cpp; the comparison needs the same library"
    exit 1
  fi
}
