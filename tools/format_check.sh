#!/usr/bin/env bash
# Every C++ file follows .clang-format, and no line in include/ runs past 120
# columns: tools/format_check.sh [CLANG_FORMAT]. Prints one line per failing
# file and, as one check, "Format (clang-format X, N files): 1 passed, 0 failed"
# (or "0 passed, 1 failed") to fd 3 (or stdout).
# Fix with: clang-format -i $(git ls-files '*.h' '*.cc')
set -u
cd "$(dirname "$0")/.."
if ! { true >&3; } 2>/dev/null; then exec 3>&1; fi
cf=${1:-clang-format}
version=$("$cf" --version 2>/dev/null | sed -nE 's/.*version ([0-9]+).*/\1/p')
if [ -z "$version" ]; then
  echo "amp: $cf not found (apt-get install clang-format)" >&2
  echo "Format: 0 passed, 1 failed" >&3
  exit 1
fi
passed=0 failed=0
while IFS= read -r f; do
  if "$cf" --dry-run --Werror "$f" >/dev/null 2>&1 && ! grep -q '.\{121,\}' "$f"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL format: $f (clang-format -i $f)" >&2
  fi
done < <(git ls-files '*.h' '*.cc')
if [ "$failed" -eq 0 ]; then
  echo "Format (clang-format $version, $passed files): 1 passed, 0 failed" >&3
else
  echo "Format (clang-format $version, $failed of $((passed + failed)) files off): 0 passed, 1 failed" >&3
  exit 1
fi
